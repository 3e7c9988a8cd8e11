"""MLflow tracking: an experiment per config name, a run per flow run.

The default store is SQLite inside the run directory (`sqlite:///<run_dir>/mlflow.db`, artifacts
in `<run_dir>/mlflow-artifacts/`), so a run directory carries its own history; set
`MLFLOW_TRACKING_URI` to log to a shared server or database instead.

Only the flows log (from the small summaries their tasks return), so a cached stage still
reports its numbers in the new flow run's MLflow run.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from PIL import Image

PARAM_BATCH = 100  # MLflow accepts at most 100 params per log_batch call
PARAM_MAX_CHARS = 6000  # MLflow's limit on a param value


def tracking_uri(run_dir: str | Path) -> str:
    """`MLFLOW_TRACKING_URI` if set, else the SQLite store inside the run directory."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(run_dir).resolve() / 'mlflow.db'}"


STORE_FILE = "mlflow.db"


def ensure_local_store(run_dir: Path) -> None:
    """Make the run's SQLite store whole before anything logs to it: a new store is created and
    migrated under a temporary name, then renamed into place (a process killed meanwhile leaves no
    half-migrated `mlflow.db`); an existing store that cannot be read is kept aside and recreated."""
    store = run_dir / STORE_FILE
    if store.is_file():
        if _readable(store):
            return
        aside = store.with_name(f"{STORE_FILE}.damaged-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
        os.rename(store, aside)
        print(
            f"warning: {store} could not be read (an interrupted creation?); kept aside as {aside.name}, "
            "starting a new one"
        )
    tmp = run_dir / f".{STORE_FILE}.{os.getpid()}.creating"
    tmp.unlink(missing_ok=True)
    _migrate(tmp)
    os.replace(tmp, store)


def _migrate(path: Path) -> None:
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    s = SqlAlchemyStore(f"sqlite:///{path}", (path.parent / "mlflow-artifacts").as_uri())
    s.engine.dispose()


def _readable(path: Path) -> bool:
    """Whether `path` is a whole MLflow store of this MLflow's schema: read with `sqlite3` itself,
    so that no MLflow engine is left attached to a file that may be renamed away."""
    import sqlite3

    from mlflow.store.db.utils import _get_latest_schema_revision

    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
            (version,) = db.execute("SELECT version_num FROM alembic_version").fetchone()
            db.execute("SELECT count(*) FROM experiments").fetchone()
    except (sqlite3.Error, TypeError):
        return False
    return version == _get_latest_schema_revision()


class Tracker:
    """One MLflow run. `Tracker.start(...)` opens it; use as a context manager to end it.

    The run's status is FINISHED when the `with` block exits normally, FAILED otherwise.
    """

    def __init__(self, client: Any, run_id: str, uri: str) -> None:
        self.client = client
        self.run_id = run_id
        self.uri = uri

    @classmethod
    def start(
        cls, run_dir: str | Path, experiment: str, run_name: str, tags: Mapping[str, str] | None = None
    ) -> Tracker:
        from mlflow.tracking import MlflowClient

        uri = tracking_uri(run_dir)
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            ensure_local_store(Path(run_dir))
        client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            # Only the default, run-local store gets a run-local artifact root; a server decides its own.
            local = (
                None
                if os.environ.get("MLFLOW_TRACKING_URI")
                else (Path(run_dir).resolve() / "mlflow-artifacts").as_uri()
            )
            exp_id = client.create_experiment(experiment, artifact_location=local)
        else:
            exp_id = exp.experiment_id
        run = client.create_run(exp_id, run_name=run_name, tags=dict(tags or {}))
        return cls(client, run.info.run_id, uri)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if exc_type is None else "FAILED")

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:PARAM_MAX_CHARS]) for k, v in sorted(params.items())]
        for i in range(0, len(items), PARAM_BATCH):
            self.client.log_batch(self.run_id, params=items[i : i + PARAM_BATCH])

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Finite scalar metrics at `step` (the iteration); NaN / None entries are skipped."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [
            Metric(k, float(v), now, step)
            for k, v in sorted(metrics.items())
            if v is not None and isinstance(v, int | float) and math.isfinite(float(v))
        ]
        if rows:
            self.client.log_batch(self.run_id, metrics=rows)

    def log_image(self, image: Image.Image, artifact_file: str) -> None:
        self.client.log_image(self.run_id, image, artifact_file=artifact_file)

    def log_artifact(self, local_file: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(local_file), artifact_path)

    def log_dir(self, local_dir: str | Path, artifact_path: str) -> None:
        self.client.log_artifacts(self.run_id, str(local_dir), artifact_path)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        for k, v in tags.items():
            self.client.set_tag(self.run_id, k, str(v))


def flatten_metrics(prefix: str, values: Mapping[str, Any]) -> dict[str, float]:
    """`{"a": 1, "b": [x, y]}` -> `{"prefix/a": 1, "prefix/b/0": x, "prefix/b/1": y}` (lists per step)."""
    out: dict[str, float] = {}
    for k, v in values.items():
        key = f"{prefix}/{k}" if prefix else k
        if isinstance(v, Mapping):
            out.update(flatten_metrics(key, v))
        elif isinstance(v, list | tuple):
            out.update({f"{key}/{i}": x for i, x in enumerate(v) if isinstance(x, int | float)})
        elif isinstance(v, int | float) and not isinstance(v, bool):
            out[key] = v
    return out
