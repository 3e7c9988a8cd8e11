"""Where the repository is, and the model it ships (relative paths resolve against it too)."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SHIPPED_MODEL = "models/shapes"  # relative to REPO_ROOT: the default `model.path`
SHIPPED_CONFIGS = REPO_ROOT / "configs"  # the recipes, found by name (`stepgrpo train --config shapes_outcome`)
