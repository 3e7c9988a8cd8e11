"""stepgrpo: GRPO for flow-matching text-to-image models with step-level credit assignment."""

import logging
import os

# MKL may otherwise use fewer threads than asked when it judges so, and a CPU kernel's last bits
# depend on its thread count: set before MKL first runs (docs/RELIABILITY.md, "Same bytes").
os.environ.setdefault("MKL_DYNAMIC", "FALSE")


class _NoTorchvisionFallbackNotice(logging.Filter):
    """transformers announces, once per class, that an image processor falls back to its PIL
    version without torchvision. stepgrpo wants that version (torchvision is not a dependency;
    images reach the rewards as tensors or PIL), so the notice is noise in every run's console.
    Only that notice is dropped; anything else the logger says still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "requires torchvision (not installed)" not in record.getMessage()


logging.getLogger("transformers.utils.import_utils").addFilter(_NoTorchvisionFallbackNotice())

__version__ = "0.1.0"

# The Python entry (`stepgrpo.train(...)`, docs in `stepgrpo_cli.api`). Those functions run flows,
# so they live above them, beside the CLI; the names resolve on first use, so importing `stepgrpo`
# (as every flow and task does) imports no flow.
ENTRY = ("train", "rescore", "credit", "evaluate", "credit_quality", "calibrate", "open_run", "TrainResult")


def __getattr__(name: str) -> object:
    if name in ENTRY:
        from importlib import import_module

        return getattr(import_module("stepgrpo_cli.api"), name)
    raise AttributeError(f"module 'stepgrpo' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *ENTRY])
