"""Everything about a command's input that can be checked before a Prefect server starts or a
directory is made: the config, the model's components, the prompt files, the reward's options.

Each check raises an error that names the problem and the fix (`ConfigError`, `StageError`,
`ModelNotFoundError`); `stepgrpo_cli` and the flows run them first.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

from stepgrpo.config import Config
from stepgrpo.errors import StageError

# What a component directory of a diffusers pipeline must hold, by the library its class comes from.
COMPONENT_FILES = {
    "diffusers": ("config.json", "scheduler_config.json"),
    "transformers": ("config.json", "tokenizer_config.json"),
}


def check_model(path: str) -> None:
    """A local pipeline directory names its components in `model_index.json`; each must be there."""
    from stepgrpo.loops.workspace import resolve_model_path

    resolved = Path(resolve_model_path(path))
    if not resolved.is_dir():
        check_hub_model(path)
        return
    index = resolved / "model_index.json"
    if not index.is_file():
        raise StageError(
            f"model.path {path!r}: {index} is missing; a StableDiffusion3Pipeline directory has one "
            "(save one with `pipeline.save_pretrained(dir)`)"
        )
    try:
        components = json.loads(index.read_text())
    except json.JSONDecodeError as err:
        raise StageError(f"model.path {path!r}: {index} is not JSON ({err.msg}, line {err.lineno})") from None
    for name, spec in components.items():
        if name.startswith("_") or not isinstance(spec, list) or len(spec) != 2 or spec[0] is None:
            continue
        folder = resolved / name
        wanted = COMPONENT_FILES.get(spec[0], ("config.json",))
        if not folder.is_dir() or not any((folder / f).is_file() for f in wanted):
            raise StageError(
                f"model.path {path!r}: component {name}/ ({spec[1]}) is missing or has no "
                f"{' or '.join(wanted)}; model_index.json lists it, so the pipeline cannot load"
            )


def check_hub_model(repo_id: str) -> None:
    """A model named by its hub id, readable before any server starts or weight loads: in the local
    cache (then it loads offline too), else, with the hub on, there and open to this login."""
    check_hub_repo(repo_id, f"model.path {repo_id!r}", "model_index.json")


def check_hub_repo(repo_id: str, where: str, marker: str | None = None) -> None:
    """`repo_id` readable from the hub or the local cache (`marker`: a file whose cached copy says
    it is there; None: any cached snapshot), else one line naming `where`, the problem and its fix."""
    from huggingface_hub import auth_check, constants, is_offline_mode, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError
    from huggingface_hub.file_download import repo_folder_name

    try:
        if marker is not None:
            if isinstance(try_to_load_from_cache(repo_id, marker), str):
                return
        else:
            snapshots = (
                Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model") / "snapshots"
            )
            if snapshots.is_dir() and any(snapshots.iterdir()):
                return
    except HFValidationError:
        raise StageError(f"{where} is neither a local path nor a hub model id (owner/name): check it") from None
    if is_offline_mode():
        raise StageError(
            f"{where} is not a local path nor in the Hugging Face cache, and HF_HUB_OFFLINE is set: download it "
            f"once with the network on (`hf download {repo_id}`), or unset HF_HUB_OFFLINE"
        )
    try:
        auth_check(repo_id)
    except GatedRepoError:
        raise StageError(
            f"{where} is gated: accept its licence on https://huggingface.co/{repo_id}, then log in "
            "(`hf auth login`, or set HF_TOKEN)"
        ) from None
    except RepositoryNotFoundError:
        raise StageError(
            f"{where}: no such local path, and no hub model this login can read (a typo, or a private "
            "model: log in with `hf auth login` or set HF_TOKEN)"
        ) from None
    except HFValidationError:
        raise StageError(f"{where} is neither a local path nor a hub model id (owner/name): check it") from None
    except Exception as err:  # the hub cannot be reached: no network, a proxy, a wrong HF_ENDPOINT
        raise StageError(
            f"{where}: the Hugging Face hub cannot be reached ({type(err).__name__}: {err}); check the network "
            "or HF_ENDPOINT, or, with the weights in the cache, set HF_HUB_OFFLINE=1"
        ) from None


def check_reward_weights(reward: str, options: dict[str, Any], where: str = "reward") -> None:
    """The hub weights a reward loads (its registered `hub` options: their values, or the
    factory's defaults), checked as the policy model's are: cached, or on the hub and readable."""
    import inspect

    from stepgrpo.rewards import REWARDS

    if ":" in reward or reward not in REWARDS.names():
        return  # a plug-in or a weighted spec: its parts are checked where they are built
    names = REWARDS.facts(reward).get("hub", ())
    if not names:
        return
    defaults = {k: p.default for k, p in inspect.signature(REWARDS.get(reward)).parameters.items()}
    for name in names:
        value = options.get(name, defaults.get(name))
        if not isinstance(value, str) or not value or Path(value).expanduser().exists():
            continue  # not set (the reward uses another option), or a local file or directory
        check_hub_repo(value, f"{where} {reward}: {name} {value!r}")


def check_reward_server(reward: str, options: dict[str, Any]) -> None:
    """An `http` reward's server, before any Prefect server starts or model loads: reachable, and
    serving the identity the config declares (one try, seconds, not the stage's retries)."""
    if reward != "http":
        return
    from stepgrpo.rewards.remote import HttpReward

    try:
        HttpReward.check_options(options)
        server = HttpReward(
            str(options.get("url", "")),
            str(options.get("name", "")),
            str(options.get("version", "")),
            timeout=10.0,
            connect_timeout=5.0,
            retries=0,
        )
        server.check()
    except (RuntimeError, ValueError) as err:
        raise StageError(str(err)) from None


def check_config(cfg: Config, calibrated: bool = False) -> None:
    """The model's components, the prompt files, the reward's options and, for calibration, the kernel."""
    from stepgrpo.loops.workspace import reward_identity
    from stepgrpo.policy.devices import check_device
    from stepgrpo.prompts import prompt_source

    try:
        check_device(cfg.model.device)
    except ValueError as err:
        raise StageError(str(err)) from None
    check_model(cfg.model.path)
    prompts = prompt_source(cfg)
    if cfg.run.eval_protocol is not None:  # its pinned prompt file cached and matching, before anything starts
        from stepgrpo.prompts import find_prompt_file
        from stepgrpo.prompts.protocols import protocol

        p = protocol(cfg.run.eval_protocol)
        if p.prompts != "shapes":
            find_prompt_file(p.prompts)
        options = dict(cfg.reward.options) if cfg.reward.name == p.reward else {}
        check_reward_weights(p.reward, options, where=f"run.eval_protocol {p.name}'s scorer")
    if not prompts.ids("train"):
        raise StageError(
            f"run.prompts {cfg.run.prompts!r} holds no prompt: one prompt a line (.txt), "
            "or one JSON object with a 'prompt' field a line (.jsonl)"
        )
    if cfg.run.prompts_per_iteration > len(prompts.ids("train")):
        raise StageError(
            f"run.prompts_per_iteration={cfg.run.prompts_per_iteration} exceeds the {len(prompts.ids('train'))} "
            f"training prompts of run.prompts {cfg.run.prompts!r}: lower it, or give more prompts"
        )
    if cfg.run.heldout_prompts is not None and not prompts.ids("test"):
        raise StageError(f"run.heldout_prompts {cfg.run.heldout_prompts!r} holds no prompt")
    if cfg.run.heldout_prompts is not None and set(prompts.texts_of(prompts.ids("test"))) <= set(
        prompts.texts_of(prompts.ids("train"))
    ):
        print(
            f"warning: every held-out prompt of run.heldout_prompts {cfg.run.heldout_prompts!r} is also a training "
            "prompt: the held-out gain will be measured on prompts the run trains on"
        )
    check_reward_server(cfg.reward.name, dict(cfg.reward.options))  # every missing option at once
    check_reward_weights(cfg.reward.name, dict(cfg.reward.options), "reward")
    try:
        reward_identity(cfg.reward)
    except TypeError as err:
        raise StageError(f"reward.options: {err}") from None
    check_scale(cfg)
    if calibrated:
        check_calibrated(cfg)


def check_scale(cfg: Config) -> None:
    """Shards of whole model calls; Ray installed when the config asks for it."""
    from stepgrpo.runtime.sharding import check_shards
    from stepgrpo.runtime.workers import check_ray_installed

    try:
        check_shards(cfg)
    except ValueError as err:
        raise StageError(str(err)) from None
    if cfg.scale.workers == "ray":
        check_ray_installed()
    if cfg.scale.update_processes > cfg.run.prompts_per_iteration * cfg.run.group_size:
        raise StageError(
            f"scale.update_processes={cfg.scale.update_processes} exceeds the trajectories of an iteration: "
            "each process needs at least one"
        )
    check_memory(cfg)


def check_memory(cfg: Config, capacity: int | None = None) -> None:
    """On a GPU, the update's states (`stepgrpo.runtime.memory`) must fit in its memory (`capacity`
    bytes; None: the device's as torch reports it). A hub id that is not local is not fetched for this."""
    if not cfg.model.device.startswith("cuda"):
        return
    from stepgrpo.loops.workspace import resolve_model_path
    from stepgrpo.runtime import memory

    if capacity is None:
        import torch

        if not torch.cuda.is_available():
            return
        capacity = torch.cuda.get_device_properties(torch.device(cfg.model.device)).total_memory
    try:
        root = Path(resolve_model_path(cfg.model.path))
    except Exception:  # noqa: BLE001  (check_model names a missing model)
        return
    counts = memory.model_counts(root, cfg.model.lora_rank, tuple(cfg.model.lora_targets)) if root.is_dir() else None
    if counts is None:
        return
    try:
        memory.check_fits(cfg, counts, capacity)
    except ValueError as err:
        raise StageError(str(err)) from None


def check_calibrated(cfg: Config) -> None:
    """The config's kernel must be one whose noise is calibrated (`psi`), with step rewards."""
    from stepgrpo_core.kernels import KERNELS

    if not KERNELS.facts(cfg.sampler.kernel)["calibrated"]:
        calibrated = [k for k in KERNELS.names() if KERNELS.facts(k)["calibrated"]]
        raise StageError(
            f"sampler.kernel {cfg.sampler.kernel!r} has a fixed noise, nothing to calibrate; "
            f"calibration is for {', '.join(calibrated)} (set sampler.kernel)"
        )
    if cfg.completion.method is None:
        raise StageError("calibration needs step rewards: set completion.method (DenseGRPO uses 'remaining')")


def check_train(
    cfg: Config, run_dir: str | None, run_id: str | None, calibrated: bool = False, user_set: Collection[str] = ()
) -> Path:
    """A training (or calibration) command's input, before its flow and Prefect server start:
    the config, and the run directory it resumes or makes (returned). `user_set`: the config keys the
    user set themselves (`stepgrpo.config.user_set`), which the notes speak to."""
    from stepgrpo.runs import check_resumable, resolve_run_dir

    check_config(cfg, calibrated=calibrated)
    path = resolve_run_dir(cfg, run_dir, run_id)
    check_resumable(cfg, path)
    for line in cfg.notes(user_set):
        print(f"note: {line}")
    return path


def check_run(
    run: str,
    reward: str | None = None,
    reward_options: dict[str, Any] | None = None,
    scheme: str | None = None,
    scheme_options: dict[str, Any] | None = None,
    overrides: list[str] | None = None,
    rescore_iterations: list[int] | str | None = None,
) -> Path:
    """Check this command's names and options, then open the run (manifest and schema version
    checked) and its stored config as data (`stepgrpo.runs.open_stored`); with `rescore_iterations`
    (a list, or "all"), that a re-score finds their latents; for a re-score or a re-credit, that
    the run has rollouts. All before any server starts."""
    from stepgrpo.runs import open_stored
    from stepgrpo.storage.run import Run, find_run
    from stepgrpo_core.registry import allow, references_in

    allow(*references_in([reward, reward_options, scheme]))  # this command's own names may be imported
    replace: dict[str, Any] = {}
    if reward is not None:
        from stepgrpo.rewards import REWARDS, reward_identity

        REWARDS.validate(reward)
        check_reward_server(reward, reward_options or {})  # every missing option at once
        check_reward_weights(reward, reward_options or {}, "--reward")
        try:
            reward_identity({"name": reward, "options": reward_options or {}})
        except TypeError as err:
            raise StageError(f"--options: {err}") from None
        replace["reward"] = {"name": reward, "options": reward_options or {}}
    if scheme is not None:
        from stepgrpo_core.credit import SCHEMES, check_options

        SCHEMES.validate(scheme)
        try:
            check_options(scheme, scheme_options or {})
        except ValueError as err:
            raise StageError(f"--options: {err}") from None
        replace["credit"] = {"scheme": scheme, "options": scheme_options or {}}
    path = find_run(run)
    for where, what in ((path, f"run {path.name}"), (path.parent, f"the runs root of {path.name} (its MLflow store)")):
        if not os.access(where, os.W_OK):
            raise StageError(
                f"{what} is read-only ({where}): this command writes into it (rows, evaluations, tracking); "
                "copy the run somewhere writable (`cp -a`) and name the copy"
            )
    if scheme is not None and SCHEMES.facts(scheme)["step_rewards"]:
        method = (Run.open(path).config.get("completion") or {}).get("method", "remaining")
        if method is None:
            final_only = [s for s in SCHEMES.names() if not SCHEMES.facts(s)["step_rewards"]]
            raise StageError(
                f"scheme {scheme!r} needs step rewards (the reward of every intermediate state's completion), but "
                f"run {path.name} scored only its final samples (completion.method: null); on this run use "
                f"{', '.join(final_only)}, or train a run with completion.method remaining / substeps:N"
            )
    stored, cfg = open_stored(path, overrides or [], replace)
    if overrides:
        from stepgrpo.policy.devices import check_device

        try:
            check_device(cfg.model.device)
        except ValueError as err:
            raise StageError(str(err)) from None
        check_model(cfg.model.path)
    if reward is not None or scheme is not None:
        from stepgrpo.runs import stored_iterations

        stored_iterations(stored)  # a run without a published rollout has nothing to re-score or re-credit
    if rescore_iterations is not None:
        from stepgrpo.runs import check_rescorable

        todo = stored.iterations("rollout") if rescore_iterations == "all" else rescore_iterations
        check_rescorable(stored, cfg.completion.method, todo)
    return path


def check_checkpoint(path: Path, iteration: int | None) -> None:
    """An evaluation's checkpoint is there (None: the latest; -1: the base model, always)."""
    from stepgrpo.runs import latest_checkpoint
    from stepgrpo.storage.run import Run

    run = Run.open(path)
    if iteration is None:
        latest_checkpoint(run)
    elif iteration >= 0 and run.stage_manifest(iteration, "checkpoint") is None:
        raise StageError(f"run {run.run_id} has no checkpoint of iteration {iteration}; see `stepgrpo inspect`")


def check_quality(
    run: str, iteration: int | None, continuations: int, schemes: list[str], methods: list[str], overrides: list[str]
) -> Path:
    """A credit-quality check's input, before its server starts: `continuations` even, the schemes
    and completion methods known, the run stored with a published rollout at `iteration`."""
    from stepgrpo.loops.judging import check_continuations, schemes_to_judge
    from stepgrpo.storage.run import Run
    from stepgrpo_core.completions import validate_method
    from stepgrpo_core.registry import allow

    check_continuations(continuations)
    allow(*schemes)  # the caller's own names may be imported
    schemes_to_judge(schemes)
    for method in methods:
        try:
            validate_method(method)
        except (KeyError, ValueError) as err:
            raise StageError(f"--method {method!r}: {err}") from None
    path = check_run(run, overrides=overrides)
    done = Run.open(path).iterations("rollout")
    if not done:
        raise StageError(f"run {path.name} has no published rollout yet: nothing to judge")
    if iteration is not None and iteration not in done:
        raise StageError(f"run {path.name} has no published rollout at iteration {iteration}; stored: {done}")
    return path
