"""The memory one rank of the update needs for its states, by formula: the table of docs/SCALING.md
("Sharded update") and the check that refuses, before a run starts, a configuration whose states
cannot fit on its GPU.

What a rank holds (`update_states`), in bytes of the trained dtype `b` (AdamW keeps its moments in
the parameter's dtype), with P the transformer's parameters, T the trained ones (P, or the LoRA's)
and S the shards (`scale.update_processes` with `update_sharding: fsdp`, else 1):

    weights        P b / S        the transformer (a LoRA's frozen base is sharded with it)
    gradients      T b / S
    AdamW          2 T b / S      its two moments
    reference      P b / S        full fine-tuning: the frozen KL reference copy (always built)
    EMA            T b / S        with `optim.ema_decay`
    companion      T b / S        the objective's second adapter (DiffusionNFT's / DGPO's old policy, AWM's KL target)
    initial        T b / S        the trained weights before training (the distance travelled)
    signal sums    8 T / S        GRPO with `optim.diagnostics`: the signal check's two running sums, fp32
    signal halves  8 T / S        ... and its two half-gradients, fp32, while the update runs
    snapshots      2 T b / S      the weights at the iteration's and the step's start (its norms), while it runs
    gathered       2 B c          sharded only: the largest block B whole while it runs, and the next one prefetched
    encoders       E b            the text encoders and the VAE, whole on every rank (not sharded, not cast)

where c is the compute dtype (bf16 where FSDP's mixed precision casts fp32 shards on a GPU). With
`scale.update_offload` the sharded terms live in host memory and the GPU holds the gathered blocks
and the encoders. Not counted: activations (they grow with `optim.micro_batch`, the resolution and
CFG; `model.gradient_checkpointing` cuts them), the CUDA context and the allocator's slack. The
formula is a floor: a configuration it refuses cannot fit; one it accepts may still not.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stepgrpo.config import Config

GIB = 1 << 30
TRANSIENT = ("signal halves", "snapshots", "gathered")  # held while the update runs (the peak), freed after it
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class ModelCounts:
    """Parameter counts of a model, as the formula reads them."""

    transformer: int  # P
    block: int  # the largest repeated block's parameters
    lora: int  # the LoRA's parameters at the config's rank and targets
    encoders: int  # text encoders and VAE (0 where unknown)


def transformer_counts(config: dict[str, Any], rank: int, targets: tuple[str, ...]) -> tuple[int, int, int]:
    """(P, largest block, LoRA parameters) of the diffusers transformer `config` (its config.json),
    built on the meta device (no memory, no weights)."""
    import diffusers
    import torch
    from torch import nn

    cls = getattr(diffusers, config["_class_name"])
    kwargs = {k: v for k, v in config.items() if not k.startswith("_")}
    with torch.device("meta"):
        model = cls.from_config(kwargs)
    total = sum(p.numel() for p in model.parameters())
    blocks = [b for c in model.children() if isinstance(c, nn.ModuleList) for b in c]
    block = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0)
    lora = 0
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and any(name == t or name.endswith("." + t) for t in targets):
            lora += rank * (m.in_features + m.out_features)
    return total, block, lora


def safetensors_params(folder: Path) -> int:
    """Parameters stored in a folder's safetensors files, read from their headers alone."""
    total = 0
    for f in sorted(folder.glob("*.safetensors")):
        with f.open("rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
        for key, entry in header.items():
            if key != "__metadata__":
                count = 1
                for d in entry["shape"]:
                    count *= d
                total += count
    return total


def model_counts(root: Path, lora_rank: int, lora_targets: tuple[str, ...]) -> ModelCounts | None:
    """The counts of the pipeline directory `root` (None without a transformer config.json)."""
    tconf = root / "transformer" / "config.json"
    if not tconf.is_file():
        return None
    P, block, lora = transformer_counts(json.loads(tconf.read_text()), lora_rank, lora_targets)
    encoders = sum(safetensors_params(d) for d in sorted(root.iterdir()) if d.is_dir() and d.name != "transformer")
    return ModelCounts(P, block, lora, encoders)


def update_states(
    counts: ModelCounts,
    *,
    dtype: str,
    full: bool,
    shards: int = 1,
    offload: bool = False,
    ema: bool = False,
    companion: bool = False,
    signal: bool = False,
    gpu: bool = True,
) -> dict[str, dict[str, int]]:
    """Bytes per rank, by term (module doc): `{"device": {...}, "host": {...}}`."""
    b = DTYPE_BYTES[dtype]
    c = 2 if gpu and dtype == "float32" and shards > 1 else b  # FSDP's bf16 compute on a GPU
    P, T = counts.transformer, counts.transformer if full else counts.lora
    S = max(1, shards)
    sharded = {
        "weights": P * b // S,
        "gradients": T * b // S,
        "AdamW": 2 * T * b // S,
        "reference": P * b // S if full else 0,
        "EMA": T * b // S if ema else 0,
        "companion": T * b // S if companion else 0,
        "initial": T * b // S,
        "signal sums": 8 * T // S if signal else 0,
        "signal halves": 8 * T // S if signal else 0,
        "snapshots": 2 * T * b // S,
    }
    whole = {"gathered": 2 * counts.block * c if S > 1 else 0, "encoders": counts.encoders * b}
    # `TRANSIENT` terms are held while the update runs, not after it
    if offload:
        return {"device": whole, "host": sharded}
    return {"device": {**sharded, **whole}, "host": {}}


def config_states(cfg: Config, counts: ModelCounts) -> dict[str, dict[str, int]]:
    """`update_states` for `cfg`'s update."""
    from stepgrpo_core.objectives import OBJECTIVES

    s = cfg.scale
    return update_states(
        counts,
        dtype=cfg.model.dtype,
        full=cfg.model.finetune == "full",
        shards=s.update_processes if s.update_sharding == "fsdp" else 1,
        offload=s.update_offload,
        ema=cfg.optim.ema_decay is not None,
        companion=OBJECTIVES.facts(cfg.update.objective)["companion"] is not None,
        signal=cfg.optim.diagnostics and cfg.update.on_transitions,
        gpu=cfg.model.device.startswith("cuda"),
    )


def check_fits(cfg: Config, counts: ModelCounts, capacity: int) -> None:
    """Refuse an update whose states (the formula's floor) exceed `capacity` bytes, the GPU's memory,
    naming the terms and the fixes (`ValueError`)."""
    need = config_states(cfg, counts)["device"]
    total = sum(need.values())
    if total <= capacity:
        return
    terms = ", ".join(f"{k} {v / GIB:.1f}" for k, v in need.items() if v)
    s = cfg.scale
    fixes = []
    if s.update_sharding != "fsdp":
        fixes.append("scale.update_sharding: fsdp with scale.update_processes >= 2")
    else:
        fixes.append(f"more scale.update_processes than {s.update_processes}")
        if not s.update_offload:
            fixes.append("scale.update_offload: true")
    if cfg.model.finetune == "full":
        fixes.append("model.finetune: lora")
    if need.get("signal sums"):
        fixes.append(f"optim.diagnostics: false (its signal check holds {2 * need['signal sums'] / GIB:.1f} GiB)")
    raise ValueError(
        f"the update's states need {total / GIB:.1f} GiB a rank ({terms} GiB; before activations) and the GPU has "
        f"{capacity / GIB:.1f} GiB: set {', or '.join(fixes)} (docs/SCALING.md, 'Sharded update')"
    )


def usage(audit: bool = False) -> dict[str, float]:
    """This process's memory: its peak resident set (MiB), the GPU's peak allocation where there is one,
    and with `audit` the bytes held by every live tensor's storage (each storage once; a sharded
    parameter's by its local shard), what the formula's terms describe (plus the batch's tensors)."""
    import resource
    import sys

    import torch

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    out = {"peak_rss_mib": rss / (1 << 20) if sys.platform == "darwin" else rss / 1024}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["gpu_peak_mib"] = torch.cuda.max_memory_allocated() / (1 << 20)
    if audit:
        out["tensors_mib"] = held_bytes() / (1 << 20)
    return out


def held_bytes() -> int:
    """Bytes of the storages of every tensor alive in this process, each storage once."""
    import gc

    import torch

    storages: dict[tuple[str, int], int] = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):  # type(): no attribute lookup on proxy objects
            continue
        t = obj.to_local() if hasattr(obj, "to_local") else obj
        if t.device.type == "meta":
            continue
        try:
            s = t.untyped_storage()
        except RuntimeError:  # a tensor without storage (e.g. a functional wrapper)
            continue
        storages[(t.device.type, s.data_ptr())] = s.nbytes()
    return sum(storages.values())
