"""The score stage: one reward's rows for every clean state of an iteration; no transformer call.

The images come from the iteration's image store when it has one (no VAE call either), else from
decoding the clean latents with the VAE alone, stored for the next reward (`storage.images`).
States after the SDE window are `x_T`: their rows repeat R_T's.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import numpy as np
import torch

from stepgrpo.config import Config, digest_of
from stepgrpo.errors import StageError
from stepgrpo.loops import workspace
from stepgrpo.loops.scoring import (
    cat_outputs,
    decode_distinct,
    output_json,
    output_of_json,
    reward_summary,
    score_images,
)
from stepgrpo.prompts import stored_prompts
from stepgrpo.results import CompleteResult, RolloutResult, ScoreResult
from stepgrpo.runtime.faults import maybe_fail
from stepgrpo.runtime.sharding import block_rows, blocks, shard_ranges
from stepgrpo.storage.errors import AlreadyPublishedError, CorruptChunkError, StageLockedError
from stepgrpo.storage.ledger import close_ledger, open_ledger, record
from stepgrpo.storage.run import Run
from stepgrpo.storage.schema import completion_stage
from stepgrpo.tasks.base import fan_out, intact, repair_table, shard_task, stage_task, warn
from stepgrpo.tasks.complete import clean_latents, scored_states


@stage_task("score")
def score(
    run: Run, cfg: Config, iteration: int, clean: CompleteResult | RolloutResult, rollout: RolloutResult
) -> ScoreResult:
    """Score the clean latents of `clean` (a completion, or the rollout itself for outcome credit)."""
    return execute(run, cfg, iteration)


def execute(run: Run, cfg: Config, iteration: int) -> ScoreResult:
    identity = workspace.reward_identity(cfg.reward)
    name, version = identity["name"], identity["version"]
    repair_table(run, "rewards")
    images = run.stages.images_stage(completion_stage(cfg.completion.method))
    if run.stage_manifest(iteration, images) is not None:  # the decoded images other rewards will read
        intact(run, iteration, images)
    if run.tables.read_rewards(iteration, name, version).num_rows == 0:
        compute(run, cfg, iteration, name, version)
    return stored(run, iteration, name, version)


def compute(run: Run, cfg: Config, iteration: int, name: str, version: str) -> None:
    """Score the iteration's shards on the flow's workers (decoding and storing the images they
    need), then append every row at once, with how long it took and where the images came from."""
    t0 = time.perf_counter()
    method = cfg.completion.method
    source = completion_stage(method)
    k, copies = scored_states(run, method, iteration)
    attrs = run.stage_manifest(iteration, "rollout")["attrs"]
    B = int(attrs["B"])
    key = digest_of([run.stage_manifest(iteration, source)["digest"], name, version, k.tolist()])
    from_store = _stored_images(run, iteration, source)
    images = None
    if not from_store and cfg.storage.images:
        shape = workspace.decoder(cfg.model).image_shape((attrs["C"], attrs["H"], attrs["W"]))
        try:
            images = run.stages.begin_images(iteration, source, k=k, image_shape=shape, resume=key)
        except (AlreadyPublishedError, StageLockedError):
            pass  # another scorer stored (or is storing) the same bytes: decode without storing
    ledger = ledger_of(run, iteration, key)
    open_ledger(ledger, key)
    shards = shard_ranges(cfg, B)
    with images or contextlib.nullcontext():
        shards_done = fan_out(
            score_shard,
            ledger,
            key,
            shards,
            {
                "run": run,
                "cfg": cfg,
                "iteration": iteration,
                "k": k.tolist(),
                "from_store": from_store,
                "images_token": images.token if images is not None else None,
            },
            f"iteration {iteration} score {name}",
            intact=images.store().rows_intact if images is not None else None,
        )
        if images is not None:
            images.publish(inputs={"key": key, "shards": shards_done.summary})
    done = shards_done.results
    K = len(k)
    scored = output_of_json(done)
    take = torch.from_numpy(np.concatenate([np.arange(B * K), np.repeat(np.arange(B) * K + K - 1, len(copies))]))
    traj = np.concatenate([np.repeat(np.arange(B), K), np.repeat(np.arange(B), len(copies))])
    ks = np.concatenate([np.tile(k, B), np.tile(copies, B)])
    run.tables.append_rewards(
        iteration,
        name,
        version,
        traj,
        ks,
        scored.scores[take].double().numpy(),
        strict=None if scored.strict is None else scored.strict[take].double().numpy(),
        sub={n: v[take].double().numpy() for n, v in scored.sub.items()} or None,
        info={
            "seconds": time.perf_counter() - t0,
            "images": done[0]["images"],
            "shards": [{"rows": [r.start, r.stop], **d["worker"]} for r, d in zip(shards, done)],
            "computed": shards_done.summary["computed"],
        },
    )
    close_ledger(ledger)


def _stored_images(run: Run, iteration: int, source: str) -> bool:
    """Whether decoded images of `source`'s current latents are stored (damaged ones are set aside)."""
    stage = run.stages.images_stage(source)
    try:
        return run.stages.read_images(iteration, source, []) is not None
    except CorruptChunkError as err:
        warn(f"{err}; kept aside as {run.set_aside(iteration, stage).name}, decoding again")
        return False


@shard_task("score")
def score_shard(
    run: Run,
    cfg: Config,
    iteration: int,
    k: list[int],
    from_store: bool,
    images_token: str | None,
    key: str,
    shard: range,
) -> None:
    """Score the trajectories `shard`, block by block (`stepgrpo.runtime.sharding`): their stored images,
    or their clean latents decoded (and stored with `images_token`); then record the scores."""
    t0 = time.perf_counter()
    method = cfg.completion.method
    source = completion_stage(method)
    reward = workspace.reward(cfg.reward)  # loaded once per process: once per worker
    prompts = stored_prompts(run)
    pids = run.stages.read_array(iteration, "rollout", "prompt_ids")
    writer = run.attach(iteration, run.stages.images_stage(source), images_token) if images_token else None
    k_of = np.asarray(k, np.int64)
    outputs = []
    for block in blocks(shard, block_rows(cfg)):
        if from_store:
            images = run.stages.read_images(iteration, source, slice(block.start, block.stop)).images
        else:
            latents = clean_latents(run, method, iteration, k_of, block)
            n, K = latents.shape[:2]
            flat = decode_distinct(
                workspace.decoder(cfg.model),
                latents.reshape(n * K, *latents.shape[2:]),
                max(1, cfg.model.max_batch),
                f"decode {iteration}",
            )
            images = flat.reshape(n, K, *flat.shape[1:])
            if writer is not None:
                writer.write(block.start, images=images)
        n, K = images.shape[:2]
        traj = np.repeat(np.arange(block.start, block.stop), K)
        out = score_images(
            reward,
            torch.from_numpy(images.reshape(n * K, *images.shape[2:])),
            prompts.texts_of(pids[traj]),
            prompts.metadata_of(pids[traj]),
            chunk=max(1, cfg.model.max_batch),
            progress=f"score {iteration}",
        )
        bad = torch.nonzero(~torch.isfinite(out.scores)).reshape(-1).tolist()
        if bad:
            rows = ", ".join(f"(traj {int(traj[b])}, k {int(k_of[b % K])})" for b in bad[:10])
            raise StageError(
                f"reward {reward.name!r} returned NaN/inf for {len(bad)} rows of iteration {iteration}: {rows}; "
                "nothing was stored"
            )
        outputs.append(out)
        maybe_fail("score", shard.start)
    result = {
        **output_json(cat_outputs(outputs)),
        "images": "stored" if from_store else "decoded+stored" if writer is not None else "decoded",
        "seconds": time.perf_counter() - t0,
        "worker": workspace.worker(),
    }
    record(ledger_of(run, iteration, key), shard, key, result)


def ledger_of(run: Run, iteration: int, key: str) -> Path:
    """The ledger of the score stage of `iteration` under `key` (beside the iteration's stages)."""
    return run.inside(run.stage_path(iteration, "rollout").parent / f".score-{key[:16]}.shards")


def r0_is_ode(run: Run) -> bool:
    """Whether the run's `R_0` is the ODE sample of `x_0`: no completion (outcome's `ode_final`), or a
    method that runs the rollout's own ODE (`remaining`); a one-step estimate from noise is not."""
    from stepgrpo_core.completions import COMPLETIONS

    method = (run.config.get("completion") or {}).get("method", "remaining")
    name = str(method).partition(":")[0]
    return method is None or (name in COMPLETIONS.names() and bool(COMPLETIONS.facts(name)["exact_tail"]))


def stored(run: Run, iteration: int, name: str, version: str | None = None) -> ScoreResult:
    """The result of the stored rows of reward `name` (`version`: the latest stored when None),
    with the seconds and the images' source recorded when they were computed."""
    if version is None:
        versions = sorted(set(run.tables.read_rewards(iteration, name).column("reward_version").to_pylist()))
        if not versions:
            names = sorted(set(run.tables.read_rewards(iteration).column("reward_name").to_pylist()))
            raise StageError(
                f"run {run.run_id} iteration {iteration} has no rewards named {name!r}; "
                f"stored: {', '.join(names) or 'none'}"
            )
        version = versions[-1]
    grid = run.tables.reward_grid(iteration, name, version)  # [B, T+1]
    summary = reward_summary(
        grid,
        run.tables.reward_grid(iteration, name, version, field="strict"),
        torch.from_numpy(run.stages.read_array(iteration, "rollout", "group_ids")).long(),
        r0_is_ode=r0_is_ode(run),
    )
    digest = run.tables.rewards_digest(iteration, name, version)
    info = run.tables.rows_info("rewards", digest)
    return ScoreResult(
        digest=digest,
        iteration=iteration,
        reward_name=name,
        reward_version=version,
        images=info.get("images", "none"),
        seconds=info.get("seconds", 0.0),
        **summary,
    )
