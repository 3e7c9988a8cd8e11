"""The MLflow run of an offline command (`rescore`, `credit`, `evaluate`), written by a helper
process that starts with the command.

Most of what logging costs such a command is importing MLflow and its SQLite store (~2 s on a
small CPU, all imports, against ~0.3 s of credit itself). `helper(run)` starts a process
that pays it, and finds the training run's MLflow run, on another core while the command imports
Prefect and torch and computes; `log` then hands it the record and waits for it to be written, so
the command still ends with its MLflow run in the store, or fails with the helper's error. Without
a helper (a flow called directly), `log` writes in this process.

    python -m stepgrpo.reporting.offline RUN_DIR RUN_ID    # the helper: the record on stdin, as JSON
"""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stepgrpo.errors import StageError

# the helper of this command (its run directory and process), until `log` takes it or the command ends
_ACTIVE: list[tuple[str, subprocess.Popen[str]]] = []


@contextlib.contextmanager
def helper(run: str | Path) -> Iterator[None]:
    """Within the block, `log` for the run `run` names (a directory or a run id, as the command
    was given it) goes through a helper process started now. Nested, it does nothing (the CLI
    starts it before the API call does); a run that does not open starts none (the command itself
    then says what is wrong). A helper not used is stopped at the end."""
    if _ACTIVE:
        yield
        return
    from stepgrpo.storage.run import Run, find_run  # the command imports it next anyway

    try:
        path = find_run(run)
        run_id = Run.open(path).run_id
    except Exception:
        yield
        return
    cmd = [sys.executable, "-m", __name__, str(path), run_id]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _ACTIVE.append((str(path), proc))
    try:
        yield
    finally:
        _ACTIVE.clear()
        if proc.returncode is None:  # not used: it waits on its stdin, holding nothing
            proc.kill()
            proc.communicate()


def _take(run_dir: str | Path) -> subprocess.Popen[str] | None:
    """The active helper if it opened the run at `run_dir`, else None."""
    if not _ACTIVE or _ACTIVE[0][0] != str(Path(run_dir).resolve()):
        return None
    return _ACTIVE.pop()[1]


def log(run_dir: str | Path, run_id: str, record: dict[str, Any]) -> None:
    """Write `record` (`write`'s) as the MLflow run of an offline command on the run at `run_dir`."""
    proc = _take(run_dir)
    if proc is None:
        from stepgrpo.reporting.tracking import find_mlflow_run

        _, parent = find_mlflow_run(run_dir, run_id)
        write(run_dir, parent, record)
        return
    _, err = proc.communicate(json.dumps(record, default=_plain))
    if proc.returncode != 0:
        tail = err.strip().splitlines()[-1] if err.strip() else f"exit status {proc.returncode}"
        raise StageError(f"writing the MLflow run of `{record['kind']}` failed: {tail}")


def _plain(value: Any) -> Any:
    """numpy scalars as Python numbers, anything else JSON lacks as its text."""
    item = getattr(value, "item", None)
    return item() if callable(item) else str(value)


def write(run_dir: str | Path, parent: Any, record: dict[str, Any]) -> None:
    """The MLflow run `record["name"]` in `record["experiment"]`: tagged with its parent (the
    training run, and MLflow's parent link where it has one), `record["metrics"]` of each row logged
    at its iteration, all rows as a table artifact (`<kind>.json`, MLflow's table view). Logging
    again under the same name continues the same MLflow run, adding no duplicate rows."""
    import pandas as pd

    from stepgrpo.reporting.tracking import Tracker

    kind, rows, metrics = record["kind"], record["rows"], record["metrics"]
    tags = dict(record["tags"])
    if parent is not None:
        tags["mlflow.parentRunId"] = parent.info.run_id
    with Tracker.start(run_dir, record["experiment"], record["name"], tags=tags) as tracker:
        if not tracker.resumed:
            tracker.log_params(record["params"])
        # MLflow's log_table appends to a table already logged: only the rows of iterations this
        # MLflow run does not hold yet go in
        before = tracker.logged_steps(f"{kind}/{metrics[0]}")
        for row in rows:
            values = {f"{kind}/{m}": row[m] for m in metrics if isinstance(row.get(m), int | float)}
            tracker.log_metrics({k: float(v) for k, v in values.items() if math.isfinite(v)}, step=row["iteration"])
        flat = [
            {k: v for k, v in r.items() if not isinstance(v, list | dict)} for r in rows if r["iteration"] not in before
        ]
        if flat:
            tracker.client.log_table(tracker.run_id, data=pd.DataFrame(flat), artifact_file=f"{kind}.json")
        for folder in record.get("artifacts") or []:  # an evidence bundle, as it is on disk
            tracker.client.log_artifacts(tracker.run_id, folder, artifact_path=f"evidence/{Path(folder).name}")


def main(run_dir: str, run_id: str) -> int:
    import pandas  # noqa: F401  (imported now, while the command computes)

    from stepgrpo.reporting.tracking import find_mlflow_run

    _, parent = find_mlflow_run(run_dir, run_id)
    text = sys.stdin.read()
    if not text:  # the command ended without logging
        return 0
    write(run_dir, parent, json.loads(text))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
