"""Prefect deployments made from a config: `stepgrpo deploy --config F` registers the `train` flow
(or `--flow calibrate`)
with F's resolved values as its `config` parameter, so the UI's run form opens filled with that
recipe, every field typed and described (`stepgrpo.config`); `prefect.yaml` declares the fixed
deployments (`prefect deploy --all`).
"""

from __future__ import annotations

from uuid import UUID

from stepgrpo.config import Config
from stepgrpo.paths import REPO_ROOT

FLOWS = {"train": "GRPO training", "calibrate": "DenseGRPO psi calibration"}  # the flows that take a config


def deploy_flow(cfg: Config, name: str, pool: str, source: str, flow_name: str = "train") -> UUID:
    """Register `<flow_name>/<name>` on work pool `pool`, its form defaults `cfg` (read from `source`)."""
    from prefect import Flow

    if flow_name not in FLOWS:
        raise ValueError(f"--flow {flow_name!r}: the flows that take a config are {', '.join(FLOWS)}")
    # a module entrypoint (`stepgrpo.flows.train.train`): the worker imports the installed flow by name
    flow = Flow.from_source(source=str(REPO_ROOT), entrypoint=f"stepgrpo.flows.{flow_name}.{flow_name}")
    return flow.deploy(
        name=name,
        work_pool_name=pool,
        parameters={"config": cfg.model_dump(mode="json")},
        description=f"{FLOWS[flow_name]}, the run form filled from {source} (`stepgrpo deploy`).",
        tags=["stepgrpo", flow_name, cfg.credit.scheme],
        print_next_steps=False,
    )
