"""A flow that checks an installation: the config validates, the model and registries resolve.

Cheap enough to schedule as a smoke test of a work pool (`prefect.yaml` deploys it as `check`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefect import flow


@flow(name="check", log_prints=True)
def check(
    config_path: str | None = "configs/demo.yaml", overrides: list[str] | None = None, report: str | None = None
) -> dict[str, Any]:
    """Validate `config_path` (+ overrides) and list what the registries know; write `report` (JSON) if given."""
    from stepgrpo.config import load_config
    from stepgrpo.loops.workspace import resolve_model_path
    from stepgrpo.rewards import REWARDS
    from stepgrpo.runtime import environment
    from stepgrpo_core.completions import COMPLETIONS
    from stepgrpo_core.credit import SCHEMES
    from stepgrpo_core.kernels import KERNELS

    cfg = load_config(config_path, overrides or [])
    threads = environment.apply(cfg.scale.threads)
    try:
        model = {"path": resolve_model_path(cfg.model.path), "found": True}
    except FileNotFoundError as err:  # reported, not raised: the rest of the check still says something
        model = {"path": cfg.model.path, "found": False, "error": str(err)}
    result = {
        "config": cfg.run.name,
        "model": model,
        "kernels": KERNELS.names(),
        "completions": COMPLETIONS.names(),
        "schemes": SCHEMES.names(),
        "rewards": REWARDS.names(),
        "torch_threads": threads,
    }
    print(json.dumps(result))
    if report:
        Path(report).write_text(json.dumps(result))
    return result
