"""What each part of stepgrpo costs, measured in one run, as ratios (issue 5).

On the shipped `models/shapes` model (CPU unless `--device`), with the benchmark settings of
`bench/credit_schemes/credit_schemes.py` (B = prompts x group size trajectories, T = 10, CFG 2.5):

1. NFEs per iteration for every credit scheme and completion method, counted by the policy's
   transformer counter on one real rollout (and checked against the formulas of METHODS.md), with
   the seconds each costs here, and the one-time DenseGRPO `psi` calibration.
2. Seconds per stage of the pipeline (`train` flow: rollout, complete, score, credit, update,
   evaluate), from the flow's own MLflow metrics.
3. Pipeline iteration time / the in-process reference loop (`stepgrpo.loops.reference`: the same core functions
   and seeds, no Prefect, no storage, no tracking). Target <= 1.15. Both loops run the same
   iterations; the bare loop runs before and after the pipeline and the two are averaged, the
   first iteration of each is dropped (warm-up). The rewards of both must agree.
4. Prefect's own cost: a flow run, and a task call (an empty flow with empty tasks).
5. Re-scoring the stored run with another reward (`rescore` flow, no transformer call) /
   regenerating it (rollout + completion + decode + reward for each iteration with the stored
   policy, in memory: a lower bound on regenerating). Target: re-scoring >= 10x faster. Both
   re-scoring paths are timed: from the images the training reward saw (stored by default) and,
   on a copy of the run without them, from a VAE decode of the stored latents.
6. The store against raw writes: `bench/storage/storage.py` (a realistic SD3 rollout), its output quoted.

    python -m bench.costs.costs [--iterations 3] [--prompts 4] [--group-size 4] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import _common
from bench._lib.common import COMMON, OUT_DIR, ROOT, write_json

METHODS = (None, "remaining", "substeps:2", "tweedie")
SCHEMES = ("outcome", "stepwise", "dense", "turning_point")


def overrides(a: argparse.Namespace, runs_root: Path, **extra: Any) -> list[str]:
    values = (
        dict(COMMON)
        | {
            "model.path": a.model,
            "model.device": a.device,
            "sampler.kernel": "flow",
            "completion.method": "remaining",
            "credit.scheme": "dense",
            "run.iterations": a.iterations,
            "run.prompts_per_iteration": a.prompts,
            "run.group_size": a.group_size,
            "run.eval_prompts": a.eval_prompts,
            "run.eval_every": 0,
            "run.seed": 0,
            "run.runs_root": str(runs_root),
            "run.name": "bench-costs",
        }
        | extra
    )
    return [f"{k}={'null' if v is None else v}" for k, v in values.items()]


# ------------------------------------------------------------------------------- 1. NFEs


def nfe_table(cfg: Any) -> dict[str, Any]:
    """NFEs and seconds of one iteration's sampling work per completion method (one real rollout)."""
    import numpy as np
    import torch

    from stepgrpo.loops import workspace
    from stepgrpo.loops.sampling import encode, generator
    from stepgrpo.prompts import prompt_source
    from stepgrpo_core.completions import complete
    from stepgrpo_core.rollout import rollout

    pol = workspace.policy(cfg)
    workspace.set_lora(pol, workspace.initial_lora(cfg))
    texts, splits, _ = prompt_source(cfg)
    train_ids = [i for i, s in enumerate(splits) if s == "train"]
    P, G, T = cfg.run.prompts_per_iteration, cfg.run.group_size, cfg.sampler.steps
    B = P * G
    pids = np.repeat(np.array(train_ids[:P]), G)
    cond = encode(pol, texts, pids)
    sigmas = pol.sigmas(T)
    x0 = torch.cat([pol.initial_noise(1, generator(0, "x0", g)).expand(G, -1, -1, -1) for g in range(P)])
    n0, t0 = pol.nfe, time.perf_counter()
    out = rollout(pol.velocity, x0, sigmas, cond, kernel="flow", noise=cfg.sampler.noise, generator=generator(0, "sde"))
    rollout_nfe, rollout_s = pol.nfe - n0, time.perf_counter() - t0
    rows: dict[str, dict[str, float]] = {}
    formulas = {None: 0, "remaining": B * T * (T + 1) // 2, "substeps:2": B * T * 2, "tweedie": B * T}
    for method in METHODS:
        n0, t0 = pol.nfe, time.perf_counter()
        if method:
            complete(method, pol.velocity, out.states, sigmas, cond, cfg.model.max_batch)
        rows[str(method)] = {"nfe": pol.nfe - n0, "formula": formulas[method], "seconds": time.perf_counter() - t0}
    # the update: one forward + backward per trained step and trajectory (no KL term: no reference pass)
    return {
        "B": B,
        "T": T,
        "rollout_nfe": rollout_nfe,
        "rollout_seconds": rollout_s,
        "completion": rows,
        "update_nfe": B * len(cfg.trained_steps()) * (2 if cfg.optim.kl_beta > 0 else 1),
        "cfg_rows_per_nfe": 2 if pol.do_cfg else 1,
    }


def calibration_cost(a: argparse.Namespace, out: Path) -> dict[str, Any]:
    """DenseGRPO psi calibration, once, as the calibrate stage runs it (its own temporary run)."""
    from stepgrpo.config import load_config
    from stepgrpo.loops import workspace
    from stepgrpo.storage import Run
    from stepgrpo.tasks import calibrate, prompts

    cfg = load_config(None, overrides(a, out / "runs", **{"sampler.kernel": "psi"}))
    root = out / "runs"
    run = Run.create(root, "calibration", cfg.model_dump(mode="json"), exist_ok=True)
    prompts.execute(run, cfg)
    pol = workspace.policy(cfg)
    n0 = pol.nfe
    res = calibrate.compute(run, cfg, key=f"bench-{time.time()}")
    c = cfg.calibration
    return {
        "seconds": res.seconds,
        "nfe": pol.nfe - n0,
        "rounds": c.rounds,
        "trajectories_per_round": c.prompts * cfg.run.group_size,
    }


# --------------------------------------------------------------------------- 2-3. pipeline


def mlflow_stage_seconds(run_dir: Path) -> dict[str, list[float]]:
    """`seconds/<stage>` per iteration, as the train flow logged them to MLflow."""
    from stepgrpo.reporting.tracking import find_mlflow_run

    client, mlrun = find_mlflow_run(run_dir)
    out: dict[str, list[float]] = {}
    for key in sorted(k for k in mlrun.data.metrics if k.startswith("seconds/")):
        hist = sorted(client.get_metric_history(mlrun.info.run_id, key), key=lambda m: m.step)
        out[key.removeprefix("seconds/")] = [m.value for m in hist]
    return out


def prefect_overhead(iterations: int) -> dict[str, float]:
    """Seconds of an empty flow run, and of one empty task call timed inside a flow."""
    from prefect import flow, task

    @task
    def nothing(i: int) -> int:
        return i

    @flow(name="bench-empty")
    def empty(n: int) -> float:
        t0 = time.perf_counter()
        for i in range(n):
            nothing(i)
        return time.perf_counter() - t0

    empty(1)  # the first call in a process also connects to (or starts) the server
    t0 = time.perf_counter()
    empty(0)
    flow_s = time.perf_counter() - t0
    calls = max(30, 6 * iterations)
    return {"flow_run_seconds": flow_s, "task_call_seconds": empty(calls) / calls}


# -------------------------------------------------------------------------------- 5. rescore


def regenerate(run_dir: Path, reward_name: str) -> dict[str, Any]:
    """Rollout + completion + decode + reward of every stored iteration with its stored policy,
    in memory (no storage): what re-scoring saves."""
    import numpy as np
    import torch

    from stepgrpo.config import RewardConfig, validate_config
    from stepgrpo.loops import workspace
    from stepgrpo.loops.sampling import complete_chunks, iteration_plan, sample_iteration
    from stepgrpo.loops.scoring import reward_images, score_images
    from stepgrpo.prompts import stored_prompts
    from stepgrpo.storage import Run

    run = Run.open(run_dir)
    cfg = validate_config(run.config)
    reward = workspace.reward(RewardConfig(name=reward_name))
    prompts = stored_prompts(run)
    mb = cfg.model.max_batch
    t0 = time.perf_counter()
    nfe = 0
    for i in run.iterations("rollout"):
        pol = workspace.policy_at(run, cfg, i)
        n0 = pol.nfe
        # the stage loops on the iteration's plan: the states are regenerated, not read
        plan = iteration_plan(cfg, prompts.splits, i)
        states = np.concatenate(
            [c.sde.states.numpy() for c in sample_iteration(pol, cfg, prompts.texts, plan, i, cfg.sampler.noise)]
        )
        lat = torch.cat(
            [
                out.latents
                for _, out in complete_chunks(
                    pol,
                    cfg.completion.method,
                    states,
                    pol.sigmas(cfg.sampler.steps),
                    prompts.texts,
                    plan.prompt_ids,
                    mb,
                    cfg.sampler.steps,
                )
            ]
        )
        flat = lat.reshape(-1, *lat.shape[2:])
        pids = np.repeat(plan.prompt_ids, lat.shape[1])
        images = torch.cat([reward_images(pol.decoder, flat[c0 : c0 + mb])[0] for c0 in range(0, len(flat), mb)])
        score_images(reward, images, prompts.texts_of(pids), prompts.metadata_of(pids), chunk=mb)
        nfe += pol.nfe - n0
    return {"seconds": time.perf_counter() - t0, "nfe": nfe}


def rescore_costs(run_dir: Path, reward_name: str, cfg: Any) -> dict[str, Any]:
    """Time the `rescore` flow on the run as trained (its images stored by the first score) and on
    a copy without them (the VAE decodes the stored latents: a run with `storage.images: false`),
    against `regenerate`; the transformer's NFE counter must not move."""
    import shutil

    from stepgrpo.flows.rescore import rescore
    from stepgrpo.loops import workspace

    pol = workspace.policy(cfg)
    bare = run_dir.parent / (run_dir.name + "-no-images")
    shutil.rmtree(bare, ignore_errors=True)
    shutil.copytree(run_dir, bare)
    for d in bare.glob("iter_*/images"):
        shutil.rmtree(d)
    out: dict[str, Any] = {}
    for key, path in (("stored", run_dir), ("decoded", bare)):
        n0, t0 = pol.nfe, time.perf_counter()
        rs = rescore(str(path), reward_name)
        flow_s = time.perf_counter() - t0
        assert pol.nfe == n0, "re-scoring called the transformer"
        assert {s["images"] for s in rs["scores"]} == ({"stored"} if key == "stored" else {"decoded+stored"}), rs
        out[key] = {
            "flow_seconds": flow_s,
            "score_seconds": sum(s["seconds"] for s in rs["scores"]),
            "means": [s["reward_mean"] for s in rs["scores"]],
        }
    assert out["stored"]["means"] == out["decoded"]["means"], "stored images must score as a fresh decode"
    regen = regenerate(run_dir, reward_name)
    for key in ("stored", "decoded"):
        out[key]["speedup_flow"] = regen["seconds"] / out[key]["flow_seconds"]
        out[key]["speedup_stages"] = regen["seconds"] / out[key]["score_seconds"]
    return {**out, "regenerate_seconds": regen["seconds"], "regenerate_nfe": regen["nfe"]}


# ------------------------------------------------------------------------------------ main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--eval-prompts", type=int, default=16)
    p.add_argument("--rescore-reward", default="jpeg_compressibility")
    p.add_argument("--model", default=None, help="SD3 pipeline directory (default: the shipped models/shapes)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--skip-storage", action="store_true", help="do not run bench/storage/storage.py")
    p.add_argument("--out", type=Path, default=OUT_DIR / "costs")
    a = p.parse_args()
    out = a.out
    _common.setup_env(out, a.threads)
    a.model = _common.model_path(a.model)
    import shutil

    shutil.rmtree(out / "runs", ignore_errors=True)
    from stepgrpo.config import load_config

    ov = overrides(a, out / "runs")
    cfg = load_config(None, ov)
    res: dict[str, Any] = {
        "settings": {
            "iterations": a.iterations,
            "prompts": a.prompts,
            "group_size": a.group_size,
            "model": a.model,
            "device": a.device,
        },
        "machine_start": _common.machine(),
    }
    T0 = time.perf_counter()

    # 1. NFEs per iteration
    nfe = nfe_table(cfg)
    res["nfe"] = nfe
    base = nfe["rollout_nfe"] + nfe["update_nfe"]
    print(
        f"\n1. NFEs per iteration (B = {nfe['B']}, T = {nfe['T']}; with CFG one NFE = {nfe['cfg_rows_per_nfe']} "
        "transformer rows)"
    )
    print(
        f"{'scheme':14s} {'completion':11s} {'rollout':>8s} {'complete':>9s} {'update':>7s} {'total':>7s} "
        f"{'x outcome':>9s} {'complete s':>10s}"
    )
    for scheme in SCHEMES:
        for method in METHODS:
            if (scheme == "outcome") != (method is None):
                continue
            c = nfe["completion"][str(method)]
            total = base + c["nfe"]
            assert c["nfe"] == c["formula"], (method, c)
            print(
                f"{scheme:14s} {str(method):11s} {nfe['rollout_nfe']:8d} {c['nfe']:9d} {nfe['update_nfe']:7d} "
                f"{total:7d} "
                f"{total / base:9.2f} {c['seconds']:10.2f}"
            )
    calib = calibration_cost(a, out)
    res["calibration"] = calib
    print(
        f"psi calibration (once): {calib['nfe']} NFEs, {calib['seconds']:.1f} s "
        f"({calib['rounds']} rounds x {calib['trajectories_per_round']} trajectories, remaining completion)"
    )

    # 3. the reference loop, the pipeline, the reference loop
    from stepgrpo.loops.reference import reference_loop

    bare1 = reference_loop(cfg, a.iterations)
    pipe = _common.train_flow(ov, "pipeline")
    run_dir = Path(pipe["run_dir"])
    bare2 = reference_loop(cfg, a.iterations)
    rec = _common.read_run(run_dir)
    stage_s = mlflow_stage_seconds(run_dir)
    # Iteration times without each loop's first (warm-up) iteration. On a shared machine another
    # process can take the CPU for seconds: the minimum is the least disturbed estimate, the
    # median the typical one; both ratios are reported.
    pipe_its = rec.iter_seconds[1:] or rec.iter_seconds
    bare_its = [r["seconds"] for b in (bare1, bare2) for r in (b[1:] or b)]
    pipe_iter, bare_iter = statistics.median(pipe_its), statistics.median(bare_its)
    res["overhead_ratio_min"] = min(pipe_its) / min(bare_its)
    # the same numbers up to float32 rounding of the mean (the pipeline reads rewards back as float64)
    diff = max(abs(r["reward_mean"] - p) for r, p in zip(bare1, rec.train_reward))
    same = diff < 1e-6
    res["pipeline"] = {
        "iter_seconds": rec.iter_seconds,
        "stage_seconds": stage_s,
        "flow_seconds": pipe["flow_seconds"],
        "train_reward": rec.train_reward,
        "evaluations": rec.heldout,
    }
    res["bare"] = {"first": bare1, "second": bare2}
    res["overhead_ratio"] = pipe_iter / bare_iter
    res["rewards_identical"] = same
    res["rewards_max_abs_diff"] = diff
    print("\n2. seconds per stage of the pipeline (median over iterations; share of the iteration)")
    for stage, vals in stage_s.items():
        med = statistics.median(vals)
        print(f"  {stage:9s} {med:7.2f} s  {100 * med / pipe_iter:5.1f} %")
    evals = rec.heldout
    print(
        f"  evaluate  {statistics.median([e['seconds'] for e in evals]):7.2f} s per evaluation ({a.eval_prompts} "
        "held-out prompts, "
        f"{evals[0]['nfe']} NFEs), not part of an iteration"
    )
    print(
        f"  whole flow {pipe['flow_seconds']:.1f} s for {a.iterations} iterations (incl. 2 evaluations, MLflow, LoRA "
        "export)"
    )
    bare_med = {
        k: statistics.median([r[k] for r in bare1[1:] + bare2[1:]] or [bare1[0][k]])
        for k in ("rollout", "complete", "score", "credit", "update")
    }
    res["bare_stage_seconds"] = bare_med
    print("  bare loop: " + ", ".join(f"{k} {v:.2f} s" for k, v in bare_med.items()))
    print(
        f"\n3. pipeline iteration / bare loop: median {pipe_iter:.2f} s / {bare_iter:.2f} s = "
        f"{res['overhead_ratio']:.3f}, "
        f"minimum {min(pipe_its):.2f} s / {min(bare_its):.2f} s = {res['overhead_ratio_min']:.3f} (target <= 1.15); "
        f"the bare loop's rewards equal the pipeline's: {same} (max difference {diff:.1e})"
    )

    # 4. Prefect's share
    pre = prefect_overhead(a.iterations)
    res["prefect"] = pre
    print(
        f"\n4. Prefect: an empty flow run {pre['flow_run_seconds']:.2f} s, an empty task call "
        f"{1e3 * pre['task_call_seconds']:.1f} ms "
        f"(the train flow makes 5 task calls per iteration: {5 * pre['task_call_seconds']:.2f} s)"
    )

    # 5. re-scoring vs regenerating
    res["rescore"] = rescore_costs(run_dir, a.rescore_reward, cfg)
    r = res["rescore"]
    print(
        f"\n5. re-scoring {a.iterations} stored iterations with {a.rescore_reward} (0 transformer NFEs) vs "
        "regenerating them "
        f"({r['regenerate_nfe']} NFEs, {r['regenerate_seconds']:.2f} s); target: re-scoring >= 10x faster"
    )
    for label, key in (("stored images (the default)", "stored"), ("no stored images: VAE decode", "decoded")):
        x = r[key]
        print(
            f"  {label:29s} rescore flow {x['flow_seconds']:5.2f} s -> {x['speedup_flow']:5.1f}x;  "
            f"score stages {x['score_seconds']:5.2f} s -> {x['speedup_stages']:5.1f}x"
        )
    print(
        f"  (the flow includes Prefect's fixed cost of one flow run, {res['prefect']['flow_run_seconds']:.2f} s above)"
    )

    # 6. storage
    if not a.skip_storage:
        proc = subprocess.run(
            [sys.executable, str(ROOT / "bench" / "storage" / "storage.py")], capture_output=True, text=True, cwd=ROOT
        )
        res["storage"] = proc.stdout
        print("\n6. the store against raw writes (bench/storage/storage.py):")
        print("  " + proc.stdout.strip().replace("\n", "\n  "))
    res["machine_end"] = _common.machine()
    res["total_seconds"] = time.perf_counter() - T0
    write_json(out / "costs.json", res)
    m = res["machine_end"]
    print(
        f"\nmachine: {m['cores']} cores ({m['cpu']}), GPU {m['gpu']}, torch {m['torch']} {m['torch_threads']} threads; "
        f"load average {res['machine_start']['load_avg'][0]:.2f} at the start, {m['load_avg'][0]:.2f} at the end; "
        f"total {res['total_seconds']:.0f} s; results in {_common.relative(out / 'costs.json')}"
    )


if __name__ == "__main__":
    main()
