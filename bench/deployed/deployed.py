"""A training run started from a Prefect deployment against the same run from the CLI.

    python -m bench.deployed.deployed [--checkout DIR] [--iterations 5] [--out bench/out/deployed/NAME.json]

Starts a Prefect server (temporary home, free port), creates the `stepgrpo` process pool,
`prefect deploy --all` from `--checkout` (default: this repository; another checkout, e.g. a
`git worktree` of an older commit, is imported first through PYTHONPATH), runs the `train`
deployment through a `--run-once` worker whose environment has no STEPGRPO_THREADS (a worker as
a user starts it), then the same config from the CLI as `make demo` runs it, and prints the
seconds of both and their ratio, each run's update-stage seconds, and its held-out rewards.
Both runs use configs/demo.yaml cut to `--iterations` iterations and 16 held-out prompts.
`--busy N` keeps N other processes spinning on the CPU meanwhile (a machine that is also doing
something else: the Prefect server, another run), where torch's default of one thread per core
makes its threads wait on each other.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench._lib.prefect import BIN, api, call, local_server

REPO = Path(__file__).resolve().parents[2]


def update_seconds(run_dir: Path) -> list[float]:
    out = []
    for state in sorted(run_dir.glob("checkpoints/iter_*/_published.json"), key=lambda p: int(p.parent.name[5:])):
        out.append(json.loads(state.read_text())["inputs"].get("seconds", float("nan")))
    return out


def evals(run_dir: Path) -> dict[str, float]:
    return {p.stem: json.loads(p.read_text())["reward_mean"] for p in sorted((run_dir / "eval").glob("*.json"))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkout", type=Path, default=REPO)
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--busy", type=int, default=0, help="processes spinning on the CPU during both runs")
    args = p.parse_args()
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True) for _ in range(args.busy)
    ]
    checkout = args.checkout.resolve()
    root = Path(tempfile.mkdtemp(prefix="stepgrpo-deployed-"))
    overrides = [f"run.iterations={args.iterations}", "run.eval_prompts=16", "run.eval_seeds=1"]
    overrides.append(f"run.runs_root={root / 'runs'}")
    base = {k: v for k, v in os.environ.items() if k not in ("STEPGRPO_THREADS", "PREFECT_API_URL")}
    base |= {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
    base |= {"PYTHONPATH": str(checkout), "PREFECT_HOME": str(root / "prefect-home")}
    try:
        with local_server(base, root / "prefect-home") as (url, _, env):
            prefect = str(BIN / "prefect")
            call(env, checkout, prefect, "work-pool", "create", "stepgrpo", "--type", "process")
            call(env, checkout, prefect, "--no-prompt", "deploy", "--all")
            call(
                env, checkout, prefect, "deployment", "run", "train/train",
                "--param", f"overrides={json.dumps(overrides)}", "--param", "run_id=deployed",
            )  # fmt: skip
            _, worker_s = call(env, checkout, prefect, "worker", "start", "--pool", "stepgrpo", "--run-once")
            (run,) = (
                api(url, "/flow_runs/filter", {"flow_runs": {"name": {"any_": ["deployed"]}}})
                or api(url, "/flow_runs/filter", {})[:1]
            )
            deployed_s = float(run["total_run_time"])
            # the CLI as `make demo` runs it (its Makefile set STEPGRPO_THREADS=1 before the flows applied it)
            cli_env = dict(env, STEPGRPO_THREADS="1")
            cli_env.pop("PREFECT_API_URL")
            sets = [a for o in overrides for a in ("--set", o)]
            _, cli_s = call(cli_env, checkout, str(BIN / "stepgrpo"), "train", "--config", "configs/demo.yaml", *sets,
                            "--run-id", "cli")  # fmt: skip
    finally:
        for spinner in spinners:
            spinner.kill()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True, text=True)
    result = {
        "checkout": commit.stdout.strip(),
        "iterations": args.iterations,
        "busy_processes": args.busy,
        "deployed_flow_run_s": deployed_s,
        "deployed_worker_wall_s": worker_s,
        "cli_wall_s": cli_s,
        "deployed_over_cli": deployed_s / cli_s,
        "update_s": {
            "deployed": update_seconds(root / "runs" / "deployed"),
            "cli": update_seconds(root / "runs" / "cli"),
        },
        "heldout": {"deployed": evals(root / "runs" / "deployed"), "cli": evals(root / "runs" / "cli")},
    }
    print(json.dumps(result, indent=1))
    print(
        f"commit {result['checkout']}: deployed flow run {deployed_s:.1f} s, CLI {cli_s:.1f} s (wall, with its "
        f"Prefect server start): deployed / CLI = {deployed_s / cli_s:.2f}"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
