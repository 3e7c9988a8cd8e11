"""Storage throughput: a rollout's latents through the run store vs plain `numpy.save`.

Measures, in one run, on 64 trajectories x 11 states x 16x64x64 float16 latents (92 MB):
- store write: `begin_rollout` + `writer.write` of every trajectory (chunks + crc32c);
- store publish: verify every chunk's checksum, digest the content, rename;
- store read: `read_rollout(...).states` (checksums verified);
- raw: `numpy.save` / `numpy.load` of the same array (one file, no checksum).
Target: store write >= 0.5 x raw write. Best of `REPEATS` for each, so a busy machine hurts less.

Run: python -m bench.storage.storage
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

# This file is named like the package it measures: drop its own folder from the import path so
# `import storage` finds the package (run from the repository root, or with it installed).
from stepgrpo.storage import Run  # noqa: E402

B, T, LATENT = 64, 10, (16, 64, 64)
REPEATS = 5


def du(path: Path) -> int:
    """Bytes of the files under `path`."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def main() -> None:
    states = np.random.default_rng(0).standard_normal((B, T + 1, *LATENT)).astype(np.float16)
    small = np.zeros((B, T), np.float32)
    mb = states.nbytes / 1e6
    keys = ("begin", "states", "small", "publish", "read", "raw_write", "raw_read")
    times: dict[str, list[float]] = {k: [] for k in keys}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for i in range(REPEATS):
            run = Run.create(root, f"bench{i}", {})
            t0 = time.perf_counter()
            writer = run.stages.begin_rollout(
                0,
                sigmas=np.linspace(1, 0, T + 1),
                seeds=np.arange(B),
                prompt_ids=np.arange(B),
                group_ids=np.arange(B) // 8,
                latent_shape=LATENT,
                latent_dtype="float16",
                kernel="sde",
                kernel_params={},
            )
            ta = time.perf_counter()
            writer.write(0, states=states)
            tb = time.perf_counter()
            writer.write(0, log_probs=small, stds=small, ode_final=states[:, -1])
            t1 = time.perf_counter()
            writer.publish()
            t2 = time.perf_counter()
            got = run.stages.read_rollout(0).states
            t3 = time.perf_counter()
            assert got.tobytes() == states.tobytes()
            raw = root / f"raw{i}.npy"
            t4 = time.perf_counter()
            np.save(raw, states)
            t5 = time.perf_counter()
            np.load(raw)
            t6 = time.perf_counter()
            for key, dt in zip(keys, (ta - t0, tb - ta, t1 - tb, t2 - t1, t3 - t2, t5 - t4, t6 - t5)):
                times[key].append(dt)
            store_bytes, raw_bytes = du(run.stage_path(0, "rollout")), du(raw)
            if i < REPEATS - 1:
                shutil.rmtree(run.path)
                raw.unlink()
    best = {k: min(v) for k, v in times.items()}
    write = best["begin"] + best["states"] + best["small"]
    raw_w, raw_r = mb / best["raw_write"], mb / best["raw_read"]
    print(
        f"rollout: {B} trajectories x {T + 1} states x {'x'.join(map(str, LATENT))} float16 = {mb:.1f} MB "
        f"(best of {REPEATS} per phase)"
    )
    print(f"  begin (zarr metadata + plan) {best['begin'] * 1e3:6.1f} ms")
    print(f"  states chunks + crc32c       {best['states'] * 1e3:6.1f} ms  {mb / best['states']:6.0f} MB/s")
    print(f"  log_probs + stds (128 files) {best['small'] * 1e3:6.1f} ms")
    print(f"  publish (verify + sha256)    {best['publish'] * 1e3:6.1f} ms  {mb / best['publish']:6.0f} MB/s")
    print(
        f"store write (begin..write)     {mb / write:6.0f} MB/s   ratio to numpy.save {mb / write / raw_w:.2f} "
        "(target >= 0.5)"
    )
    print(f"store states write only        {mb / best['states']:6.0f} MB/s   ratio {mb / best['states'] / raw_w:.2f}")
    print(
        f"store write + publish          {mb / (write + best['publish']):6.0f} MB/s   ratio "
        f"{mb / (write + best['publish']) / raw_w:.2f}"
    )
    print(
        f"store read (checksums checked) {mb / best['read']:6.0f} MB/s   ratio to numpy.load "
        f"{mb / best['read'] / raw_r:.2f}"
    )
    print(f"numpy.save {raw_w:6.0f} MB/s, numpy.load {raw_r:6.0f} MB/s")
    print(f"bytes on disk: store {store_bytes:,} (whole rollout incl. log-probs, metadata), numpy {raw_bytes:,}")


if __name__ == "__main__":
    main()
