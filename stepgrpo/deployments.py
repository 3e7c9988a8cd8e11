"""Prefect deployments made from a config: `stepgrpo deploy --config F` registers the `train` flow
with F's resolved values as its `config` parameter, so the UI's run form opens filled with that
recipe, every field typed and described (`stepgrpo.config`); `prefect.yaml` declares the fixed
deployments (`prefect deploy --all`).
"""

from __future__ import annotations

from uuid import UUID

from stepgrpo.config import Config
from stepgrpo.paths import REPO_ROOT


def deploy_train(cfg: Config, name: str, pool: str, source: str) -> UUID:
    """Register `train/<name>` on work pool `pool`, its form defaults `cfg` (read from `source`)."""
    from prefect import Flow

    flow = Flow.from_source(source=str(REPO_ROOT), entrypoint="flows/train.py:train")
    return flow.deploy(
        name=name,
        work_pool_name=pool,
        parameters={"config": cfg.model_dump(mode="json")},
        description=f"GRPO training, the run form filled from {source} (`stepgrpo deploy`).",
        tags=["stepgrpo", "train", cfg.credit.scheme],
        print_next_steps=False,
    )
