"""The sharded update (`scale.update_sharding: fsdp`) against the all-reduce update, on two CPU ranks
(gloo), at a full fine-tune of a small SD3-shaped transformer (8 blocks of width 512, about 50M
parameters: big enough that its states dwarf the ranks' other tensors): update seconds an
iteration and the memory each rank holds, as ratios measured in one run, and the memory formula
(`stepgrpo.runtime.memory`, docs/SCALING.md "Sharded update") against what the ranks hold.

Each configuration trains `--iterations` iterations, `--repeats` times in alternating order; the
first iteration of a run (rank start, model load) is dropped and the medians of the rest are read.
Per rank, "held" is the bytes of every live tensor's storage after the update (each storage once:
weights, gradients, AdamW, the reference copy, the initial weights, the encoders and VAE, and the
batch), recorded by the ranks with `STEPGRPO_MEMORY_AUDIT=1`; "peak RSS" is the process's peak
resident set, which also holds Python, torch and the load of the whole model before it is sharded.

    python -m bench.scale.sharded [--iterations 3] [--repeats 2]     # writes docs/bench/scale/sharded.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "bench" / "out" / "scale_sharded"
RECORD = ROOT / "docs" / "bench" / "scale" / "sharded.json"
CONFIGS = {"all-reduce": ["scale.update_sharding=none"], "fsdp": ["scale.update_sharding=fsdp"]}


def model(out: Path) -> Path:
    from stepgrpo.shapes.model import ModelSpec, build_pipeline, tiny_spec

    path = out / "model"
    if not (path / "model_index.json").is_file():
        spec = ModelSpec(**{**tiny_spec().__dict__, "layers": 8, "heads": 8, "head_dim": 64})
        build_pipeline(spec, seed=0).save_pretrained(str(path))
    return path


def overrides(path: Path, iterations: int) -> list[str]:
    return [
        f"model.path={path}",
        "model.finetune=full",
        "model.guidance_scale=1.0",
        "sampler.steps=4",
        "sampler.eval_steps=4",
        "reward.name=jpeg_compressibility",
        "completion.method=null",
        "credit.scheme=outcome",
        f"run.iterations={iterations}",
        "run.prompts_per_iteration=4",
        "run.group_size=4",
        "run.eval_prompts=1",
        "run.eval_seeds=1",
        "optim.micro_batch=4",
        "optim.lr=1e-5",
        "scale.update_processes=2",
        "scale.threads=1",
        "scale.stage_retries=0",
    ]


def one_run(name: str, path: Path, iterations: int, out: Path) -> dict:
    from stepgrpo.flows.train import train
    from stepgrpo.storage.run import Run

    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    train(overrides=[*overrides(path, iterations), *CONFIGS[name.split(".")[0]]], run_dir=str(run_dir))
    run = Run.open(run_dir)
    its = [run.stage_manifest(i, "checkpoint")["inputs"] for i in range(iterations)]
    later = its[1:]
    return {
        "seconds": [i["seconds"] for i in later],
        "held_mib": [max(r["memory"]["tensors_mib"] for r in i["ranks"]) for i in later],
        "peak_rss_mib": max(r["memory"]["peak_rss_mib"] for r in its[-1]["ranks"]),
        "sharding": [i.get("sharding", "none") for i in its],
    }


def formula(path: Path, iterations: int) -> dict[str, float]:
    from stepgrpo.config import load_config
    from stepgrpo.runtime import memory

    out = {}
    for name, sets in CONFIGS.items():
        cfg = load_config(None, [*overrides(path, iterations), *sets])
        counts = memory.model_counts(path, cfg.model.lora_rank, tuple(cfg.model.lora_targets))
        states = memory.config_states(cfg, counts)
        out[name] = sum(states["device"].values()) / (1 << 20)
        # what a rank still holds after the update (what the audit reads): without the transient terms
        out[f"{name} after"] = sum(v for k, v in states["device"].items() if k not in memory.TRANSIENT) / (1 << 20)
        out[f"{name} terms"] = {k: round(v / (1 << 20), 1) for k, v in states["device"].items()}
    out["parameters"] = counts.transformer
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--record", type=Path, default=RECORD)
    a = ap.parse_args()
    os.environ["STEPGRPO_MEMORY_AUDIT"] = "1"
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    a.out.mkdir(parents=True, exist_ok=True)
    path = model(a.out)
    runs: dict[str, list[dict]] = {n: [] for n in CONFIGS}
    t0 = time.time()
    for r in range(a.repeats):
        order = list(CONFIGS) if r % 2 == 0 else list(reversed(CONFIGS))
        for name in order:
            runs[name].append(one_run(f"{name}.{r}", path, a.iterations, a.out))
    f = formula(path, a.iterations)
    med = {
        n: {k: statistics.median(x for run in rs for x in run[k]) for k in ("seconds", "held_mib")}
        for n, rs in runs.items()
    }
    rss = {n: max(run["peak_rss_mib"] for run in rs) for n, rs in runs.items()}
    record = {
        "what": "full fine-tune update, 2 CPU ranks (gloo), one torch thread each; medians over iterations 1..",
        "parameters": f["parameters"],
        "iterations": a.iterations,
        "repeats": a.repeats,
        "median_update_seconds": {n: round(m["seconds"], 2) for n, m in med.items()},
        "held_mib_per_rank": {n: round(m["held_mib"], 1) for n, m in med.items()},
        "formula_mib_per_rank": {n: round(f[n], 1) for n in CONFIGS},
        "formula_after_update_mib_per_rank": {n: round(f[f"{n} after"], 1) for n in CONFIGS},
        "formula_terms_mib": {n: f[f"{n} terms"] for n in CONFIGS},
        "peak_rss_mib_per_rank": {n: round(v, 1) for n, v in rss.items()},
        "ratios": {
            "update seconds, fsdp / all-reduce": round(med["fsdp"]["seconds"] / med["all-reduce"]["seconds"], 3),
            "held per rank, fsdp / all-reduce": round(med["fsdp"]["held_mib"] / med["all-reduce"]["held_mib"], 3),
            "held / formula after the update, all-reduce": round(
                med["all-reduce"]["held_mib"] / f["all-reduce after"], 3
            ),
            "held / formula after the update, fsdp": round(med["fsdp"]["held_mib"] / f["fsdp after"], 3),
            "formula peak, fsdp / all-reduce": round(f["fsdp"] / f["all-reduce"], 3),
        },
        "sharding_recorded": {n: rs[0]["sharding"] for n, rs in runs.items()},
        "wall_seconds": round(time.time() - t0, 1),
    }
    a.record.parent.mkdir(parents=True, exist_ok=True)
    a.record.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
