"""Prefect deployments: `stepgrpo deploy --config F` registers the `train` flow (or `--flow
calibrate`) with F's resolved values as its `config` parameter, so the UI's run form opens filled
with that recipe, every field typed and described (`stepgrpo.config`); `stepgrpo deploy --flow
evaluate|rescore|credit|credit-quality` registers an offline flow, its form asking for the run.
`prefect.yaml` declares the same deployments for a checkout (`prefect deploy --all`).

A deployed run lands where the user works: the worker runs in the directory `deploy` ran in (the
deployment's source), and the config's relative paths (`run.runs_root`, prompt files, a local
model or LoRA) are made absolute against it when the deployment is made, so a worker started
elsewhere, or a wheel's site-packages, never becomes their base.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any
from uuid import UUID

from stepgrpo.config import Config, validate_config

FLOWS = {"train": "GRPO training", "calibrate": "DenseGRPO psi calibration"}  # the flows that take a config
# the offline flows: their module entrypoint (the worker imports the installed flow by name)
OFFLINE = {
    "evaluate": ("stepgrpo.flows.evaluate.evaluate", "held-out evaluation of a run"),
    "rescore": ("stepgrpo.flows.rescore.rescore", "a run's stored trajectories scored with another reward"),
    "credit": ("stepgrpo.flows.credit.credit", "a run's advantages with another scheme"),
    "credit-quality": ("stepgrpo.flows.quality.credit_quality", "every credit scheme judged on a stored iteration"),
}


def anchored(cfg: Config, base: Path) -> Config:
    """`cfg` with the paths it names relative to `base` made absolute: `run.runs_root` always, a
    prompt file, `model.path` and `model.init_lora` where `base` holds them (else they are names: a
    prompt set, a hub id, the shipped model)."""
    data = cfg.model_dump(mode="json")
    run, model = data["run"], data["model"]
    if not Path(run["runs_root"]).is_absolute():
        run["runs_root"] = str((base / run["runs_root"]).resolve())
    for section, key in ((run, "prompts"), (run, "heldout_prompts"), (model, "path"), (model, "init_lora")):
        value = section.get(key)
        if value and not Path(value).is_absolute() and (base / value).exists():
            section[key] = str((base / value).resolve())
    return validate_config(data)


def check_pool(pool: str) -> None:
    """The work pool must exist (else the deployment waits for a worker of a pool nobody made)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(pool)
        except ObjectNotFound:
            raise ValueError(
                f"work pool {pool!r} does not exist on this Prefect server: create it with "
                f"`prefect work-pool create {pool} --type process`, then deploy again"
            ) from None


def deploy_flow(cfg: Config | None, name: str, pool: str, source: str | None, flow_name: str = "train") -> UUID:
    """Register `<flow_name>/<name>` on work pool `pool`, run in this directory: a training flow's
    form defaults `cfg` (read from `source`, its paths anchored here), an offline flow's form empty."""
    from prefect import Flow

    if flow_name not in FLOWS and flow_name not in OFFLINE:
        raise ValueError(f"--flow {flow_name!r}: one of {', '.join([*FLOWS, *OFFLINE])}")
    check_pool(pool)
    here = Path.cwd().resolve()
    if flow_name in OFFLINE:
        entrypoint, what = OFFLINE[flow_name]
        flow = Flow.from_source(source=str(here), entrypoint=entrypoint)
        return flow.deploy(
            name=name,
            work_pool_name=pool,
            description=f"{what}; runs in {here} (`stepgrpo deploy`).",
            tags=["stepgrpo", flow_name],
            print_next_steps=False,
        )
    if cfg is None:
        raise ValueError(f"--flow {flow_name} needs --config: its run form holds that recipe")
    cfg = anchored(cfg, here)
    flow = Flow.from_source(source=str(here), entrypoint=f"stepgrpo.flows.{flow_name}.{flow_name}")
    deployment_id = flow.deploy(
        name=name,
        work_pool_name=pool,
        parameters={"config": cfg.model_dump(mode="json")},
        description=f"{FLOWS[flow_name]}, the run form filled from {source}; runs in {here}, its relative paths "
        "resolved there (`stepgrpo deploy`).",
        tags=["stepgrpo", flow_name, cfg.credit.scheme],
        print_next_steps=False,
    )
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentUpdate

    with get_client(sync_client=True) as client:
        schema = client.read_deployment(deployment_id).parameter_openapi_schema
        client.update_deployment(
            deployment_id, DeploymentUpdate(parameter_openapi_schema=recipe_form(schema, cfg, str(source)))
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
