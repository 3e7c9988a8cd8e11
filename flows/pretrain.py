"""Pretrain the shipped `shapes` model: the autoencoder, then the transformer and text encoders.

A thin wrapper: the stages, checkpoints and export live in `stepgrpo.pretraining.pretrain`. Rerunning
with the same `workdir` resumes from the last checkpoint.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from stepgrpo.pretraining.pretrain import PretrainConfig
from stepgrpo.pretraining.pretrain import pretrain as run_pretrain


@flow(name="pretrain", log_prints=True)
def pretrain(
    workdir: str = ".pretrain",
    out: str = "",
    overwrite: bool = False,
    seed: int = 0,
    vae_minutes: float = PretrainConfig.vae_minutes,
    minutes: float = PretrainConfig.minutes,
    cooldown_minutes: float = PretrainConfig.cooldown_minutes,
    eval_minutes: float = PretrainConfig.eval_minutes,
    threads: int = PretrainConfig.threads,
) -> dict[str, Any]:
    """Train (or resume) and export the fp16 pipeline to `out` (default: a new `models/shapes-<UTC
    time>`; an existing model is replaced only with `overwrite`); returns steps, minutes and size."""
    cfg = PretrainConfig(
        workdir=workdir,
        out=out,
        overwrite=overwrite,
        seed=seed,
        vae_minutes=vae_minutes,
        minutes=minutes,
        cooldown_minutes=cooldown_minutes,
        eval_minutes=eval_minutes,
        threads=threads,
    )
    return run_pretrain(cfg)
