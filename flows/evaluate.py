"""Evaluate a run: ODE sampling of held-out prompts, reward, and an image grid."""

from __future__ import annotations

from typing import Any

from prefect import flow

from stepgrpo.errors import StageError
from stepgrpo.flows.progress import evaluation_record, log_offline, name_flow_run, run_name_from_parameters
from stepgrpo.runs import latest_checkpoint, owned_stored
from stepgrpo.runtime import environment
from stepgrpo.runtime.workers import workers
from stepgrpo.tasks import bind, update


@flow(name="evaluate", log_prints=True, flow_run_name=run_name_from_parameters)
def evaluate(run: str, iteration: int | None = None, overrides: list[str] | None = None) -> dict[str, Any]:
    """Held-out reward of the policy after `iteration` (default: the latest checkpoint; -1: the base model).

    `overrides` (`key=value`) may change evaluation settings such as `run.eval_prompts` or `reward.name`.
    """
    with owned_stored(run, overrides or []) as (stored, cfg):
        environment.apply(cfg.scale.threads)
        name_flow_run(f"{stored.run_id} evaluate")
        stage = bind(stored, cfg)
        prompts = stage.prompts(stored, cfg)
        if iteration is None:
            iteration = latest_checkpoint(stored)
        checkpoint = None if iteration < 0 else update.stored(stored, iteration, verify=True)
        with workers(cfg, stored.path):  # `--set scale.workers=ray` evaluates in shards on Ray
            result = evaluation_record(stored, stage.evaluate(stored, cfg, iteration, prompts, checkpoint))
        print(
            f"held-out {result['reward_name']} after {result['label']}: {result['reward_mean']:.4f}; grid "
            f"{result['grid']}"
        )
        row = {k: v for k, v in result.items() if k not in ("scores", "strict_scores")} | {"iteration": iteration + 1}
        params = {"overrides": " ".join(overrides or []) or "(none)"}
        label = " ".join([result["label"], *(overrides or [])])  # one MLflow run per checkpoint and settings
        log_offline(stored, cfg, "evaluate", label, params, [row], ["reward_mean", "reward_strict"])
        return result


def protocol_config(cfg: Any, name: str, overrides: list[str] | None = None) -> Any:
    """`cfg` with the protocol's generation settings and then `overrides` written over it."""
    from stepgrpo.config import apply_overrides, validate_config
    from stepgrpo.prompts.protocols import protocol

    settings = protocol(name).overrides()
    return validate_config(apply_overrides(cfg.model_dump(mode="json"), [*settings, *(overrides or [])]))


def bundle_report(folder: Any, expected: dict[str, Any]) -> dict[str, Any]:
    """The report of the existing (verified) bundle `folder`, refused with what differs unless it is
    the evidence `expected` names: this run, checkpoint label and digest, protocol and overrides (a
    bundle copied from another run, or two swapped, is no evidence of this checkpoint)."""
    import json

    try:
        report = json.loads((folder / "report.json").read_text())
    except (OSError, ValueError, RecursionError) as err:
        raise StageError(
            f"{folder}/report.json is no report ({type(err).__name__}): move the bundle aside and evaluate again"
        ) from None
    if not isinstance(report, dict):
        raise StageError(f"{folder}/report.json is no report (a JSON {type(report).__name__}): move the bundle aside")
    protocol = report.get("protocol")
    found = {k: report.get(k) for k in expected} | {
        "protocol": protocol.get("name") if isinstance(protocol, dict) else None
    }
    differ = [k for k in expected if found[k] != expected[k]]
    if differ:
        said = "; ".join(f"{k} {found[k]!r}, this checkpoint's {expected[k]!r}" for k in differ)
        raise StageError(
            f"the evidence bundle {folder} is not this checkpoint's ({said}): move it aside and evaluate again"
        )
    return report


def protocol_bundle(
    stored: Any, cfg: Any, name: str, iteration: int, overrides: list[str], images: bool = False
) -> tuple[Any, dict[str, Any]]:
    """The evidence bundle of the policy after `iteration` (-1: the base model) under protocol
    `name`, `cfg` carrying its settings (`protocol_config`): an existing bundle of the same name is
    verified and read, else the evaluation runs and the bundle is written; returns (folder, report)."""
    from pathlib import Path

    from stepgrpo.config import digest_of
    from stepgrpo.loops import protocol as protocol_loop
    from stepgrpo.prompts.protocols import protocol
    from stepgrpo.storage.bundle import verify_bundle, write_bundle
    from stepgrpo.storage.errors import CorruptChunkError

    p = protocol(name)
    checkpoint = None if iteration < 0 else update.stored(stored, iteration, verify=True)
    label = "base" if iteration < 0 else f"iter_{iteration}"
    bundle = f"{p.name}-{label}" + (f"-{digest_of(sorted(overrides))[:8]}" if overrides else "")
    final = stored.inside(Path(stored.path) / stored.EVIDENCE_DIR / bundle)
    if final.is_dir() and not final.is_symlink():
        try:
            verify_bundle(final)
        except CorruptChunkError as err:  # damaged: kept aside, never deleted, and evaluated again
            aside = stored.set_aside_file(final)
            print(
                f"note: the evidence bundle {final.name} was damaged ({err}); kept aside as {aside.name}, "
                "evaluating again"
            )
    if final.is_dir() or final.is_symlink():
        verify_bundle(final)  # a link is refused, never followed or moved
        expected = {
            "run_id": stored.run_id,
            "label": label,
            "checkpoint_digest": None if checkpoint is None else checkpoint.digest,
            "protocol": p.name,
            "overrides": list(overrides),
        }
        report = bundle_report(final, expected)
        if images and not (final / "images").is_dir():
            raise StageError(
                f"the evidence bundle {final} was made without its images: move it aside and evaluate again with "
                "--images (a bundle is never changed in place)"
            )
        return final, report
    if final.exists():
        raise StageError(
            f"{final} is in the way of the evidence bundle (not a folder): move it aside and evaluate again"
        )
    report, rows, pngs = protocol_loop.evaluate(stored, cfg, p, None if iteration < 0 else iteration, images)
    report |= {
        "run_id": stored.run_id,
        "label": label,
        "checkpoint_digest": None if checkpoint is None else checkpoint.digest,
        "overrides": list(overrides),
    }
    env = protocol_loop.environment(cfg, report["seconds"])
    final.parent.mkdir(exist_ok=True)
    write_bundle(final, protocol_loop.bundle_files(report, rows, pngs, cfg, env))
    return final, report


@flow(name="evaluate-protocol", log_prints=True, flow_run_name=run_name_from_parameters)
def evaluate_protocol(
    run: str,
    protocol: str,
    iteration: int | None = None,
    overrides: list[str] | None = None,
    images: bool = False,
) -> dict[str, Any]:
    """The policy after `iteration` (default: the latest checkpoint; -1: the base model) under a
    paper's evaluation protocol (`stepgrpo.prompts.protocols`), and its evidence bundle in the run's
    `evidence/` (`stepgrpo.loops.protocol`). `overrides` change the protocol's settings and are
    recorded in the bundle and its name; an existing bundle of the same name is verified and read,
    not recomputed."""
    from stepgrpo.prompts.protocols import protocol as named

    p = named(protocol)
    with owned_stored(run, [*p.overrides(), *(overrides or [])]) as (stored, cfg):
        environment.apply(cfg.scale.threads)
        name_flow_run(f"{stored.run_id} evaluate {p.name}")
        if iteration is None:
            iteration = latest_checkpoint(stored)
        final, report = protocol_bundle(stored, cfg, p.name, iteration, list(overrides or []), images)
        head = report["results"]["headline"]
        print(f"{p.name} ({report['label']}): {head['name']} {head['value']:.4f}; evidence {final}")
        row = {"iteration": iteration + 1, "headline": head["value"], "protocol": p.name}
        params = {"protocol": p.name, "overrides": " ".join(overrides or []) or "(none)"}
        log_offline(stored, cfg, "evaluate", final.name, params, [row], ["headline"], artifacts=[str(final)])
        return {"bundle": str(final), "report": report}
