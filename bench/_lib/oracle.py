"""Oracle credit, the bound of step-level credit (benchmark only, not a product scheme): the scheme, its
training flow and the runner that keeps a run's record (`bench/oracle/oracle.py` and the clip screen run it).

Every trained step is credited with its Monte-Carlo true advantage `A*_k = V(x_{k+1}) - V(x_k)`
under the policy that sampled it (`stepgrpo_core.quality.oracle_advantages`): what a perfect
step-level credit would give, so its training gain over outcome credit bounds what any step-level
scheme can buy on this model and reward.

One iteration of `oracle_train` (a Prefect flow of the pipeline's own stages, `flows/train.py`'s
loop with one stage swapped): rollout -> score (the final samples, outcome's) -> **values** ->
credit -> update. The values stage continues every state `x_k` inside the SDE window `M` times
with the policy's own kernel and scores the final images; `V(x_k)` is their mean (`V(x_T) = R_T`,
and the states after the window evolve deterministically: `R_T`). Continuation `m` of every state
of one trajectory uses the same noise at each step `j` (common random numbers): `V(x_k)` and
`V(x_{k+1})` are each unbiased, and their difference does not carry the noise of the steps they
share, which a difference of independent means would (on the known-answer model, M = 16 independent
continuations correlate only ~0.5 with the exact `A*`, tests/test_quality.py). The values are
stored as reward rows (`<reward>-value`, version `<reward version>-crn<M>`, 0 NFEs counted in the
run's costs: the continuations' NFEs are in the rows' info), and the `oracle` plug-in scheme turns
them into advantages through the ordinary credit stage. So a run is resumable stage by stage like
any other.

Costs: `M * sum_{k < end} (T - k)` transformer rows and `M * end` scored images per trajectory
(W = 9, M = 4: 216 NFEs and 36 images, ~20x an outcome iteration's NFEs). Compared at equal
trajectories only.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from prefect import flow

from bench._lib.common import ROOT, relative, write_json
from bench._lib.runner import record_of
from bench._lib.window import QUICK_SET
from stepgrpo.plugins import scheme
from stepgrpo_core.quality import oracle_advantages

ORACLE = "bench._lib.oracle:oracle"  # the scheme's reference (imported by the benchmark's own config only)


@scheme(version="1", step_rewards=False)  # reads the value rows the flow writes, not completions
def oracle(rewards, gains, groups, trained=None):
    """`rewards [B, T+1]` hold the Monte-Carlo values `V(x_k)` (`V(x_T) = R_T`), so `gains` are
    `A*_k`; see `oracle_advantages`."""
    return oracle_advantages(rewards, trained)


def value_name(reward_name: str) -> str:
    return f"{reward_name}-value"


def value_rows(run: Any, cfg: Any, iteration: int, m: int) -> Any:
    """The values of `iteration`'s states, stored once as reward rows; their `ScoreResult`."""
    from stepgrpo.loops import workspace
    from stepgrpo.tasks.score import stored

    identity = workspace.reward_identity(cfg.reward)
    name, version = value_name(identity["name"]), f"{identity['version']}-crn{m}"
    if run.tables.read_rewards(iteration, name, version).num_rows == 0:
        t0 = time.perf_counter()
        values, nfe = monte_carlo_values(run, cfg, iteration, m)
        B, T1 = values.shape
        run.tables.append_rewards(
            iteration,
            name,
            version,
            np.repeat(np.arange(B), T1),
            np.tile(np.arange(T1), B),
            values.reshape(-1).numpy(),
            info={"nfe": nfe, "seconds": time.perf_counter() - t0, "continuations": m},
        )
    return stored(run, iteration, name, version)


@torch.no_grad()
def monte_carlo_values(run: Any, cfg: Any, iteration: int, m: int) -> tuple[torch.Tensor, int]:
    """`V(x_k)` `[B, T+1]` fp64 from `m` continuations per state with common random numbers (module
    doc), and the transformer rows they cost."""
    from stepgrpo.loops import workspace
    from stepgrpo.loops.sampling import encode, generator, stored_noise
    from stepgrpo.loops.scoring import reward_images, score_images
    from stepgrpo.prompts import stored_prompts
    from stepgrpo_core.conditioning import take
    from stepgrpo_core.kernels import KERNELS, step_moments

    identity = workspace.reward_identity(cfg.reward)
    finals = run.tables.reward_grid(iteration, identity["name"], identity["version"]).double()[:, -1]  # R_T [B]
    data = run.stages.read_rollout(iteration)
    pol = workspace.policy_at(run, cfg, iteration)
    reward = workspace.reward(cfg.reward)
    prompts = stored_prompts(run)
    B, T1 = data.states.shape[:2]
    T = T1 - 1
    start, size = (int(x) for x in data.kernel_params.get("window", [0, T]))
    end = start + size
    sigmas = torch.from_numpy(data.sigmas).to(pol.device)
    noise = stored_noise(data.kernel_params, pol.device)
    per_step = KERNELS.facts(data.kernel)["per_step"]
    cond = encode(pol, prompts.texts, data.prompt_ids)
    states = torch.from_numpy(data.states).to(pol.device, pol.dtype)
    gen = generator(cfg.run.seed, "oracle", iteration, device=pol.device)
    eps = torch.randn((B, m, T, *states.shape[2:]), generator=gen, device=pol.device)  # shared over k
    values = finals[:, None].expand(B, T1).clone()
    rows_per_call = max(1, cfg.model.max_batch // m)
    nfe0 = pol.nfe
    for k in range(end):
        for b0 in range(0, B, rows_per_call):
            rows = torch.arange(b0, min(B, b0 + rows_per_call))
            reps = rows.repeat_interleave(m)
            c = take(cond, reps)
            x = states[rows, k].repeat_interleave(m, 0)
            for j in range(k, T):
                v = pol.velocity(x, sigmas[j].repeat(x.shape[0]), c)
                kind = data.kernel if start <= j < end else "ode"
                mean, std = step_moments(kind, x, v, sigmas[j], sigmas[j + 1], noise[j] if per_step else noise)
                x = (mean + std * eps[rows, :, j].reshape(x.shape)).to(pol.dtype)
            images = reward_images(pol.decoder, x)[0]
            pids = data.prompt_ids[reps.numpy()]
            out = score_images(
                reward, images, prompts.texts_of(pids), prompts.metadata_of(pids), len(images), pol.decoder.device, ""
            )
            values[rows, k] = out.scores.double().reshape(len(rows), m).mean(1)
    return values, pol.nfe - nfe0


CONFIG = "configs/shapes_outcome_w9.yaml"
PRESETS = {
    "full": {"iterations": 50, "seeds": 3, "continuations": 2, "eval_every": 25, "set": ["run.eval_seeds=8"]},
    "quick": {
        "iterations": 2,
        "seeds": 1,
        "continuations": 2,
        "eval_every": 1,
        "set": QUICK_SET,
    },
}


def argv_of(p: dict[str, Any], seed: int) -> list[str]:
    return [CONFIG, str(p["continuations"]), *p["set"], f"run.iterations={p['iterations']}",
            f"run.eval_every={p['eval_every']}", f"run.seed={seed}"]  # fmt: skip


def train(p: dict[str, Any], seed: int, out: Path, records: Path, arm: str = "oracle_w9") -> None:
    """One oracle run (a process of its own with the benchmarks' environment), then its record as
    `records/<arm>/seed_<seed>.json` (another arm: other overrides in `p["set"]`, e.g. the clip screen's
    binding clip)."""
    from bench._lib.prefect import local_server
    from bench._lib.warm import command_env

    path = records / arm / f"seed_{seed}.json"
    argv = argv_of(p, seed)
    if path.is_file() and json.loads(path.read_text())["argv"] == argv:
        return
    run_dir = out / f"seed_{seed}"
    log = out / f"seed_{seed}.log"
    env = command_env(out)
    t0 = time.perf_counter()
    with local_server(env, out / "prefect-home") as (_, _, env):
        cmd = [sys.executable, "-m", "bench._lib.oracle", CONFIG, str(run_dir), *argv[1:]]
        with log.open("w") as f:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"{arm} seed {seed} exited {rc}; see {relative(log)}")
    record = record_of(run_dir, argv)
    record["values"] = values_cost(run_dir)
    write_json(path, record)
    print(f"{arm} seed {seed}: recorded after {time.perf_counter() - t0:.0f} s", flush=True)


def values_cost(run_dir: Path) -> dict[str, list[float]]:
    """Per iteration, the continuations' transformer rows and seconds (not in the run's own costs)."""
    from stepgrpo.storage.run import Run

    run = Run.open(run_dir)
    nfe, seconds = [], []
    for i in run.iterations("checkpoint"):
        table = run.tables.read_rewards(i)
        ((name, version),) = {
            (n, v)
            for n, v in zip(table.column("reward_name").to_pylist(), table.column("reward_version").to_pylist())
            if n.endswith("-value")
        }
        info = run.tables.rows_info("rewards", run.tables.rewards_digest(i, name, version))
        nfe.append(info["nfe"])
        seconds.append(info["seconds"])
    return {"nfe": nfe, "seconds": seconds}


@flow(name="oracle-train", log_prints=True)
def oracle_train(config_path: str | None, overrides: list[str], run_dir: str, continuations: int) -> dict[str, Any]:
    """`flows/train.py`'s loop with outcome's scoring and the oracle's values in place of completions."""
    from stepgrpo.checks import check_config
    from stepgrpo.config import config_from
    from stepgrpo.flows.progress import TrainingLog, name_flow_run
    from stepgrpo.loops.update import export_lora
    from stepgrpo.runs import open_run, owned, resolve_run_dir
    from stepgrpo.runtime import environment
    from stepgrpo.tasks import bind
    from stepgrpo_core.registry import allow

    allow(ORACLE)
    cfg = config_from(None, config_path, [*overrides, f"credit.scheme={ORACLE}", "completion.method=null"])
    environment.apply(cfg.scale.threads)
    check_config(cfg)
    with owned(resolve_run_dir(cfg, run_dir)) as path:
        run = open_run(cfg, path)
        name_flow_run(f"{run.run_id} oracle")
        stage = bind(run, cfg)
        prompts = stage.prompts(run, cfg)
        checkpoint = None
        with TrainingLog(run, cfg) as log:
            log.evaluation(0, stage.evaluate(run, cfg, -1, prompts, checkpoint))
            for i in range(cfg.run.iterations):
                rollout = stage.rollout(run, cfg, i, prompts, checkpoint, None)
                rewards = stage.score(run, cfg, i, rollout, rollout)
                credit = stage.credit(run, cfg, i, value_rows(run, cfg, i, continuations))
                checkpoint = stage.update(run, cfg, i, credit, rollout, checkpoint)
                log.iteration(i, rollout, rollout, rewards, credit, checkpoint, None)
                if cfg.run.evaluates_after(i):
                    log.evaluation(i + 1, stage.evaluate(run, cfg, i, prompts, checkpoint))
            return log.finish(export_lora(run, cfg, cfg.run.iterations - 1))


if __name__ == "__main__":  # python -m bench._lib.oracle CONFIG RUN_DIR M [key=value ...]
    import sys

    config, run_dir, m, *sets = sys.argv[1:]
    oracle_train(config, sets, run_dir, int(m))
