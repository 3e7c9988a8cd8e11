"""The process settings every entry point applies: the CLI, each flow (so that a run started from
a Prefect deployment runs exactly like the same run from the command line) and the update's
data-parallel workers.

- Telemetry off unless the user set otherwise (`PREFECT_SERVER_ANALYTICS_ENABLED`,
  `MLFLOW_DISABLE_TELEMETRY`).
- torch's CPU threads: the config's `scale.threads`, else `STEPGRPO_THREADS`, else torch's
  default (one per core). On a small CPU a second process (a Prefect worker or server beside the
  flow) makes torch's default threads spin against each other: the shipped shapes configs set 1.
"""

from __future__ import annotations

import os

TELEMETRY_OFF = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
THREADS_ENV = "STEPGRPO_THREADS"


def apply(threads: int | None = None) -> int:
    """Apply the settings above (`threads`: the config's `scale.threads`); returns torch's thread count."""
    import torch

    for key, value in TELEMETRY_OFF.items():
        os.environ.setdefault(key, value)
    n = threads or _env_threads()
    if n and torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return torch.get_num_threads()


def _env_threads() -> int | None:
    raw = os.environ.get(THREADS_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{THREADS_ENV}={raw!r}: expected a positive whole number of torch threads (or unset it)")
    return int(raw)
