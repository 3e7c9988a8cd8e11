"""What storing costs at SD3.5-M scale: one iteration of a step-level paper recipe through the run store.

    python -m bench.storage.storage_sd35 [--trajectories 1152] [--shard 48] [--dir DIR] [--out FILE.json]

The latents of `configs/stepwise_pickscore.yaml` (docs/GPU.md: 3.23 GiB an iteration): 1152
trajectories x 11 states x 16x64x64 bf16 (SD3.5-M at 512 px) in the rollout, and as many again
in the ODE completion of every state. Each stage is written as the run writes it, one shard of
`--shard` trajectories at a time (chunks + crc32c), then published (every chunk read back, its
checksum checked, the content digested with sha256 by the reading threads, one rename);
`inspect --verify` (a second full read and digest) is timed too. Printed beside them: sha256 alone
over the same bytes in memory in one thread, the iteration's GPU time on 16 H200s from
SCALING.md's throughput model, and the rollout's digest under format 1 (one thread hashes every
byte) against format 2 (the default: each chunk's sha256, hashed in parallel), best of 3 each.

The written bytes are still in the page cache when the publish reads them (24 GiB of memory here),
as they are right after a stage; `--dir` puts the store on another disk.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

# This folder holds bench/storage/storage.py, named like the package it measures: import the package.
import torch  # noqa: E402

from stepgrpo.storage import Run  # noqa: E402
from stepgrpo.storage.arrays import StageStore  # noqa: E402
from stepgrpo.storage.schema import ROLLOUT  # noqa: E402

T, LATENT = 10, (16, 64, 64)
GPU_ITERATION_S = 95.6  # docs/bench/scale_model.txt: `remaining` completion, 16 H200s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trajectories", type=int, default=1152)
    p.add_argument("--shard", type=int, default=48, help="trajectories a shard writes (two prompt groups of 24)")
    p.add_argument("--dir", type=Path, default=None, help="where the store is written (default: a temporary dir)")
    p.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")
    a = p.parse_args()
    B, n = a.trajectories, a.shard
    gen = torch.Generator().manual_seed(0)
    shard = torch.randn((n, T + 1, *LATENT), generator=gen).to(torch.bfloat16)  # one shard's latents, reused
    small = np.zeros((n, T), np.float32)
    times: dict[str, float] = {}
    root = Path(tempfile.mkdtemp(prefix="stepgrpo-sd35-", dir=a.dir))
    try:
        run = Run.create(root, "sd35", {})
        t0 = time.perf_counter()
        w = run.stages.begin_rollout(
            0,
            sigmas=np.linspace(1, 0, T + 1),
            seeds=np.arange(B),
            prompt_ids=np.arange(B) // 24,
            group_ids=np.arange(B) // 24,
            latent_shape=LATENT,
            latent_dtype="bfloat16",
            kernel="sde",
            kernel_params={},
        )
        for s in range(0, B, n):
            k = min(n, B - s)
            w.write(s, states=shard[:k], log_probs=small[:k], stds=small[:k], ode_final=shard[:k, -1])
        t1 = time.perf_counter()
        rollout = w.publish()
        t2 = time.perf_counter()
        w = run.stages.begin_completion(0, "remaining")
        for s in range(0, B, n):
            w.write(s, latents=shard[: min(n, B - s)])
        t3 = time.perf_counter()
        completion = w.publish(attrs={"nfe": 0})
        t4 = time.perf_counter()
        run.verify(0, "rollout")
        run.verify(0, "completions/remaining")
        t5 = time.perf_counter()
        nbytes = rollout["counts"]["bytes"] + completion["counts"]["bytes"]
        times = {"write": (t1 - t0) + (t3 - t2), "publish": (t2 - t1) + (t4 - t3), "verify": t5 - t4}
        times["sha256"] = sha256_seconds(shard, nbytes)
        formats = digest_formats(StageStore.open(run.stage_path(0, "rollout"), ROLLOUT))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gib = nbytes / 2**30
    stored = times["write"] + times["publish"]
    print(f"one iteration at SD3.5-M scale: {B} trajectories x {T + 1} states x {'x'.join(map(str, LATENT))} bf16, "
          f"rollout + completion = {gib:.2f} GiB of latents, in shards of {n}")  # fmt: skip
    for name, what in (
        ("write", "write (chunks + crc32c)"),
        ("publish", "publish (read back, crc32c, sha256)"),
        ("verify", "inspect --verify (a second read)"),
        ("sha256", "sha256 alone, in memory"),
    ):
        print(f"  {what:38s} {times[name]:6.1f} s  {nbytes / 1e6 / times[name]:6.0f} MB/s")
    print(
        f"  stored (write + publish)               {stored:6.1f} s = {stored / GPU_ITERATION_S:.1%} of the "
        f"iteration's {GPU_ITERATION_S} s on 16 H200s (docs/bench/scale_model.txt), on one writer"
    )
    ratio = formats[1] / formats[2]
    print(
        f"  the rollout's digest read again, format 1 (one thread hashes) {formats[1]:.2f} s, format 2 (each "
        f"reading thread hashes its chunks) {formats[2]:.2f} s: {ratio:.2f}x (best of 3, alternating)"
    )
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        figures = {"bytes": nbytes, "trajectories": B, "shard": n, "seconds": times, "digest_formats": formats}
        a.out.write_text(json.dumps(figures, indent=1))


def digest_formats(store: StageStore) -> dict[int, float]:
    """Seconds to check and digest `store` under digest format 1 and 2 (storage.schema), best of 3
    alternating runs (the store is in the page cache by then: this compares the hashing)."""
    seconds: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(3):
        for f in (1, 2):
            t = time.perf_counter()
            store.verify_and_digest(f)
            seconds[f].append(time.perf_counter() - t)
    return {f: min(s) for f, s in seconds.items()}


def sha256_seconds(shard: torch.Tensor, nbytes: int) -> float:
    """Seconds sha256 takes over `nbytes` (the shard's bytes, hashed repeatedly), from memory."""
    data = memoryview(shard.view(torch.int16).numpy()).cast("B")
    h = hashlib.sha256()
    t = time.perf_counter()
    done = 0
    while done < nbytes:
        h.update(data)
        done += len(data)
    return (time.perf_counter() - t) * nbytes / done


if __name__ == "__main__":
    main()
