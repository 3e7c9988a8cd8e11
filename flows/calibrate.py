"""DenseGRPO exploration calibration: the per-step noise table `psi` of a run's `psi` kernel."""

from __future__ import annotations

from typing import Any

from prefect import flow

from stepgrpo import report, stages
from stepgrpo.config import load_config
from tasks.stages import bind


@flow(name="calibrate", log_prints=True)
def calibrate(config_path: str | None = None, overrides: list[str] | None = None, run_dir: str | None = None,
              run_id: str | None = None) -> dict[str, Any]:
    """Calibrate `psi` into the run (created if new); `stepgrpo train` with the same run then uses it."""
    cfg = load_config(config_path, overrides or [])
    path = report.resolve_run_dir(cfg, run_dir, run_id)
    stages.open_run(cfg, path)
    conf, where, t = cfg.model_dump(mode="json"), str(path), bind(path)
    prompts = t.prompts(where, conf, 0, {})
    result = t.calibrate(where, conf, 0, {"prompts": prompts["digest"]})
    print(f"psi after {len(result['rounds'])} rounds: {[round(p, 4) for p in result['psi']]}")
    return {"run_dir": where, **result}
