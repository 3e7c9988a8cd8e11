"""Shared helpers of the benchmark scripts: the environment, the machine, one pipeline run read back
from its run directory, and small statistics (the in-process reference loop is library code:
`stepgrpo.loops.reference`).

The benchmarks are the package `bench`: every script runs from the repository's root as a module,
`python -m bench.<question>.<script>`, and imports only `bench._lib` and the product.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parents[1]
ROOT = BENCH_DIR.parent

OUT_DIR = BENCH_DIR / "out"  # gitignored; the numbers quoted in docs are copied to docs/bench/
SHIPPED_MODEL = "models/shapes"

# Shared by every configuration of bench/credit_schemes/credit_schemes.py and bench/costs/costs.py (the earlier CPU
# recipe, CFG 2.5, every step stochastic; configs/shapes_*.yaml hold the recipe that learns, see
# bench/learning/learning.py). T = 10 and a = 0.7 are Flow-GRPO's; no KL term, so the update is one
# forward + backward per trained step; 2 optimizer steps per iteration (the default). Short probes
# of `outcome` on an intermediate pretraining checkpoint: lr 1e-2
# collapsed the held-out reward within 6 iterations; 3e-3 and 1e-3 moved it by +-0.02.
COMMON = {
    "model.dtype": "float32",
    "model.device": "cpu",
    "model.guidance_scale": 2.5,
    "model.lora_rank": 8,
    "model.lora_alpha": 16,
    "model.max_batch": 128,
    "sampler.steps": 10,
    "sampler.noise": 0.7,
    "sampler.eval_steps": 10,
    "reward.name": "shapes",
    "optim.lr": 1.0e-3,
    "optim.clip_range": 1.0e-3,
    "optim.kl_beta": 0.0,
    "optim.micro_batch": 8,
    "run.eval_seeds": 1,
    "calibration.rounds": 3,
    "calibration.prompts": 4,
    "run.name": "bench",
}


def setup_env(out: Path, threads: int | None = None) -> None:
    """Environment every benchmark process runs in; call before importing prefect / torch users.

    A Prefect home of its own (its temporary server's database never competes with other runs'),
    a generous server start-up timeout (the machine may be busy), no telemetry, quiet logs.
    """
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_HOME", str(out / "prefect-home"))  # under `--out`, which it has made
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.chdir(ROOT)  # relative paths in configs (models/shapes) resolve from the repository root
    import torch

    if threads:
        torch.set_num_threads(threads)
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    import logging

    for name in ("mlflow", "alembic", "prefect", "httpx"):
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        from diffusers.utils import logging as dlog

        dlog.disable_progress_bar()
        from transformers.utils import logging as tlog

        tlog.disable_progress_bar()
    except ImportError:
        pass


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    import torch

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": mem,
        "gpu": torch.cuda.is_available(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "load_avg": list(os.getloadavg()),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def model_path(requested: str | None = None) -> str:
    """The model to benchmark: `requested`, else the shipped `models/shapes` (must exist)."""
    path = requested or SHIPPED_MODEL
    if not (ROOT / path / "model_index.json").is_file() and not (Path(path) / "model_index.json").is_file():
        raise SystemExit(
            f"no model at {path}: the shipped model is built by `stepgrpo pretrain`; "
            "pass --model DIR to benchmark another SD3 pipeline directory"
        )
    return path


def relative(path: Path) -> str:
    """`path` relative to the repository root when it is inside it (what scripts print)."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True, default=_plain) + "\n")
    tmp.replace(path)


def _plain(x: Any) -> Any:
    """JSON for what `json` does not know: tensors and arrays as lists (or numbers), else a float."""
    return x.tolist() if hasattr(x, "tolist") else float(x)


# --------------------------------------------------------------------------- a pipeline run


def train_flow(overrides: Sequence[str], run_id: str, config_path: str | None = None) -> dict[str, Any]:
    """Run the product's `train` flow in this process; returns its result and the wall seconds."""
    from stepgrpo.flows.train import train

    t0 = time.perf_counter()
    out = train(config_path=config_path, overrides=list(overrides), run_id=run_id)
    out["flow_seconds"] = time.perf_counter() - t0
    return out


@dataclass
class RunRecord:
    """One finished pipeline run, read back from its run directory (all lists per iteration)."""

    train_reward: list[float]  # mean R_T of the iteration's rollout (SDE samples, training prompts)
    train_strict: list[float]
    iter_seconds: list[float]  # wall seconds of each iteration (checkpoint to checkpoint, evals excluded)
    stage_seconds: list[dict[str, float]]  # rollout / complete / update seconds as the stages recorded them
    nfe: list[dict[str, int]]  # rollout / ODE reference / complete / update transformer rows (a CFG pair counts once)
    gains: list[list[float]]  # mean gain g_k per step k (empty without step rewards)
    heldout: list[dict[str, Any]]  # evaluations: iteration (0 = base), reward, strict, sub-scores
    setup_seconds: float  # before iteration 0: psi calibration (other set-up is not training)
    extra: dict[str, Any] = field(default_factory=dict)  # turning points; the reward grids [B, T+1] per iteration


def open_run_once(run_dir: Path) -> Any:
    """The stored run, its rewards table read once: every later `read_rewards` (and so
    `reward_grid`) of it selects from those rows in memory.

    The store reads one iteration's rewards by scanning every part of the table (one part an
    iteration), so reading a 300-iteration run iteration by iteration opens 300 x 300 files; the
    benchmarks read whole runs, and this keeps that linear.
    """
    import pyarrow.compute as pc

    from stepgrpo.storage import Run

    run = Run.open(run_dir)
    rows = run.tables.read_rewards()

    def read_rewards(iteration=None, reward_name=None, reward_version=None, as_pandas=False):  # noqa: ANN001, ANN202
        table = rows
        for column, value in (
            ("iteration", iteration),
            ("reward_name", reward_name),
            ("reward_version", reward_version),
        ):
            if value is not None:
                table = table.filter(pc.equal(table[column], value))
        return table.to_pandas() if as_pandas else table

    run.read_rewards = read_rewards
    return run


def read_run(run_dir: Path) -> RunRecord:
    """Everything the benchmarks plot, from a finished run directory (storage API + stage files).

    Wall-clock per iteration is the time between publications of consecutive checkpoints (the
    update stage publishes last in an iteration) minus the evaluations that ran in between, so it
    holds every stage and all the pipeline's own overhead (Prefect, storage, MLflow). Iteration 0
    is counted from the start of its rollout stage.
    """
    import numpy as np

    from stepgrpo.config import validate_config
    from stepgrpo.results import EvaluateResult
    from stepgrpo.storage.schema import completion_stage

    run = open_run_once(run_dir)
    cfg = validate_config(run.config)
    evals = {}
    for f in sorted((run_dir / "eval").glob("*.json")):
        e = json.loads(f.read_text())
        if f.stem != e["label"]:
            continue  # an evaluation with other settings than the run's
        e["finished"] = f.stat().st_mtime
        evals[e["label"]] = e
    n = len(run.iterations("checkpoint"))
    rewards, stricts, secs, stage_secs, nfes, gains, grids = [], [], [], [], [], [], []
    # Iteration 0 starts when its rollout stage started (published time minus its own seconds):
    # between the base evaluation and that, the flow does one-time set-up (the MLflow store).
    ro0 = run.stage_manifest(0, "rollout") if n else None
    prev_end = (
        (run.stage_path(0, "rollout") / "_published.json").stat().st_mtime - ro0["inputs"].get("seconds", 0.0)
        if n
        else 0.0
    )
    calib = run_dir / "calibration" / "psi.json"
    setup = json.loads(calib.read_text())["seconds"] if calib.is_file() else 0.0
    method = cfg.completion.method
    # The update's transformer forwards (one per trained step and trajectory, twice with a KL
    # reference), for checkpoints written before the update recorded its own count.
    B = cfg.run.prompts_per_iteration * cfg.run.group_size
    update_nfe = B * len(cfg.trained_steps()) * (2 if cfg.optim.kl_beta > 0 else 1)
    for i in range(n):
        rows = run.tables.read_rewards(i)
        names = sorted(set(rows.column("reward_name").to_pylist()))
        name = cfg.reward.name if cfg.reward.name in names else names[0]
        grid = run.tables.reward_grid(i, name).numpy()
        grids.append(grid)
        strict = run.tables.reward_grid(i, name, field="strict").numpy()
        rewards.append(float(grid[:, -1].mean()))
        stricts.append(float(np.nanmean(strict[:, -1])) if np.isfinite(strict[:, -1]).any() else float("nan"))
        gains.append(np.diff(grid, axis=1).mean(0).tolist() if np.isfinite(grid).all() else [])
        ro = run.stage_manifest(i, "rollout")
        cm = run.stage_manifest(i, completion_stage(method)) if method else None
        state = json.loads((run.stage_path(i, "checkpoint") / "state.json").read_text())
        stage_secs.append(
            {
                "rollout": ro["inputs"].get("seconds", float("nan")),
                "complete": cm["inputs"].get("seconds", float("nan")) if cm else 0.0,
                # the manifest holds it (older checkpoints kept it in state.json)
                "update": run.stage_manifest(i, "checkpoint")["inputs"].get(
                    "seconds", state.get("seconds", float("nan"))
                ),
            }
        )
        nfes.append(
            {
                "rollout": int(ro["inputs"].get("nfe", 0)),
                "ode_reference": int(ro["inputs"].get("nfe_ode", 0)),
                "complete": int(cm["attrs"]["nfe"]) if cm else 0,
                "update": int(run.stage_manifest(i, "checkpoint")["inputs"].get("nfe", update_nfe)),
            }
        )
        end = (run.stage_path(i, "checkpoint") / "_published.json").stat().st_mtime
        between = [e for e in evals.values() if e["label"] != "base" and prev_end < e["finished"] <= end]
        secs.append(end - prev_end - sum(e["seconds"] for e in between))
        prev_end = end
    # turning points (TP-GRPO) the stored rewards give, before and after the balancing rule
    turning = []
    if gains and all(gains):
        import torch

        from stepgrpo_core.credit import turning_point_rewards, turning_points

        for stored in grids:
            grid = torch.from_numpy(stored).float()
            raw = int(turning_points(grid, grid[:, 1:] - grid[:, :-1]).sum())
            # the run's own options when it trained with turning points (else the defaults)
            opts = dict(cfg.credit.options) if cfg.credit.scheme == "turning_point" else {}
            turning.append({"raw": raw, "kept": int(turning_point_rewards(grid, **opts)[1].sum())})
    heldout = []
    for label, e in evals.items():
        it = 0 if label == "base" else int(label.removeprefix("iter_")) + 1
        heldout.append(
            {
                "iteration": it,
                "reward": e["reward_mean"],
                "strict": e.get("reward_strict", float("nan")),
                **{f"sub_{k}": v for k, v in EvaluateResult.model_validate(_record(e)).sub.items()},
                "seconds": e["seconds"],
                "nfe": e["nfe"],
            }
        )
    heldout.sort(key=lambda h: h["iteration"])
    extra = {"turning_points": turning, "grids": grids}
    return RunRecord(rewards, stricts, secs, stage_secs, nfes, gains, heldout, setup, extra)


def _record(e: dict[str, Any]) -> dict[str, Any]:
    """An evaluation file's record without what `read_run` added to it."""
    return {k: v for k, v in e.items() if k != "finished"}


# ----------------------------------------------------------------------------- statistics


def mean_ci(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """Mean and a Student-t confidence interval over independent runs (seeds), NaN skipped; the
    interval is NaN for n < 2 (`stepgrpo.reporting.report.mean_interval` does the arithmetic)."""
    from stepgrpo.reporting.report import mean_interval

    v = [x for x in values if x == x]
    if not v:
        return float("nan"), float("nan"), float("nan")
    if len(v) < 2:
        return v[0], float("nan"), float("nan")
    return mean_interval(v, level)


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (fewer at the start)."""
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1) : i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def first_reach(values: Sequence[float], threshold: float) -> int | None:
    """1-based iteration count at which `values` first reaches `threshold`, else None."""
    for i, v in enumerate(values):
        if v >= threshold:
            return i + 1
    return None
