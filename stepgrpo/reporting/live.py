"""The live view of a training run on an interactive terminal: one progress bar over iterations.

The bar shows the iterations done, the last iteration's seconds, the time left (the mean of the
last few iterations' seconds times the iterations left, so that stages reused on a resume do not
make it look short), the last training reward and the last held-out reward. While it shows, the
console lines of Prefect's flow and task runs are folded away (they stay in the Prefect UI, and on
the console with `stepgrpo train --verbose` or `STEPGRPO_VERBOSE=1`), and so are the per-iteration
lines the flow logs. Anywhere else (a pipe, a log file, a notebook, a deployment's worker) there is
no bar and every line is logged as before.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import deque
from typing import Any

RECENT = 5  # iterations the time left is estimated from
VERBOSE_ENV = "STEPGRPO_VERBOSE"
PROGRESS_ENV = "STEPGRPO_PROGRESS"


def interactive() -> bool:
    """Whether to show a live bar: an interactive terminal, not turned off (`STEPGRPO_PROGRESS=0`)."""
    return sys.stderr.isatty() and os.environ.get(PROGRESS_ENV, "1") != "0"


class TrainingView:
    """The bar of one training flow (a no-op where `interactive()` is false)."""

    def __init__(self, run_id: str, total: int) -> None:
        self.run_id, self.total = run_id, total
        self.live = interactive()
        self.fold = self.live and os.environ.get(VERBOSE_ENV, "0") != "1"
        self.recent: deque[float] = deque(maxlen=RECENT)
        self.last = time.monotonic()
        self.fields = {"reward": "-", "heldout": "-", "seconds": "-", "left": "-"}
        self.completed = 0  # iterations done, shown; a resumed run's reused iterations do not move it back
        self._folded: list[tuple[logging.Handler, int]] = []

    def __enter__(self) -> TrainingView:
        if not self.live:
            return self
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn(
                "left {task.fields[left]} | {task.fields[seconds]} s/it | reward {task.fields[reward]} | "
                "held-out {task.fields[heldout]}"
            ),
            console=Console(stderr=True),
        )
        self.task = self.progress.add_task(self.run_id, total=self.total, **self.fields)
        if self.fold:
            self._folded = [(h, h.level) for h in _console_handlers()]
            for handler, _ in self._folded:
                handler.setLevel(max(handler.level, logging.WARNING))
                handler.addFilter(_INTERRUPTED)
        self.progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.live:
            return
        self.progress.stop()
        interrupted = exc and exc[0] is not None and not issubclass(exc[0], Exception)  # Ctrl-C, SystemExit
        for handler, level in self._folded:
            handler.setLevel(level)
            if not interrupted:  # else the flow's own crash line, logged after this, is folded too
                handler.removeFilter(_INTERRUPTED)

    def say(self, text: str) -> None:
        """A line for the log and the console: printed (the flow logs prints), and above the bar
        when the flow's own lines are folded away."""
        print(text)
        if self.fold:
            self.progress.console.print(text, highlight=False, soft_wrap=True)

    def started(self, done: int) -> None:
        """Training starts (or resumes) with `done` iterations already finished."""
        self.last = time.monotonic()
        self.completed = done
        if self.live:
            self.progress.update(self.task, completed=done)

    def iteration(self, i: int, reward: float | None) -> None:
        """Iteration `i` is done, with training reward `reward`. On a resume the reused iterations
        come first: they show their reward, not a time, and the bar does not move back."""
        now = time.monotonic()
        reused = i < self.completed
        if not reused:
            self.recent.append(now - self.last)
            self.completed = i + 1
        self.last = now
        if not self.live:
            return
        if reused or not self.recent:
            self.fields["reward"] = _num(reward)
            self.progress.update(self.task, **self.fields)
            return
        mean = sum(self.recent) / len(self.recent)
        left = (self.total - i - 1) * mean
        self.fields |= {
            "reward": _num(reward),
            "seconds": f"{self.recent[-1]:.1f}",
            "left": f"{int(left // 60)}:{int(left % 60):02d}",
        }
        self.progress.update(self.task, completed=self.completed, **self.fields)

    def evaluated(self, reward: float) -> None:
        """A held-out evaluation gave `reward` (its time is not an iteration's)."""
        self.last = time.monotonic()
        if self.live:
            self.fields["heldout"] = _num(reward)
            self.progress.update(self.task, **self.fields)


class _Interrupted(logging.Filter):
    """Prefect's "Crash detected! ... aborted by an interrupt signal" lines of a Ctrl-C: the command
    says itself that it was interrupted, and how to resume."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "aborted by an interrupt signal" not in record.getMessage()


_INTERRUPTED = _Interrupted()


def _num(x: float | None) -> str:
    return "-" if x is None or x != x else f"{x:.4f}"


def _console_handlers() -> list[logging.Handler]:
    """Prefect's console handlers (where its flow and task run lines reach the terminal)."""
    from prefect.logging.handlers import PrefectConsoleHandler

    loggers = [logging.getLogger()] + [
        logger for logger in logging.Logger.manager.loggerDict.values() if isinstance(logger, logging.Logger)
    ]
    found: list[logging.Handler] = []
    for logger in loggers:
        found += [h for h in logger.handlers if isinstance(h, PrefectConsoleHandler) and h not in found]
    return found
