"""What a design that relaunches its update ranks every iteration would pay at SD3.5-M scale: the
start of a fresh process (Python, torch, diffusers imported) and the load of a full-size
SD3.5-M-shaped transformer saved in bf16, on this machine (docs/SCALING.md, "The update").

    python -m bench.scale.load_sd35m [--dir DIR] [--repeats 3]

The transformer has SD3.5-Medium's configuration (24 MMDiT-X blocks of 24 heads x 64, the first 13
with a second attention, RMS qk-norm: 2.24 B parameters) and random weights; it is built once and
saved under `--dir` (about 5 GB; kept for the next run). Each repeat is a fresh process that imports
what a rank imports, then `SD3Transformer2DModel.from_pretrained(..., torch_dtype=bfloat16)`; the
file is then in the page cache (written or read just before), so the load is the best case of a
node that has read it before. Only the transformer: a rank also loads the text encoders (T5-XXL
alone is 4.8 B parameters) where it encodes prompts itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench._lib.common import OUT_DIR
from bench._lib.gpu import SD3_MEDIUM

# SD3.5-Medium's transformer: SD3-medium's shape (bench/gpu/gpu.py), a larger position grid, a second
# attention in the first 13 blocks, RMS qk-norm
SD35M = {**SD3_MEDIUM, "pos_embed_max_size": 384, "dual_attention_layers": tuple(range(13)), "qk_norm": "rms_norm"}

CHILD = """
import json, sys, time
t0 = time.perf_counter()
import torch
from diffusers import SD3Transformer2DModel
t1 = time.perf_counter()
model = SD3Transformer2DModel.from_pretrained(sys.argv[1], torch_dtype=torch.bfloat16)
t2 = time.perf_counter()
params = sum(p.numel() for p in model.parameters())
print(json.dumps({"imports_s": t1 - t0, "load_s": t2 - t1, "params": params}))
"""


def build(path: Path) -> None:
    import torch
    from diffusers import SD3Transformer2DModel

    if (path / "config.json").is_file():
        return
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # the weights are made in bf16: 5 GB, not 10
    model = SD3Transformer2DModel(**SD35M)
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(str(path), max_shard_size="10GB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=OUT_DIR / "sd35m_transformer")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=OUT_DIR / "load_sd35m.json")
    a = p.parse_args()
    t0 = time.perf_counter()
    build(a.dir)
    built = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in a.dir.iterdir())
    runs = []
    for _ in range(a.repeats):
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", CHILD, str(a.dir)], capture_output=True, text=True, check=True)
        wall = time.perf_counter() - start
        runs.append({**json.loads(done.stdout.strip().splitlines()[-1]), "process_s": wall})
    result = {
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in SD35M.items()},
        "params": runs[0]["params"],
        "bytes": size,
        "build_s": built,
        "median_process_s": statistics.median(r["process_s"] for r in runs),
        "median_imports_s": statistics.median(r["imports_s"] for r in runs),
        "median_load_s": statistics.median(r["load_s"] for r in runs),
        "runs": runs,
        "cpus": os.cpu_count(),
        "loadavg": os.getloadavg(),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2))
    print(f"SD3.5-M-shaped transformer: {result['params'] / 1e9:.2f} B parameters, {size / 2**30:.2f} GiB in bf16")
    print(
        f"a fresh rank process: {result['median_process_s']:.1f} s (imports {result['median_imports_s']:.1f} s, "
        f"transformer load {result['median_load_s']:.1f} s), median of {a.repeats}; "
        f"load average {result['loadavg'][0]:.1f}"
    )
    print(f"written: {a.out}")


if __name__ == "__main__":
    main()
