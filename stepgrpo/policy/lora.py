"""LoRA on the SD3 transformer through peft, saved in the format `load_lora_weights` reads.

Defaults are Flow-GRPO's: rank 32, alpha 64, Gaussian init of A (B starts at zero, so a fresh
adapter leaves the model unchanged), on every attention projection of the joint blocks: the image
stream (`to_q`, `to_k`, `to_v`, `to_out.0`) and the text stream (`add_q_proj`, `add_k_proj`,
`add_v_proj`, `to_add_out`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ADAPTER = "default"  # the one adapter name; peft's default
TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")


@dataclass(frozen=True)
class LoraSpec:
    """Shape of the LoRA adapter."""

    rank: int = 32  # r
    alpha: float = 64.0  # the update is scaled by alpha / r
    targets: tuple[str, ...] = TARGETS  # module names (suffixes) in the transformer that get an adapter
    dropout: float = 0.0  # dropout on the adapter's input (Flow-GRPO: none)

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoraSpec.rank must be >= 1, got {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"LoraSpec.alpha must be > 0, got {self.alpha}")
        if not self.targets:
            raise ValueError("LoraSpec.targets is empty; name at least one module, e.g. 'to_q'")

    def config(self):
        """The peft `LoraConfig`."""
        from peft import LoraConfig

        return LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            target_modules=list(self.targets),
            lora_dropout=self.dropout,
            init_lora_weights="gaussian",
        )


def add_lora(transformer: torch.nn.Module, spec: LoraSpec) -> None:
    """Freeze `transformer` and attach a trainable adapter (peft) named `ADAPTER`."""
    transformer.requires_grad_(False)
    try:
        transformer.add_adapter(spec.config(), adapter_name=ADAPTER)
    except ValueError as err:  # peft: "Target modules {...} not found in the base model"
        raise ValueError(f"LoRA targets {spec.targets} do not all match the transformer's modules: {err}") from err


def lora_state_dict(transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's weights, keys as peft names them (`transformer_blocks.0.attn.to_q.lora_A.weight`)."""
    from peft.utils import get_peft_model_state_dict

    return get_peft_model_state_dict(transformer, adapter_name=ADAPTER)


def save_lora(transformer: torch.nn.Module, directory: str | Path, pipeline_cls: Any) -> Path:
    """Write `pytorch_lora_weights.safetensors` to `directory` (created) for `load_lora_weights`.

    The adapter's config (rank, alpha, targets) goes into the file's metadata, so a fresh
    `StableDiffusion3Pipeline.load_lora_weights(directory)` applies the right alpha / r scale. The
    same weights give the same bytes in any process (the config's sets are written sorted), and an
    export that is already there with those bytes is left as it is; another one is replaced
    atomically.
    """
    import shutil
    import tempfile

    if ADAPTER not in getattr(transformer, "peft_config", {}):
        raise ValueError("the policy has no LoRA adapter to save; build it with lora=LoraSpec(...)")
    meta = {
        k: sorted(v) if isinstance(v, set | frozenset) else v
        for k, v in transformer.peft_config[ADAPTER].to_dict().items()
    }
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".lora-", dir=directory))
    try:
        pipeline_cls.save_lora_weights(
            str(tmp), transformer_lora_layers=lora_state_dict(transformer), transformer_lora_adapter_metadata=meta
        )
        readable = _new_file_mode()
        for new in tmp.iterdir():
            old = directory / new.name
            data = canonical_safetensors(new.read_bytes()) if new.suffix == ".safetensors" else new.read_bytes()
            if not (old.is_file() and old.read_bytes() == data):
                new.write_bytes(data)
                os.replace(new, old)
            os.chmod(old, readable)  # the writer's temporary file was private (0600)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def _new_file_mode() -> int:
    """The mode a new file gets here (0666 less the umask; 0644 as a rule), as `save_pretrained`'s
    files have it: the export is readable by whoever may read the run."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def _check_alpha(file: Path, config: object) -> None:
    """A LoRA file that records its adapter config (diffusers' `transformer_lora_adapter_metadata`
    in the safetensors header) must have the policy's rank and alpha."""
    import json

    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        meta = f.metadata() or {}
    raw = meta.get("lora_adapter_metadata") or meta.get("transformer_lora_adapter_metadata")
    if not raw:
        return
    try:
        recorded = json.loads(raw)
    except ValueError:
        return
    if not isinstance(recorded, dict):
        return
    for key, ours in (("r", getattr(config, "r", None)), ("lora_alpha", getattr(config, "lora_alpha", None))):
        theirs = recorded.get(f"transformer.{key}", recorded.get(key))  # diffusers writes them prefixed
        if theirs is not None and ours is not None and float(theirs) != float(ours):
            field = {"r": "model.lora_rank", "lora_alpha": "model.lora_alpha"}[key]
            raise ValueError(f"the LoRA in {file} has {key}={theirs}, the policy {ours}: set {field}: {theirs}")


def canonical_safetensors(data: bytes) -> bytes:
    """The same safetensors file with its JSON header's keys sorted. safetensors writes the
    metadata map in an order that differs between processes; the tensors' offsets are relative to
    the data section, so reordering the header changes no byte of the data."""
    import json
    import struct

    (size,) = struct.unpack("<Q", data[:8])
    header = json.dumps(json.loads(data[8 : 8 + size]), sort_keys=True, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the header is padded with spaces to 8 bytes, as safetensors pads it
    return struct.pack("<Q", len(header)) + header + data[8 + size :]


WEIGHTS_FILE = "pytorch_lora_weights.safetensors"


def find_lora_file(path: str | Path) -> Path:
    """The LoRA file `path` names: a `.safetensors` file; a directory holding `WEIGHTS_FILE` (an
    export); or a run directory (its exported `lora/`). A clear error for anything else."""
    p = Path(path).expanduser()
    for candidate in (p, p / WEIGHTS_FILE, p / "lora" / WEIGHTS_FILE):
        if candidate.is_file() and candidate.suffix == ".safetensors":
            return candidate
    raise FileNotFoundError(
        f"no LoRA at {str(path)!r}: give a .safetensors LoRA file, a directory holding {WEIGHTS_FILE} "
        "(an exported LoRA), or a finished run's directory (its lora/ export)"
    )


def load_lora(transformer: torch.nn.Module, directory: str | Path, pipeline_cls: Any) -> None:
    """Load adapter weights saved by `save_lora` (or any diffusers SD3 LoRA of the same shape) into
    `ADAPTER`; `directory` may also be the `.safetensors` file or a run (`find_lora_file`).

    The transformer must already carry an adapter with the same rank and targets; a file that
    records another alpha is refused (the update would be scaled differently than it was trained).
    """
    from peft.utils import set_peft_model_state_dict

    if ADAPTER not in getattr(transformer, "peft_config", {}):
        raise ValueError("load_lora needs a policy built with lora=LoraSpec(...) matching the saved adapter")
    file = find_lora_file(directory)
    _check_alpha(file, transformer.peft_config[ADAPTER])
    state = pipeline_cls.lora_state_dict(str(file.parent), weight_name=file.name)
    prefix = "transformer."
    state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    if not state:
        raise ValueError(f"{directory} holds no transformer LoRA weights (keys starting with {prefix!r})")
    expected = lora_state_dict(transformer)
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"the LoRA in {directory} does not match this policy's adapter (rank / targets differ): "
            f"missing {missing[:3]}..., unexpected {unexpected[:3]}..."
        )
    for key, value in state.items():
        if value.shape != expected[key].shape:
            raise ValueError(
                f"LoRA weight {key}: saved shape {tuple(value.shape)}, policy {tuple(expected[key].shape)}; rank "
                "differs"
            )
    set_peft_model_state_dict(transformer, state, adapter_name=ADAPTER)
