"""The evaluate stage: the held-out reward of the policy after an iteration (or of the base model).

ODE sampling of `run.eval_prompts` held-out prompts x `run.eval_seeds` seeds with the same noise
for every evaluation of a run (so two evaluations compare pair by pair), scored, written as
`eval/<label>.json` with an image grid `eval/<label>.png`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from stepgrpo.config import Config
from stepgrpo.errors import StageError
from stepgrpo.images import dequantize
from stepgrpo.loops import workspace
from stepgrpo.loops.sampling import encode, generator
from stepgrpo.loops.scoring import cat_outputs, output_json, output_of_json, score_images
from stepgrpo.prompts import stored_prompts
from stepgrpo.reporting.report import write_grid
from stepgrpo.results import EvaluateResult, PromptsResult, UpdateResult
from stepgrpo.runtime.faults import maybe_fail
from stepgrpo.runtime.sharding import blocks_per_shard
from stepgrpo.storage.errors import StorageError
from stepgrpo.storage.ledger import close_ledger, open_ledger, record
from stepgrpo.storage.publish import read_json, seal, write_file_atomic
from stepgrpo.storage.run import Run
from stepgrpo.tasks.base import fan_out, shard_task, stage_task, warn
from stepgrpo.tasks.keys import Key, stage_key
from stepgrpo_core.rollout import rollout as sample

EVAL_DIR = Run.EVAL_DIR
GRID_IMAGES = 64


@stage_task("evaluate")
def evaluate(
    run: Run, cfg: Config, iteration: int, prompts: PromptsResult, checkpoint: UpdateResult | None
) -> EvaluateResult:
    """Evaluate the policy of `checkpoint` (after `iteration`; -1 and None: the base model)."""
    key = stage_key("evaluate", run, cfg, iteration, {"prompts": prompts, "checkpoint": checkpoint})
    return execute(run, cfg, None if iteration < 0 else iteration, key)


def label(iteration: int | None) -> str:
    return "base" if iteration is None else f"iter_{iteration}"


def read(run: Run, name: str) -> EvaluateResult | None:
    """The stored evaluation `eval/<name>.json`, or None; one that does not parse is set aside."""
    path = run.record_path(EVAL_DIR, name)
    if not path.is_file():
        return None
    try:
        record = read_json(path, "evaluation record")  # checks its seal
        return EvaluateResult.model_validate(record)
    except (ValueError, StorageError):
        warn(f"{path} is damaged; kept aside as {run.set_aside_file(path).name}, evaluating again")
        return None


def file_name(run: Run, cfg: Config, iteration: int | None) -> str:
    """`base`, `iter_<k>`: the run's own evaluations; an evaluation with other settings (`stepgrpo
    evaluate --set ...`) is kept beside them as `<label>-<digest of its settings>`, never over them."""
    from stepgrpo.config import digest_of, stage_fields, validate_config

    ours = stage_fields(cfg, "evaluate")
    if ours == stage_fields(validate_config(run.config), "evaluate"):
        return label(iteration)
    return f"{label(iteration)}-{digest_of(ours)[:8]}"


def execute(run: Run, cfg: Config, iteration: int | None, key: Key) -> EvaluateResult:
    name = file_name(run, cfg, iteration)
    stored = read(run, name)
    if stored is not None and key.accepts(stored.key):
        return stored
    run.inside(run.record_path(EVAL_DIR, name))  # refused before sampling: no write through a link
    return compute(run, cfg, iteration, name, key.value)


def eval_blocks(cfg: Config, n_prompts: int) -> list[tuple[int, int]]:
    """The model calls of an evaluation, `(seed, first prompt)`: `model.max_batch` prompts a call."""
    return [(s, c0) for s in range(cfg.run.eval_seeds) for c0 in range(0, n_prompts, cfg.model.max_batch)]


def compute(run: Run, cfg: Config, iteration: int | None, name: str, key: str) -> EvaluateResult:
    """Sample and score the evaluation's calls in shards on the flow's workers, then write it."""
    t0 = time.perf_counter()
    reward = workspace.reward_identity(cfg.reward)
    ids = held_out(run, cfg)
    calls = eval_blocks(cfg, len(ids))
    per = blocks_per_shard(cfg, len(calls), cfg.model.max_batch)
    ledger = ledger_of(run, name)
    open_ledger(ledger, key)
    done = fan_out(
        evaluate_shard,
        ledger,
        key,
        [range(c, min(len(calls), c + per)) for c in range(0, len(calls), per)],
        {"run": run, "cfg": cfg, "iteration": iteration, "name": name},
        f"evaluation {name}",
        unit="model calls",
    ).results
    scored = output_of_json(done)
    value, strict = scored.scores, scored.strict
    sub = {}
    for sub_name, v in scored.sub.items():
        finite = v[torch.isfinite(v)]
        if finite.numel():
            sub[sub_name] = float(finite.mean())
    result = EvaluateResult(
        label=label(iteration),
        iteration=iteration,
        key=key,
        reward_name=reward["name"],
        reward_version=reward["version"],
        prompts=len(ids),
        seeds=cfg.run.eval_seeds,
        reward_mean=float(value.mean()),
        reward_std=float(value.std(unbiased=False)),
        nfe=sum(r["nfe"] for r in done),
        scores=value.tolist(),
        grid=(Path(EVAL_DIR) / f"{name}.png").as_posix(),
        seconds=time.perf_counter() - t0,
        reward_strict=None if strict is None else float(strict.mean()),
        strict_scores=None if strict is None else strict.tolist(),
        sub=sub,
    )
    record = seal(result.model_dump(mode="json", exclude_none=True))
    write_file_atomic(run.inside(run.record_path(EVAL_DIR, name)), (json.dumps(record, indent=1) + "\n").encode())
    close_ledger(ledger)
    return result


def held_out(run: Run, cfg: Config) -> np.ndarray:
    """The prompt rows an evaluation samples: the first `run.eval_prompts` held-out (else train) prompts."""
    prompts = stored_prompts(run)
    return np.array((prompts.ids("test") or prompts.ids("train"))[: cfg.run.eval_prompts])


@shard_task("evaluate")
def evaluate_shard(run: Run, cfg: Config, iteration: int | None, name: str, key: str, shard: range) -> None:
    """Sample (ODE) and score the evaluation's calls `shard` (`eval_blocks`), then record the scores;
    the shard with the first call writes the image grid."""
    t0 = time.perf_counter()
    pol = workspace.policy_after(run, cfg, iteration)
    reward = workspace.reward(cfg.reward)
    prompts = stored_prompts(run)
    ids = held_out(run, cfg)
    sigmas = pol.sigmas(cfg.sampler.eval_steps)
    outputs, nfe0 = [], pol.nfe
    for s, c0 in eval_blocks(cfg, len(ids))[shard.start : shard.stop]:
        rows = ids[c0 : c0 + cfg.model.max_batch]
        x0 = torch.cat(
            [pol.initial_noise(1, generator(cfg.run.seed, "eval", s, int(p), device=pol.device)) for p in rows]
        )
        out = sample(pol.velocity, x0, sigmas, encode(pol, prompts.texts, rows), kernel="ode")
        images = pol.decoder.decode_uint8(out.states[:, -1])
        scored = score_images(
            reward,
            images,
            prompts.texts_of(rows),
            prompts.metadata_of(rows),
            chunk=len(rows),
            device=pol.decoder.device,
        )
        if not bool(torch.isfinite(scored.scores).all()):
            bad = torch.nonzero(~torch.isfinite(scored.scores)).reshape(-1).tolist()[:10]
            raise StageError(
                f"evaluation reward {reward.name!r} returned NaN/inf for held-out rows {[c0 + b for b in bad]}"
            )
        outputs.append(scored)
        if s == 0 and c0 == 0:
            shown = rows[:GRID_IMAGES]
            captions = [
                f"{reward.name} {float(v):.3f}\n{text}"
                for text, v in zip(prompts.texts_of(shown), scored.scores[: len(shown)])
            ]
            write_grid(
                run.inside(Path(run.path) / EVAL_DIR / f"{name}.png"),
                dequantize(images[: len(shown)]),
                captions=captions,
            )
        maybe_fail("evaluate", shard.start)
    result = {**output_json(cat_outputs(outputs)), "nfe": pol.nfe - nfe0, "seconds": time.perf_counter() - t0}
    record(ledger_of(run, name), shard, key, result)


def ledger_of(run: Run, name: str) -> Path:
    """The ledger of evaluation `name` (beside its JSON file)."""
    return run.inside(Path(run.path) / EVAL_DIR / f".{name}.shards")
