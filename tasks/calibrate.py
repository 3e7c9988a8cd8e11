"""The calibrate stage: DenseGRPO's per-step exploration noise `psi` for a calibrated kernel.

With the base policy, each round samples groups with the current table and the run's SDE window
(as training samples them), completes and scores every state the window makes stochastic, and
moves `psi[k]` of the window's steps by the sign of the step gains that the kernel's declared
scheme (`calibrate_with`) reads (`stepgrpo_core.calibration`); the steps outside the window keep
their table value (they are ODE steps). The table is stored in the run as `calibration/psi.json`,
with the table it started from and the rounds' history.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from stepgrpo.checks import check_calibrated
from stepgrpo.config import Config, digest_of
from stepgrpo.loops import workspace
from stepgrpo.loops.sampling import generator, sample_groups
from stepgrpo.loops.scoring import score_images
from stepgrpo.prompts import stored_prompts
from stepgrpo.results import CalibrateResult, PromptsResult
from stepgrpo.storage.publish import write_file_atomic
from stepgrpo.storage.run import Run
from stepgrpo.tasks.base import stage_task, warn
from stepgrpo.tasks.keys import Key, stage_key
from stepgrpo_core.kernels import KERNELS

CALIBRATION_FILE = "calibration/psi.json"


@stage_task("calibrate")
def calibrate(run: Run, cfg: Config, prompts: PromptsResult) -> CalibrateResult:
    """Calibrate the run's `psi` table (once)."""
    return execute(run, cfg, stage_key("calibrate", run, cfg, 0, {"prompts": prompts}))


def execute(run: Run, cfg: Config, key: Key) -> CalibrateResult:
    found = read(run)
    if found is not None and key.accepts(found.key):
        return found
    return compute(run, cfg, key.value)


def read(run: Run) -> CalibrateResult | None:
    """The run's stored calibration, or None; a record that does not parse or whose table does not
    match its digest is set aside (never deleted)."""
    path = Path(run.path) / CALIBRATION_FILE
    if not path.is_file():
        return None
    try:
        found = CalibrateResult.from_json(path.read_text())
        if found.digest == digest_of(found.psi):
            return found
    except ValueError:
        pass
    warn(
        f"{path} is damaged (it does not parse or its table does not match its digest); kept aside as "
        f"{run.set_aside_file(path).name}, calibrating again"
    )
    return None


def compute(run: Run, cfg: Config, key: str) -> CalibrateResult:
    from stepgrpo_core.calibration import initial_psi, update_psi
    from stepgrpo_core.completions import complete, completed_through
    from stepgrpo_core.credit import assign

    path = run.inside(Path(run.path) / CALIBRATION_FILE)  # no write through a link out of the run
    check_calibrated(cfg)
    t0 = time.perf_counter()
    pol = workspace.policy_after(run, cfg, None)
    reward = workspace.reward(cfg.reward)
    prompts = stored_prompts(run)
    train_ids = np.array(prompts.ids("train"))
    c, G, T, seed = cfg.calibration, cfg.run.group_size, cfg.sampler.steps, cfg.run.seed
    kernel = cfg.sampler.kernel
    scheme = KERNELS.facts(kernel)["calibrate_with"]
    sigmas = pol.sigmas(T)
    psi = initial_psi(sigmas.cpu(), c.init_a)
    start, end = cfg.sampler.window()
    window = torch.zeros(T, dtype=torch.bool)
    window[start:end] = True
    through = completed_through(cfg.completion.method, end, T)
    history = [{"round": -1, "psi": psi.tolist()}]  # the starting table
    for r in range(c.rounds):
        pick = torch.randperm(len(train_ids), generator=generator(seed, "calibrate-prompts", r))[: c.prompts]
        pids = np.repeat(train_ids[pick.numpy()], G)
        (chunk,) = sample_groups(  # all groups in one call
            pol,
            prompts.texts,
            pids,
            [(seed, "calibrate-noise", r, g) for g in range(len(pick))],
            G,
            sigmas,
            kernel=kernel,
            noise=psi.to(pol.device),
            sde_seed=lambda c0, r=r: (seed, "calibrate-sde", r),
            groups_per_call=len(pick),
            window=(start, end - start),
            progress=f"calibrate {r}",
            shared_x0=cfg.sampler.shared_x0,
        )
        done = complete(
            cfg.completion.method,
            pol.velocity,
            chunk.sde.states,
            sigmas,
            chunk.cond,
            cfg.model.max_batch,
            through,
            velocities=chunk.sde.velocities,  # `rollout`: the sampled velocities, no model call
        )
        B, T1 = done.latents.shape[:2]
        images = pol.decoder.decode_uint8(done.latents.reshape(B * T1, *done.latents.shape[2:]))
        rows = np.repeat(pids, T1)
        scored = score_images(
            reward,
            images,
            prompts.texts_of(rows),
            prompts.metadata_of(rows),
            chunk=max(1, len(images)),
            device=pol.decoder.device,
        )
        scores = scored.scores.float().reshape(B, T1)
        gains = assign(scheme, scores, torch.from_numpy(np.repeat(np.arange(len(pick)), G))).gains
        psi = torch.where(window, update_psi(psi, gains.cpu(), c.eps1, c.eps2), psi)
        history.append({"round": r, "reward_mean": float(scores[:, -1].mean()), "psi": psi.tolist()})
    result = CalibrateResult(
        key=key, psi=psi.tolist(), rounds=history, seconds=time.perf_counter() - t0, digest=digest_of(psi.tolist())
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomic(path, (result.model_dump_json(indent=1, exclude_none=True) + "\n").encode())
    return result
