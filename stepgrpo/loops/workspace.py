"""Process-wide resources of the pipeline: the policy, reward models, model identity.

Loading a model costs seconds; a stage task must not pay it on every call. These caches keep one
policy per model config and one reward per reward config for the life of the process. Every
stage sets the policy's LoRA weights explicitly from a checkpoint (or the initial adapter)
before it uses it, so what a stage computes never depends on which stage ran before it in this
process: that is what makes a resumed run bit-identical to an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import threading
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from stepgrpo.config import Config, ModelConfig, RewardConfig, digest_of
from stepgrpo.paths import SHIPPED_ROOT
from stepgrpo.policy.shards import copy_into, local_shard

if TYPE_CHECKING:
    from stepgrpo.policy import Policy
    from stepgrpo.policy.base import ImageDecoder
    from stepgrpo.storage.run import Run

HASH_LIMIT = 256 * 2**20  # files up to this size are content-hashed for the model identity

_lock = threading.Lock()  # tasks may run in threads; model loading is not re-entrant
LOADS: Counter[str] = Counter()  # models this process loaded, by kind ("policy", "decoder", "reward")


def worker() -> dict[str, Any]:
    """Who computed a shard, recorded with it: the process, its host, and the models it has loaded
    so far (a worker that keeps its models shows the same counts from iteration to iteration)."""
    who = {"pid": os.getpid(), "host": socket.gethostname(), "loads": dict(LOADS), "reward_loads": LOADS["reward"]}
    ray = sys.modules.get("ray")  # on a Ray worker (never imported here): its node, which a host name may not tell
    if ray is not None and ray.is_initialized():
        who["node"] = ray.get_runtime_context().get_node_id()
    return who


class ModelNotFoundError(FileNotFoundError):
    """The configured model path is neither a directory nor a hub id."""


def resolve_model_path(path: str) -> str:
    """A local directory (relative to the working directory, else to the shipped files of
    `stepgrpo.paths`), or a hub id."""
    p = Path(path).expanduser()
    if p.is_dir():
        return str(p.resolve())
    if not p.is_absolute() and (SHIPPED_ROOT / p).is_dir():
        return str((SHIPPED_ROOT / p).resolve())
    org = path.split("/", 1)[0]
    local_parent = Path(org).is_dir() or (SHIPPED_ROOT / org).is_dir()  # e.g. "models/...": a local path
    if path.count("/") == 1 and not path.startswith((".", "/", "~")) and not local_parent:
        return path  # a hub id: identity is the id itself
    raise ModelNotFoundError(
        f"model.path {path!r}: no StableDiffusion3Pipeline directory there (and not a hub id like "
        "stabilityai/stable-diffusion-3.5-medium); build the shipped model with `stepgrpo pretrain`"
    )


@lru_cache(maxsize=16)
def model_identity(path: str) -> str:
    """A digest naming the model's exact weights: file contents (size + mtime above HASH_LIMIT).

    Computed once per run and recorded in its manifest (`stepgrpo.runs.open_run`); cache keys read
    it from there, never from the model files."""
    resolved = resolve_model_path(path)
    root = Path(resolved)
    if not root.is_dir():
        return f"hub:{resolved}"
    h = hashlib.sha256()
    for f in sorted(q for q in root.rglob("*") if q.is_file()):
        st = f.stat()
        h.update(f"{f.relative_to(root).as_posix()}:{st.st_size}".encode())
        if st.st_size <= HASH_LIMIT:
            h.update(hashlib.sha256(f.read_bytes()).digest())
        else:
            h.update(str(st.st_mtime_ns).encode())
    return h.hexdigest()


def policy_identity(model: ModelConfig) -> str:
    """The fingerprint of what the policy starts from: the model's (`model_identity`), with the
    contents of `model.init_lora` when it starts from a LoRA."""
    identity = model_identity(model.path)
    if model.init_lora is None:
        return identity
    from stepgrpo.policy.lora import find_lora_file

    return identity + "+init_lora:" + hashlib.sha256(find_lora_file(model.init_lora).read_bytes()).hexdigest()


def policy_key(model: ModelConfig, seed: int) -> str:
    """`<decoder key>:<digest>`: policies of one model share their decoder's key as a prefix."""
    return _decoder_key(model) + ":" + digest_of({"model": model.model_dump(mode="json"), "seed": seed})


_policies: dict[str, tuple[Any, dict[str, torch.Tensor]]] = {}


def policy(cfg: Config) -> Policy:
    """The policy of `cfg.model` (`SD3Policy` or `FluxPolicy`, by its pipeline) with a LoRA adapter
    (built once per process).

    The adapter's initial weights depend only on `run.seed` (peft draws them from the global RNG,
    seeded here and restored after).
    """
    key = policy_key(cfg.model, cfg.run.seed)
    with _lock:
        if key not in _policies:
            from diffusers.utils import logging as diffusers_logging
            from transformers.utils import logging as transformers_logging

            from stepgrpo.policy import policy_class
            from stepgrpo.policy.lora import LoraSpec

            diffusers_logging.disable_progress_bar()  # the pipeline's loading bars, per component
            transformers_logging.disable_progress_bar()  # the text encoders' "Loading weights" bars, per load

            m = cfg.model
            full = m.finetune == "full"
            lora = None if full else LoraSpec(rank=m.lora_rank, alpha=m.lora_alpha, targets=tuple(m.lora_targets))
            state = torch.random.get_rng_state()
            torch.manual_seed(cfg.run.seed)
            source = resolve_model_path(m.path)
            try:
                pol = policy_class(source).from_pretrained(
                    source,
                    dtype=m.dtype,
                    device=m.device,
                    guidance_scale=m.guidance_scale,
                    lora=lora,
                    max_batch=m.max_batch,
                    resolution=m.resolution,
                    full=full,
                    gradient_checkpointing=m.gradient_checkpointing,
                )
            finally:
                torch.random.set_rng_state(state)
            if m.init_lora is not None:
                pol.load_lora(m.init_lora)  # the run's starting adapter, in place of the fresh one
            _policies[key] = (pol, lora_state(pol))
            LOADS["policy"] += 1
        return _policies[key][0]


def trained_group(cfg: Config) -> str:
    """The checkpoint's tensor group of the trained weights: `lora`, or `transformer` (full fine-tuning)."""
    return "transformer" if cfg.model.finetune == "full" else "lora"


def initial_lora(cfg: Config) -> dict[str, torch.Tensor]:
    """The trained weights before any update (a copy): the adapter's (fresh, or `model.init_lora`),
    or every transformer weight with full fine-tuning."""
    policy(cfg)
    return {k: v.clone() for k, v in _policies[policy_key(cfg.model, cfg.run.seed)][1].items()}


def initial_weights(cfg: Config) -> dict[str, torch.Tensor]:
    """`initial_lora`'s weights themselves, not a copy: for reading only (a sharded update's rank
    holds its shards of them, `keep_initial_shards`)."""
    policy(cfg)
    return dict(_policies[policy_key(cfg.model, cfg.run.seed)][1])


def keep_initial_shards(cfg: Config, cut: Any) -> None:
    """A sharded update's rank keeps only its shards of the initial trained weights (`cut`: whole
    tensors to this rank's shards), as it keeps only its shards of the weights."""
    with _lock:
        key = policy_key(cfg.model, cfg.run.seed)
        pol, initial = _policies[key]
        _policies[key] = (pol, cut(initial))


def lora_state(pol: Policy) -> dict[str, torch.Tensor]:
    """Trainable weights (the LoRA's, or all with full fine-tuning) by parameter name, detached copies
    (of a sharded update's policy: this rank's shards, `stepgrpo.loops.sharding`)."""
    return {n: local_shard(p).detach().clone() for n, p in pol.transformer.named_parameters() if p.requires_grad}


def set_lora(pol: Policy, weights: dict[str, torch.Tensor]) -> None:
    """Copy `weights` (from `lora_state`, or whole tensors from a checkpoint) into the policy's adapter."""
    params = {n: p for n, p in pol.transformer.named_parameters() if p.requires_grad}
    if set(params) != set(weights):
        missing = sorted(set(params) - set(weights))[:3]
        raise ValueError(
            f"LoRA weights do not match the policy's adapter (missing e.g. {missing}); rank or targets differ"
        )
    with torch.no_grad():
        for n, p in params.items():
            copy_into(p, weights[n])


_decoders: dict[str, Any] = {}


def decoder(model: ModelConfig) -> ImageDecoder:
    """The `ImageDecoder` of `model`: the loaded policy's VAE if there is one in this process,
    else the VAE alone (scoring stored latents never needs the transformer or text encoders)."""
    with _lock:
        for key, (pol, _) in _policies.items():
            if key.startswith(_decoder_key(model) + ":"):
                return pol.decoder
        key = _decoder_key(model)
        if key not in _decoders:
            from stepgrpo.policy.base import ImageDecoder

            _decoders[key] = ImageDecoder.from_pretrained(
                resolve_model_path(model.path), dtype=model.dtype, device=model.device, max_batch=model.max_batch
            )
            LOADS["decoder"] += 1
        return _decoders[key]


def _decoder_key(model: ModelConfig) -> str:
    return digest_of({k: getattr(model, k) for k in ("path", "dtype", "device", "max_batch")})


_rewards: dict[str, Any] = {}


def reward(cfg: RewardConfig) -> Any:
    """The built reward of `cfg` (once per process); it must carry the identity its registry entry
    declares (`reward_identity`), since stored rows and cache keys are named by that."""
    key = json.dumps(cfg.model_dump(mode="json"), sort_keys=True)
    with _lock:
        if key not in _rewards:
            from stepgrpo.rewards import build_reward

            built = build_reward({"name": cfg.name, "options": dict(cfg.options)})
            declared = reward_identity(cfg)
            if (str(built.name), str(built.version)) != (declared["name"], declared["declared_version"]):
                raise ValueError(
                    f"reward {cfg.name!r} declares the identity {declared['name']} v{declared['declared_version']} "
                    f"but builds {built.name} v{built.version}; make its registered identity compute the factory's "
                    "name and version"
                )
            _rewards[key] = built
            LOADS["reward"] += 1
        return _rewards[key]


def reward_identity(cfg: RewardConfig) -> dict[str, Any]:
    """`{"name", "version", "declared_version", "options"}`: what identifies a reward's numbers, from
    the registry entry's declared identity (no model is loaded). `version` names its stored rows: the
    declared version, and with options given, a digest of them (`1+3fa2c1d0`), so rows scored with
    other options are never read back as these (a plug-in's identity rarely shows its options)."""
    from stepgrpo.rewards import reward_identity as identity
    from stepgrpo.storage.publish import options_digest

    name, version = identity({"name": cfg.name, "options": dict(cfg.options)})
    options = dict(cfg.options)
    stored = f"{version}+{options_digest(options)[:8]}" if options else str(version)
    return {"name": str(name), "version": stored, "declared_version": str(version), "options": options}


# ------------------------------------------------------------------ a run's policy


def companion_group(cfg: Config) -> str | None:
    """The checkpoint group of the update objective's second adapter (`old`: DiffusionNFT's
    sampling policy, DGPO's clipping anchor; `kl_ema`: AWM's KL target), None when it keeps none."""
    return cfg.update.resolved["companion"]


def companion_samples(cfg: Config, optimizer_step: int) -> bool:
    """Whether the companion adapter, rather than the trained one, samples the rollouts once the
    run has taken `optimizer_step` optimizer steps (`OBJECTIVES` fact `samples_with_companion`:
    always, never, or after the step it names, as DGPO's `switch_ema_ref`)."""
    when = cfg.update.resolved["samples_with_companion"]
    if isinstance(when, bool):
        return when
    return optimizer_step > int(when)


def optimizer_step(tensors: dict[str, torch.Tensor]) -> int:
    """The optimizer steps a checkpoint's AdamW state has taken (its `step`; 0 without one)."""
    steps = [int(v) for k, v in tensors.items() if k.endswith(".step")]
    return max(steps, default=0)


def lora_before(run: Run, cfg: Config, iteration: int) -> dict[str, torch.Tensor]:
    """The LoRA weights that sample iteration `iteration`: the trained adapter after the previous
    update, or the objective's companion adapter when it is the one that samples (DiffusionNFT's
    old policy; DGPO's after its switch)."""
    if iteration == 0:
        return initial_lora(cfg)
    prev = run.checkpoints.load_checkpoint(iteration - 1)
    group = trained_group(cfg)
    if companion_group(cfg) and companion_samples(cfg, optimizer_step(prev.tensors.get("optimizer", {}))):
        group = str(companion_group(cfg))
    return prev.tensors[group]


def policy_at(run: Run, cfg: Config, iteration: int) -> Policy:
    """The policy with the weights it has when `iteration` of `run` starts."""
    pol = policy(cfg)
    set_lora(pol, lora_before(run, cfg, iteration))
    return pol


def policy_after(run: Run, cfg: Config, iteration: int | None) -> Policy:
    """The policy a user gets after `iteration` (its EMA when enabled; None: the base model)."""
    pol = policy(cfg)
    if iteration is None:
        set_lora(pol, initial_lora(cfg))
    else:
        ckpt = run.checkpoints.load_checkpoint(iteration)
        set_lora(pol, ckpt.tensors.get("ema", ckpt.tensors[trained_group(cfg)]))
    return pol


def set_threads(threads: int | None = None) -> None:
    """torch's CPU threads: `threads` (the config's `scale.threads`), else `STEPGRPO_THREADS` when set."""
    from stepgrpo.runtime import environment

    environment.apply(threads)
