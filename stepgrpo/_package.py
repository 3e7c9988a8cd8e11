"""What importing `stepgrpo` sets up before any of its code runs: its version, the process settings
a CPU kernel's bytes depend on, a log filter, and, in a checkout that is not installed, the import
names of the repository's top-level packages.

The repository keeps `flows/`, `tasks/` and `storage/` at its top level; installed, they are
`stepgrpo.flows`, `stepgrpo.tasks` and `stepgrpo.storage` (`pyproject.toml`'s package-dir mapping;
an editable install maps them the same way), so that a user's own `flows` package stays theirs.
A checkout run as it is (`PYTHONPATH=.`, the GPU benchmark's way) gets the same names from
`CheckoutPackages`, which answers only where nothing installed did.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import os
import sys
from importlib.machinery import ModuleSpec
from pathlib import Path

VERSION = "0.1.0"
MAPPED = ("flows", "tasks", "storage")  # top-level folders of the repository, `stepgrpo.<name>` when imported

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


class CheckoutPackages(importlib.abc.MetaPathFinder):
    """`stepgrpo.flows` -> `<checkout>/flows` (and tasks, storage), for a checkout on `sys.path`
    that is not installed. Placed last on `sys.meta_path`: an install's own mapping comes first."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> ModuleSpec | None:
        parent, _, name = fullname.partition(".")
        if parent != "stepgrpo" or name not in MAPPED:
            return None
        folder = self.root / name
        return importlib.util.spec_from_file_location(
            fullname, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )


def _checkout_root() -> Path | None:
    """The repository, where this file sits in one (rather than in site-packages)."""
    root = Path(__file__).resolve().parents[1]
    if (root / "pyproject.toml").is_file() and all((root / name / "__init__.py").is_file() for name in MAPPED):
        return root
    return None


_root = _checkout_root()
if _root is not None and not any(isinstance(f, CheckoutPackages) for f in sys.meta_path):
    sys.meta_path.append(CheckoutPackages(_root))
