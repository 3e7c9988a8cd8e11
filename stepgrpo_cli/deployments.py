"""Prefect deployments made from a config: `stepgrpo deploy --config F` registers the `train` flow
(or `--flow calibrate`)
with F's resolved values as its `config` parameter, so the UI's run form opens filled with that
recipe, every field typed and described (`stepgrpo.config`); `prefect.yaml` declares the fixed
deployments (`prefect deploy --all`).
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any
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
    deployment_id = flow.deploy(
        name=name,
        work_pool_name=pool,
        parameters={"config": cfg.model_dump(mode="json")},
        description=f"{FLOWS[flow_name]}, the run form filled from {source} (`stepgrpo deploy`).",
        tags=["stepgrpo", flow_name, cfg.credit.scheme],
        print_next_steps=False,
    )
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentUpdate

    with get_client(sync_client=True) as client:
        schema = client.read_deployment(deployment_id).parameter_openapi_schema
        client.update_deployment(
            deployment_id, DeploymentUpdate(parameter_openapi_schema=recipe_form(schema, cfg, source))
        )
    return deployment_id


def recipe_form(schema: dict[str, Any], cfg: Config, source: str) -> dict[str, Any]:
    """The run form's field notes for a deployment of `cfg`: each field shows the recipe's value
    (the form's field holds it), and the code's default only as the second word, so that a reader
    never takes the default for what the run will use ("shapes_dense.yaml: `0.0005` (stepgrpo's
    default: `0.0003`)")."""
    schema = copy.deepcopy(schema)
    values = cfg.model_dump(mode="json")
    definitions = schema.get("definitions", {})
    for section, field in Config.model_fields.items():
        props = definitions.get(getattr(field.annotation, "__name__", ""), {}).get("properties", {})
        for name, prop in props.items():
            text = prop.get("description", "")
            found = re.search(r"\n*Default: `(.*)`\.$", text, flags=re.S)
            if found is None or name not in values.get(section, {}):
                continue
            value = json.dumps(values[section][name])
            default = "" if value == found.group(1) else f": `{found.group(1)}`"
            note = f"{source}: `{value}` (stepgrpo's default{default})."
            prop["description"] = text[: found.start()] + ("\n\n" if found.start() else "") + note
    return schema
