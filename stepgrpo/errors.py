"""The pipeline's error: a stage cannot run on its inputs."""

from __future__ import annotations


class StageError(RuntimeError):
    """A stage cannot run on its inputs (NaN rewards, a missing upstream stage, a key mismatch, a
    bad prompt file); the message names the problem and what to do."""
