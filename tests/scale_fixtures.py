"""What the scale-out tests share (tests/test_scale.py, tests/test_scale_ray.py): a tiny model and
config that shards every stage, the in-process reference run, and what a run stores that must
not depend on where it was computed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import shared
from filelock import FileLock
from safetensors.torch import load_file

from stepgrpo.storage.run import Run

# 8 groups of 3, 6 rows a model call: 4 shards of 2 groups, one evaluation call per seed.
SHARDED = ["scale.groups_per_shard=2"]
# One thread a computation, recorded by each run (the in-process reference too), so the bytes
# compared are those of one thread count whatever the test process started with and however many
# shards run at once; a shard asks one CPU, so the 2-CPU cluster runs two shards (two workers) at a
# time, a thread each.
RAY = ["scale.workers=ray", "scale.num_workers=2", "scale.cpus_per_shard=1", *SHARDED]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> list[str]:
    from stepgrpo.shapes.model import build_pipeline, tiny_spec

    path = shared(tmp_path_factory, "scale-tiny-sd3")
    with FileLock(f"{path}.lock"):
        if not (path / "model_index.json").is_file():
            build_pipeline(tiny_spec(), seed=0).save_pretrained(str(path))
    return [
        f"model.path={path}",
        "model.lora_rank=4",
        "model.lora_alpha=8",
        "model.guidance_scale=1.0",
        "model.max_batch=6",
        "sampler.steps=4",
        "sampler.eval_steps=4",
        "reward.name=jpeg_compressibility",
        "completion.method=remaining",
        "credit.scheme=stepwise",
        "run.iterations=2",
        "run.prompts_per_iteration=8",
        "run.group_size=3",
        "run.eval_prompts=6",
        "run.eval_seeds=2",
        "optim.micro_batch=4",
        "optim.optimizer_steps=2",
        "optim.lr=1e-3",
        "scale.threads=1",
    ]


def _train(tiny: list[str], run_dir: Path, *extra: str) -> dict:
    from stepgrpo.flows.train import train

    return train(overrides=[*tiny, *extra], run_dir=str(run_dir))


@pytest.fixture(scope="module")
def reference(harness, tiny, tmp_path_factory) -> Path:
    """The in-process run (one shard a stage, one update process), trained once for the session;
    its exported LoRA marks it finished. Tests read it, or copy it before they change anything."""
    run_dir = shared(tmp_path_factory, "scale-runs") / "in-process"
    with FileLock(f"{run_dir.parent}.lock"):
        if not (run_dir / "lora").is_dir():
            shutil.rmtree(run_dir, ignore_errors=True)
            _train(tiny, run_dir)
    return run_dir


def stored(run_dir: Path) -> dict[str, object]:
    """Everything a run stores that must not depend on where it was computed."""
    run = Run.open(run_dir)
    out: dict[str, object] = {}
    for i in (0, 1):
        for stage in ("rollout", "completions/remaining", "images/remaining"):
            out[f"{i} {stage}"] = run.stage_manifest(i, stage)["digest"]
        data = run.stages.read_rollout(i)
        out[f"{i} states"] = data.states.tobytes()
        out[f"{i} log_probs"] = data.log_probs.tobytes()
        out[f"{i} rewards"] = run.tables.reward_grid(i, "jpeg_compressibility", "1").numpy().tobytes()
        schemes = run.tables.read_advantages(i).column("options_digest").to_pylist()
        out[f"{i} advantages"] = run.tables.advantage_grid(i, "stepwise", schemes[0]).numpy().tobytes()
    for name in ("base", "iter_1"):
        out[f"eval {name}"] = json.loads((run_dir / "eval" / f"{name}.json").read_text())["scores"]
    return out


def lora(run_dir: Path, i: int) -> torch.Tensor:
    weights = load_file(str(run_dir / "checkpoints" / f"iter_{i}" / "lora.safetensors"))
    return torch.cat([weights[k].reshape(-1).double() for k in sorted(weights)])
