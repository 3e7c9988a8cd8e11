"""Where the code is, and where the model and recipes it ships are (relative paths resolve against them too).

In a checkout both are the repository: `models/shapes`, `configs/*.yaml`. An installed wheel
holds the same files in `stepgrpo/shipped/` (`pyproject.toml`), where `SHIPPED_ROOT` then points.
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]  # what holds the packages: a checkout, or site-packages
SHIPPED_MODEL = "models/shapes"  # relative to SHIPPED_ROOT: the default `model.path`


def _shipped_root() -> Path:
    if (REPO_ROOT / SHIPPED_MODEL / "model_index.json").is_file():
        return REPO_ROOT  # a checkout (or an editable install of one)
    return Path(__file__).resolve().parent / "shipped"


SHIPPED_ROOT = _shipped_root()
SHIPPED_CONFIGS = SHIPPED_ROOT / "configs"  # the recipes, found by name (`stepgrpo train --config shapes_outcome`)
