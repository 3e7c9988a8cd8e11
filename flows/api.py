"""The Python entry: what the `stepgrpo` commands do, as functions that return typed results
(the README shows them in use; `stepgrpo` hands these names on from here).

They sit with the flows they run, below the CLI, which calls them; each imports its flow when
called, checks its input before any flow or server starts (the CLI's checks and errors), holds the
run's lock while its flow runs, and talks to Prefect as the CLI does: `PREFECT_API_URL`'s server,
else a kept one (`stepgrpo server start`), else a temporary one for the Python process.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stepgrpo.flows import session
from stepgrpo.flows.outcomes import Interrupted, QualityCheck, TrainResult
from stepgrpo.flows.stored import compare, export

if TYPE_CHECKING:  # imported where used: `import stepgrpo` (every module of it does) stays cheap
    from stepgrpo.config import Config
    from stepgrpo.results import CreditResult, EvaluateResult, ScoreResult
    from stepgrpo.storage.run import Run

__all__ = [
    "Interrupted",
    "QualityCheck",
    "TrainResult",
    "calibrate",
    "compare",
    "credit",
    "credit_quality",
    "evaluate",
    "evaluate_protocol",
    "export",
    "open_run",
    "rescore",
    "train",
]


def train(
    config: Config | Mapping[str, Any] | str | Path | None = None,
    *,
    overrides: Sequence[str] = (),
    run_id: str | None = None,
    run_dir: str | Path | None = None,
) -> TrainResult:
    """Train (or resume, or extend) a run.

    Args:
        config: A `Config`, a mapping of its sections, a YAML file, a shipped config's name
            (`"shapes_dense"`), or None for the defaults.
        overrides: `key=value` changes on top (`"optim.lr=1e-4"`), as `--set`.
        run_id: The run under `run.runs_root` (resumed if it exists); None: a new id.
        run_dir: Or the run directory itself.
    """
    from stepgrpo.checks import check_train
    from stepgrpo.config import user_set
    from stepgrpo.results import EvaluateResult

    cfg = session.config_of(config, overrides)
    path = check_train(cfg, str(run_dir) if run_dir is not None else None, run_id, user_set=user_set(config, overrides))
    try:
        with session.prefect_server():
            from stepgrpo.flows.train import train as train_flow

            out = session.owned_run(path, train_flow, config=cfg, run_dir=str(path))
    except KeyboardInterrupt as err:
        raise Interrupted(path) from err
    except Exception as err:  # Prefect, interrupted mid-way through a task's setup, may raise its own error instead
        if session.INTERRUPTED:
            raise Interrupted(path) from err
        raise
    return TrainResult(
        run_id=out["run_id"],
        run_dir=Path(out["run_dir"]),
        tracking_uri=out["tracking_uri"],
        evaluations=[EvaluateResult.model_validate(e) for e in out["evaluations"]],
        iterations=out["iterations"],
    )


def rescore(
    run: str | Path,
    reward: str,
    *,
    options: Mapping[str, Any] | None = None,
    iterations: Sequence[int] | None = None,
) -> list[ScoreResult]:
    """Score the stored trajectories of `run` (a directory or a run id) with another reward; no transformer call."""
    from stepgrpo.checks import check_run
    from stepgrpo.results import ScoreResult

    todo = list(iterations) if iterations is not None else "all"
    path = check_run(str(run), reward=reward, reward_options=dict(options or {}), rescore_iterations=todo)
    with session.offline_log(path), session.prefect_server(heartbeats=False):
        from stepgrpo.flows.rescore import rescore as rescore_flow

        out = session.owned_run(
            path,
            rescore_flow,
            run=str(path),
            reward=reward,
            reward_options=dict(options or {}),
            iterations=list(iterations) if iterations is not None else None,
        )
    return [ScoreResult.model_validate(s) for s in out["scores"]]


def credit(
    run: str | Path,
    scheme: str,
    *,
    options: Mapping[str, Any] | None = None,
    reward: str | None = None,
) -> list[CreditResult]:
    """Recompute the advantages of `run` with another credit scheme, from its stored rewards only."""
    from stepgrpo.checks import check_run
    from stepgrpo.results import CreditResult

    path = check_run(str(run), scheme=scheme, scheme_options=dict(options or {}))
    with session.offline_log(path), session.prefect_server(heartbeats=False):
        from stepgrpo.flows.credit import credit as credit_flow

        out = session.owned_run(
            path, credit_flow, run=str(path), scheme=scheme, options=dict(options or {}), reward=reward
        )
    return [CreditResult.model_validate(a) for a in out["advantages"]]


def evaluate(
    run: str | Path, *, iteration: int | None = None, overrides: Sequence[str] = (), protocol: str | None = None
) -> EvaluateResult | dict[str, Any]:
    """Held-out reward of `run`'s policy after `iteration` (default: the latest checkpoint; -1:
    the base model); `overrides` may change evaluation settings (`run.eval_prompts=32`). With
    `protocol`, a paper's protocol instead (`evaluate_protocol`: its evidence bundle and report)."""
    if protocol is not None:
        return evaluate_protocol(run, protocol, iteration=iteration, overrides=overrides)
    from stepgrpo.checks import check_checkpoint, check_run
    from stepgrpo.results import EvaluateResult

    path = check_run(str(run), overrides=list(overrides))
    check_checkpoint(path, iteration)
    with session.offline_log(path), session.prefect_server(heartbeats=False):
        from stepgrpo.flows.evaluate import evaluate as evaluate_flow

        out = session.owned_run(path, evaluate_flow, run=str(path), iteration=iteration, overrides=list(overrides))
    return EvaluateResult.model_validate(out)


def evaluate_protocol(
    run: str | Path,
    protocol: str,
    *,
    iteration: int | None = None,
    overrides: Sequence[str] = (),
    images: bool = False,
) -> dict[str, Any]:
    """`run`'s policy after `iteration` under a paper's evaluation protocol (`stepgrpo.prompts.protocols`):
    `{"bundle": its evidence folder, "report": the numbers}`. The protocol's prompt file is checked
    (pinned: cached and matching its hash) before any server starts or model loads."""
    from stepgrpo.checks import check_checkpoint, check_reward_weights, check_run
    from stepgrpo.prompts import find_prompt_file
    from stepgrpo.prompts.protocols import protocol as named
    from stepgrpo.storage.run import Run

    p = named(protocol)
    if p.prompts != "shapes":
        find_prompt_file(p.prompts)  # a missing or mismatched pinned file: one line, now
    path = check_run(str(run), overrides=list(overrides))
    reward = Run.open(path).config.get("reward") or {}  # the scorer's weights, as the evaluation will load them
    options = dict(reward.get("options") or {}) if reward.get("name") == p.reward else {}
    check_reward_weights(p.reward, options, where=f"protocol {p.name}'s scorer")
    check_checkpoint(path, iteration)
    with session.offline_log(path), session.prefect_server(heartbeats=False):
        from stepgrpo.flows.evaluate import evaluate_protocol as flow

        return session.owned_run(
            path, flow, run=str(path), protocol=protocol, iteration=iteration, overrides=list(overrides), images=images
        )


def credit_quality(
    run: str | Path,
    *,
    iteration: int | None = None,
    continuations: int = 8,
    schemes: Sequence[str] | None = None,
    seed: int = 0,
    overrides: Sequence[str] = (),
    methods: Sequence[str] | None = None,
) -> QualityCheck:
    """Judge credit schemes on a stored iteration of `run` (default: the latest scored one) against
    Monte-Carlo true advantages from `continuations` SDE continuations per state (METHODS.md,
    "Judging credit"); `schemes`: default every registered one. `methods`: completion methods whose
    step rewards are judged beside the run's own (`scheme:method`, with their NFEs)."""
    from stepgrpo.checks import check_quality
    from stepgrpo.results import QualityResult

    path = check_quality(str(run), iteration, continuations, list(schemes or []), list(methods or []), list(overrides))
    with session.prefect_server():
        from stepgrpo.flows.quality import credit_quality as quality_flow

        out = session.owned_run(
            path,
            quality_flow,
            run=str(path),
            iteration=iteration,
            continuations=continuations,
            schemes=list(schemes) if schemes else None,
            seed=seed,
            overrides=list(overrides) or None,
            methods=list(methods) if methods else None,
        )
    record = Path(out.pop("record"))
    run_dir = Path(out.pop("run_dir"))
    return QualityCheck(QualityResult.model_validate(out), record, run_dir)


def calibrate(
    config: Config | Mapping[str, Any] | str | Path | None = None,
    *,
    overrides: Sequence[str] = (),
    run_id: str | None = None,
    run_dir: str | Path | None = None,
) -> tuple[list[float], Path]:
    """DenseGRPO's psi calibration into a run (then `train` with the same config and run id);
    returns psi and the run directory."""
    from stepgrpo.checks import check_train

    cfg = session.config_of(config, overrides)
    path = check_train(cfg, str(run_dir) if run_dir is not None else None, run_id, calibrated=True)
    with session.prefect_server():
        from stepgrpo.flows.calibrate import calibrate as calibrate_flow

        out = session.owned_run(path, calibrate_flow, config=cfg, run_dir=str(path))
    return list(out["psi"]), Path(out["run_dir"])


def open_run(run: str | Path) -> Run:
    """The stored run (a directory or a run id under runs/), opened as data: its manifest, stages,
    reward and advantage tables (`run.tables.read_rewards()`), checkpoints and records."""
    from stepgrpo.storage.run import Run, find_run

    return Run.open(find_run(str(run)))
