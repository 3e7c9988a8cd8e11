"""The offline commands end to end: each started the way a user starts it, with Prefect's
temporary server (the default) and with a kept server (`stepgrpo server start`), in one run.

    python -m bench.costs.offline [--out DIR] [--repeats 3]

It trains one small iteration of the shipped DenseGRPO recipe (not timed), then times, as whole
processes, `stepgrpo inspect`, `rescore --reward jpeg_compressibility` and
`credit --scheme turning_point` on it. Each timed re-score or re-credit runs on a fresh copy of the
run, so each computes its stage (nothing is a cache hit). The two ways alternate within each
repeat; the table gives the median seconds and the ratio. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench._lib.common import OUT_DIR, ROOT, setup_env

STEPGRPO = [sys.executable, "-m", "stepgrpo_cli"]
COMMANDS = {
    "inspect": ["inspect"],
    "rescore": ["rescore", "--reward", "jpeg_compressibility"],
    "credit": ["credit", "--scheme", "turning_point"],
}
TRAIN = [
    "train",
    "--config",
    "configs/shapes_dense.yaml",
    "--set",
    "run.iterations=1",
    "--set",
    "run.eval_prompts=8",
    "--set",
    "run.eval_seeds=1",
]


def timed(args: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    done = subprocess.run([*STEPGRPO, *args], env=env, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"`stepgrpo {' '.join(args)}` failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUT_DIR / "offline")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    out = args.out.resolve()
    shutil.rmtree(out, ignore_errors=True)
    setup_env(out)
    base = dict(os.environ, STEPGRPO_PROGRESS="0")
    base.pop("PREFECT_API_URL", None)
    # a Prefect home each: two servers on one SQLite database would wait for each other's locks
    temporary = dict(base, STEPGRPO_KEPT_SERVER="0", PREFECT_HOME=str(out / "prefect-home-temporary"))
    kept = dict(base, STEPGRPO_KEPT_SERVER="1", PREFECT_HOME=str(out / "prefect-home-kept"))

    run = out / "run"
    print("training one iteration (not timed) ...", flush=True)
    timed([*TRAIN, "--run-dir", str(run)], temporary)
    subprocess.run([*STEPGRPO, "server", "start", "--port", str(_free_port())], env=kept, cwd=ROOT, check=True)
    try:
        times: dict[tuple[str, str], list[float]] = {}
        for r in range(args.repeats):
            for name, command in COMMANDS.items():
                for way, env in (("temporary", temporary), ("kept", kept)):
                    target = out / f"copy-{way}"
                    shutil.rmtree(target, ignore_errors=True)
                    shutil.copytree(run, target, symlinks=True)
                    seconds = timed([*command[:1], str(target), *command[1:]], env)
                    times.setdefault((name, way), []).append(seconds)
                    print(f"repeat {r} {name:8s} {way:9s} {seconds:6.2f} s", flush=True)
    finally:
        subprocess.run([*STEPGRPO, "server", "stop"], env=kept, cwd=ROOT)
    print(f"\n{'command':10s} {'temporary server':>17s} {'kept server':>12s} {'ratio':>6s}", end="")
    print(f"   (median of {args.repeats})")
    for name in COMMANDS:
        t, k = statistics.median(times[name, "temporary"]), statistics.median(times[name, "kept"])
        print(f"{name:10s} {t:15.2f} s {k:10.2f} s {t / k:6.1f}x")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
