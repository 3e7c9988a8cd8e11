"""Device and dtype names from config strings, shared by the policy and the reward models."""

from __future__ import annotations

import torch

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_device(device: str | torch.device | None) -> torch.device:
    """`None` -> CUDA when available, else CPU; strings and devices pass through."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """`None` -> fp32 on CPU (half precision matmuls are slow or missing there), bf16 on GPU."""
    if dtype is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}") from None


def check_device(device: str, field: str = "model.device") -> None:
    """A clear error for a device this torch cannot use (a CPU-only build asked for `cuda`, a GPU
    index past the last one, a misspelt name), instead of an assertion deep inside torch."""
    try:
        d = torch.device(device)
    except RuntimeError:
        raise ValueError(f"{field} {device!r} is not a torch device; use cpu, cuda, cuda:N or mps") from None
    if d.type == "cuda":
        if not torch.cuda.is_available():
            build = (
                "a CPU-only build"
                if torch.version.cuda is None
                else f"CUDA {torch.version.cuda}, but no GPU is visible"
            )
            raise ValueError(
                f"{field} {device!r}: the installed torch {torch.__version__} cannot use CUDA ({build}); "
                "install a CUDA build of torch (docs/GPU.md) or set model.device=cpu"
            )
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise ValueError(
                f"{field} {device!r}: this machine has {torch.cuda.device_count()} GPU(s), cuda:0 to "
                f"cuda:{torch.cuda.device_count() - 1}"
            )
    elif d.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{field} {device!r}: MPS is not available to this torch; set model.device=cpu")
    elif d.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"{field} {device!r}: stepgrpo runs on cpu, cuda or mps")
