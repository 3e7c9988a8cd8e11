"""What importing `stepgrpo` sets up before any of its code runs: its version, the process settings
a CPU kernel's bytes depend on, and a log filter.

(The repository's top-level `flows/`, `tasks/` and `storage/` are `stepgrpo.flows`, `stepgrpo.tasks`
and `stepgrpo.storage` through links in this folder: no import hook is needed, installed or not.)
"""

from __future__ import annotations

import logging
import os

VERSION = "0.1.0"

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
