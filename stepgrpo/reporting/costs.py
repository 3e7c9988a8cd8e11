"""What each stored iteration of a run cost: transformer NFEs and seconds per stage, read from the
stages' manifests and table footers (no model, no config validation: a stored run is data).
`stepgrpo inspect RUN --json` prints it; the benchmarks compare schemes by it.

NFE = transformer rows evaluated (a CFG pair counts once): the rollout's sampling, its ODE
reference sample of each group's `x_0`, the completions, the update's forwards (the policy's, and
the old, EMA and base adapters' an objective reads). `passes` adds the update's backward passes at
two forwards each (a backward computes the gradients of the activations and of the weights, each
about a forward's FLOPs): the one compute measure that compares objectives whose updates differ
(GRPO's log-prob passes against DiffusionNFT's three forwards and a backward per row). A run stored
before backward passes were recorded has `passes` None. Seconds are each stage's own (evaluations
excluded).
"""

from __future__ import annotations

from typing import Any

from stepgrpo.storage.run import Run
from stepgrpo.storage.schema import completion_stage

BACKWARD_PASSES = 2  # a backward pass, in forward passes


def iteration_costs(run: Run) -> list[dict[str, Any]]:
    """`iteration_cost` of every iteration with a published rollout."""
    return [iteration_cost(run, i) for i in run.iterations("rollout")]


def iteration_cost(run: Run, i: int) -> dict[str, Any]:
    """Iteration `i`'s record: `{iteration, nfe, passes, seconds, nfe_stages, seconds_stages,
    completion, reward_mean}` (a stage not published yet is absent from the per-stage maps and counts 0). The one
    definition of a run's cost: `compare`, `inspect --json`, the benchmarks and the live compute axis
    (MLflow's and W&B's `cost/nfe_total`) all sum these."""
    method = (run.config.get("completion") or {}).get("method", "remaining")
    reward = (run.config.get("reward") or {}).get("name")
    nfe: dict[str, int] = {}
    seconds: dict[str, float] = {}
    ro = run.stage_manifest(i, "rollout")
    nfe["rollout"] = int(ro["inputs"].get("nfe", 0))
    nfe["ode_reference"] = int(ro["inputs"].get("nfe_ode", 0))
    seconds["rollout"] = float(ro["inputs"].get("seconds", 0.0))
    if method is not None and (cm := run.stage_manifest(i, completion_stage(method))) is not None:
        nfe["complete"] = int(cm["attrs"].get("nfe", 0))
        seconds["complete"] = float(cm["inputs"].get("seconds", 0.0))
    reward_mean = None
    if reward is not None and (run.path / "rewards").is_dir():
        rows = run.tables.read_rewards(i, reward)
        if rows.num_rows:
            version = sorted(set(rows.column("reward_version").to_pylist()))[-1]
            grid = run.tables.reward_grid(i, reward, version)
            reward_mean = float(grid[:, -1].mean())
            seconds["score"] = float(
                run.tables.rows_info("rewards", run.tables.rewards_digest(i, reward, version)).get("seconds", 0.0)
            )
    backward: int | None = 0
    if (ck := run.stage_manifest(i, "checkpoint")) is not None:
        nfe["update"] = int(ck["inputs"].get("nfe", 0))
        seconds["update"] = float(ck["inputs"].get("seconds", 0.0))
        backward = ck["inputs"].get("backward")
    return {
        "iteration": i,
        "nfe": sum(nfe.values()),
        "passes": None if backward is None else sum(nfe.values()) + BACKWARD_PASSES * int(backward),
        "seconds": round(sum(seconds.values()), 3),
        "nfe_stages": nfe,
        "seconds_stages": {k: round(v, 3) for k, v in seconds.items()},
        "completion": method,
        "reward_mean": reward_mean,
    }
