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

import math
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stepgrpo.config import Config
    from stepgrpo.storage.run import Run

TELEMETRY_OFF = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
THREADS_ENV = "STEPGRPO_THREADS"
THREADS_FACT = "compute_threads"  # manifest fact: torch's CPU threads every computation of the run uses


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


def compute_threads(cfg: Config) -> int:
    """The torch thread count a new run records: `scale.threads`; unset, a Ray shard's CPUs
    (`scale.cpus_per_shard`, rounded up) for a run on Ray workers, else `STEPGRPO_THREADS` or
    torch's default (applied in this process too)."""
    if cfg.scale.threads is None and cfg.scale.workers == "ray":
        return apply(max(1, math.ceil(cfg.scale.cpus_per_shard)))
    return apply(cfg.scale.threads)


def pin_threads(run: Run) -> int | None:
    """Compute with the torch thread count `run` recorded (`THREADS_FACT`), in whatever process
    (the flow's, a Ray worker, an update rank): a CPU kernel's last bits can depend on the thread
    count, and a recomputed stage must give the bytes its downstream stages were keyed on. Returns
    the count, None for a run that has none recorded (left as it is)."""
    raw = run.fact(THREADS_FACT)
    if raw is None or not str(raw).isdecimal() or not 1 <= int(raw) <= 1024:
        return None
    return apply(int(raw))


def end_at_exit() -> list[int]:
    """Make this process end as soon as the exit handlers registered after this call (Prefect's log
    flush, a temporary server's stop) and `logging`'s flush have run, with the status put in the
    returned cell (`cell[0] = 0`; 1 until set, as after an uncaught exception).

    The interpreter's own teardown after that, freeing the modules of torch, diffusers, Prefect and
    the rest one by one, takes 1-2 s of CPU on a small machine and does nothing a finished process
    needs: every file it wrote is closed by the code that wrote it, and nothing is published at
    exit. The console script and the update's rank processes end this way."""
    import atexit
    import sys

    status = [1]

    def end_now() -> None:
        import logging

        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe or stream
                pass
        os._exit(status[0])

    atexit.register(end_now)  # registered before the process's own handlers: it runs after them
    return status
