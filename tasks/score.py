"""The score stage: one reward's rows for every clean state of an iteration; no transformer call.

The images come from the iteration's image store when it has one (no VAE call either), else from
decoding the clean latents with the VAE alone, stored for the next reward (`storage.images`).
States after the SDE window are `x_T`: their rows repeat R_T's.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from stepgrpo import workspace
from stepgrpo.config import Config
from stepgrpo.errors import StageError
from stepgrpo.prompts import stored_prompts
from stepgrpo.results import CompleteResult, RolloutResult, ScoreResult
from stepgrpo.scoring import decode_distinct, reward_summary, score_images
from storage.errors import AlreadyPublishedError, CorruptChunkError, StageLockedError
from storage.run import Run
from tasks.base import intact, repair_table, stage_task, warn
from tasks.complete import clean_latents, clean_stage, scored_states


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
    images = run.images_stage(clean_stage(cfg.completion.method))
    if run.stage_manifest(iteration, images) is not None:  # the decoded images other rewards will read
        intact(run, iteration, images)
    if run.read_rewards(iteration, name, version).num_rows == 0:
        compute(run, cfg, iteration, name, version)
    return stored(run, iteration, name, version)


def compute(run: Run, cfg: Config, iteration: int, name: str, version: str) -> None:
    """Score and append the rows, with how long it took and where the images came from."""
    t0 = time.perf_counter()
    reward = workspace.reward(cfg.reward)
    images, k_of, images_from = _images(run, cfg, iteration)
    B, K = images.shape[:2]
    flat = torch.from_numpy(images.reshape(B * K, *images.shape[2:]))
    traj, k = np.repeat(np.arange(B), K), np.tile(k_of, B)
    prompts = stored_prompts(run)
    pids = run.read_array(iteration, "rollout", "prompt_ids")[traj]
    out = score_images(
        reward,
        flat,
        prompts.texts_of(pids),
        prompts.metadata_of(pids),
        chunk=max(1, cfg.model.max_batch),
        progress=f"score {iteration}",
    )
    bad = torch.nonzero(~torch.isfinite(out.scores)).reshape(-1).tolist()
    if bad:
        rows = ", ".join(f"(traj {int(traj[b])}, k {int(k[b])})" for b in bad[:10])
        raise StageError(
            f"reward {name!r} returned NaN/inf for {len(bad)} rows of iteration {iteration}: {rows}; nothing was stored"
        )
    _, copies = scored_states(run, cfg.completion.method, iteration)
    take = torch.from_numpy(np.concatenate([np.arange(B * K), np.repeat(np.arange(B) * K + K - 1, len(copies))]))
    traj, k = np.concatenate([traj, np.repeat(np.arange(B), len(copies))]), np.concatenate([k, np.tile(copies, B)])
    run.append_rewards(
        iteration,
        name,
        version,
        traj,
        k,
        out.scores[take].double().numpy(),
        strict=None if out.strict is None else out.strict[take].double().numpy(),
        sub={s: v[take].double().numpy() for s, v in out.sub.items()} or None,
        info={"seconds": time.perf_counter() - t0, "images": images_from},
    )


def _images(run: Run, cfg: Config, iteration: int) -> tuple[np.ndarray, np.ndarray, str]:
    """`[B, K, 3, Y, X]` uint8 images of the clean latents, their state indices `k [K]`, and where
    they came from ("stored", "decoded" or "decoded+stored")."""
    source = clean_stage(cfg.completion.method)
    try:
        stored_images = run.read_images(iteration, source)
    except CorruptChunkError as err:
        warn(f"{err}; kept aside as {run.set_aside(iteration, run.images_stage(source)).name}, decoding again")
        stored_images = None
    if stored_images is not None:
        return stored_images.images, stored_images.k, "stored"
    k, _ = scored_states(run, cfg.completion.method, iteration)
    latents = clean_latents(run, cfg.completion.method, iteration, k)
    B, K = latents.shape[:2]
    flat = decode_distinct(
        workspace.decoder(cfg.model),
        latents.reshape(B * K, *latents.shape[2:]),
        max(1, cfg.model.max_batch),
        f"decode {iteration}",
    )
    images = flat.reshape(B, K, *flat.shape[1:])
    if not cfg.storage.images:
        return images, k, "decoded"
    try:
        with run.begin_images(iteration, source, k=k, image_shape=images.shape[2:]) as writer:
            writer.write(0, images=images)
            writer.publish()
    except (AlreadyPublishedError, StageLockedError):
        return images, k, "decoded"  # another scorer stored (or is storing) the same bytes
    return images, k, "decoded+stored"


def stored(run: Run, iteration: int, name: str, version: str | None = None) -> ScoreResult:
    """The result of the stored rows of reward `name` (`version`: the latest stored when None),
    with the seconds and the images' source recorded when they were computed."""
    if version is None:
        versions = sorted(set(run.read_rewards(iteration, name).column("reward_version").to_pylist()))
        if not versions:
            names = sorted(set(run.read_rewards(iteration).column("reward_name").to_pylist()))
            raise StageError(
                f"run {run.run_id} iteration {iteration} has no rewards named {name!r}; "
                f"stored: {', '.join(names) or 'none'}"
            )
        version = versions[-1]
    grid = run.reward_grid(iteration, name, version)  # [B, T+1]
    summary = reward_summary(
        grid,
        run.reward_grid(iteration, name, version, field="strict"),
        torch.from_numpy(run.read_array(iteration, "rollout", "group_ids")).long(),
    )
    digest = run.rewards_digest(iteration, name, version)
    info = run.rows_info("rewards", digest)
    return ScoreResult(
        digest=digest,
        iteration=iteration,
        reward_name=name,
        reward_version=version,
        images=info.get("images", "none"),
        seconds=info.get("seconds", 0.0),
        **summary,
    )
