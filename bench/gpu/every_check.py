"""Every prepared GPU check of the project, one after another, for a machine lent for a few minutes:
each check in its own process with its own time limit, its output under `--out/<check>/`, and a
summary (exit status, seconds, the last lines) printed and written to `--out/summary.json`. A check
that fails or runs out of time does not stop the others.

    python -m bench.gpu.every_check [--out bench/out/gpu_all] [--budget 540]
    python -m bench.gpu.every_check --small --device cpu --out /tmp/gpu_all       # the list itself, on a CPU

The checks (each its own page says what it measures): `bench/gpu/gpu.py` (CUDA correctness and
throughput), `bench/gpu/gpu_train.py` (one iteration of the shipped GPU recipe), the clip at SD3.5-M
shape, the frontier's objectives, the protocols' sampling, and the sharded update's memory against its
formula. Their time limits share `--budget` seconds in the order below, the cheap ones first.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

# (name, module, arguments, share of the budget); --out is added for those that take it
CHECKS = [
    ("gpu", "bench.gpu.gpu", [], 0.12),
    ("sharded", "bench.scale.gpu_sharded", [], 0.12),
    ("protocols", "bench.protocols.gpu_protocols", [], 0.16),
    ("train", "bench.gpu.gpu_train", [], 0.16),
    ("clip", "bench.credit_schemes_clip.gpu_clip", [], 0.2),
    ("frontier", "bench.frontier.gpu_frontier", [], 0.24),
]
TAKES_OUT = {"gpu", "protocols", "train", "clip", "frontier"}


def _text(out: bytes | str | None) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/out/gpu_all"))
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for all the checks together")
    ap.add_argument("--small", action="store_true", help="toy sizes (each check's --small)")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    summary = []
    for name, module, args, share in CHECKS:
        argv = [sys.executable, "-m", module, *args]
        if name in TAKES_OUT:
            argv += ["--out", str(a.out / name)]
        if a.small:
            argv += ["--small", "--device", a.device]
        limit = max(30.0, a.budget * share)
        t0 = time.time()
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=limit)
            rc, tail = done.returncode, (done.stdout + done.stderr)[-2000:]
        except subprocess.TimeoutExpired as err:
            rc, tail = 124, (_text(err.stdout) + _text(err.stderr))[-2000:]
        (a.out / f"{name}.log").write_text(tail)
        row = {"check": name, "rc": rc, "seconds": round(time.time() - t0, 1), "limit": limit, "tail": tail[-400:]}
        summary.append(row)
        print(f"{name:10s} rc {rc:4d}  {row['seconds']:7.1f} s (limit {limit:.0f})", flush=True)
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
