"""Fault injection for the tests and `bench/faults/faults.py`: make one shard fail or die half-way.

`STEPGRPO_FAULT=<raise|kill|hang>:<stage>:<first row>:<marker file>` makes the shard of `<stage>`
that starts at `<first row>` raise (or end its process with `os._exit`, as `kill -9` would, or stop
there until its process is interrupted or killed, as a stuck stage would) after it wrote its first
rows, once: the fault fires only while `<marker file>` does not exist, and creates it (a test waits
for that file to know where the process is). `STEPGRPO_FAULT=@<file>` reads that spec from
`<file>` at every check (no file, or an empty one: no fault), so the workers of a long-lived Ray
cluster, whose environment is fixed when they start, can be given another fault for each run. Unset, this does nothing.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


class InjectedFault(RuntimeError):
    """The failure `STEPGRPO_FAULT` asked for."""


def maybe_fail(stage: str, first_row: int) -> None:
    spec = os.environ.get("STEPGRPO_FAULT", "")
    if spec.startswith("@"):
        try:
            spec = Path(spec[1:]).read_text().strip()
        except FileNotFoundError:
            return
    if not spec:
        return
    mode, at_stage, at_row, marker = spec.split(":", 3)
    if at_stage != stage or int(at_row) != first_row:
        return
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # once
    except FileExistsError:
        return
    os.close(fd)
    if mode == "kill":
        os._exit(137)
    if mode == "hang":
        while True:  # until a signal ends it (Ctrl-C: KeyboardInterrupt in the main thread)
            time.sleep(0.1)
    raise InjectedFault(f"STEPGRPO_FAULT: {stage} shard at row {first_row} fails here ({Path(marker).name})")
