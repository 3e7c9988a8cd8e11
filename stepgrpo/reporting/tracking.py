"""MLflow tracking: one experiment per store (`stepgrpo`, or `MLFLOW_EXPERIMENT_NAME`), one MLflow
run per stepgrpo run, tagged with what tells runs apart (`comparison_tags`: config, scheme, reward,
completion), so that every run of a runs root overlays in one chart.

The default store is one SQLite file per runs root (`sqlite:///<runs_root>/mlflow.db`, artifacts
in `<runs_root>/mlflow-artifacts/`), so `mlflow ui --backend-store-uri sqlite:///runs/mlflow.db`
compares every run under `runs/`; a run made before this kept its own `<run_dir>/mlflow.db`, and
goes on logging there. Set `MLFLOW_TRACKING_URI` to log to a shared server or database instead.

Resuming a run continues its MLflow run (found by its `stepgrpo.run_id` tag), and a metric step
already logged is not logged twice, so a resumed run's curves have one point per step.

Steps: `step = k` is the policy after k updates. An iteration's metrics are logged at its index
(`iter_k`: the rollout of the policy after k updates, and the update it fed); an evaluation of the
checkpoint `iter_k` at `k + 1` (the base model at 0).

MLflow 3.17's UI opens an experiment in its GenAI view unless the address asks for the training
view (`?workflowType=machine_learning`, which the UI then remembers); `ui_hint` prints that address.
Runs made when the experiment was the config's name stay where they are and resume there.

Only the flows log (from the small summaries their tasks return), so a cached stage still
reports its numbers.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import sqlite3
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from PIL import Image

PARAM_BATCH = 100  # MLflow accepts at most 100 params per log_batch call
PARAM_MAX_CHARS = 6000  # MLflow's limit on a param value


STORE_FILE = "mlflow.db"
RUN_TAG = "stepgrpo.run_id"  # the stepgrpo run an MLflow run belongs to (how a resumed run finds it)
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")  # the experiment's kind: ML training
DEFAULT_EXPERIMENT = "stepgrpo"
CLASSIC_VIEW = "workflowType=machine_learning"  # MLflow 3.17's UI: the training view, not the GenAI one


def experiment_name() -> str:
    """The experiment every run logs to: `MLFLOW_EXPERIMENT_NAME` (MLflow's own variable: a named
    project on a shared server), else `stepgrpo`, one per store, so one per runs root by default."""
    return os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT


def comparison_tags(cfg: Any) -> dict[str, str]:
    """The tags that tell runs of one experiment apart in MLflow's charts and run table (group or
    colour by them); the same values are also among the run's params (`Config.flat`)."""
    window = cfg.sampler.window()  # the SDE window [start, end)
    return {
        "stepgrpo.config": cfg.run.name,
        "stepgrpo.scheme": cfg.credit.scheme,
        "stepgrpo.reward": cfg.reward.name,
        "stepgrpo.completion": cfg.completion.method or "none",
        # the recipe in one value, to group or colour runs by: scheme @ completion, window / steps, lr
        "stepgrpo.recipe": (
            f"{cfg.credit.scheme}@{cfg.completion.method or 'final'} "
            f"W{window[1] - window[0]}/T{cfg.sampler.steps} lr{cfg.optim.lr:g}"
        ),
    }


def ui_hint(uri: str, experiment_id: str | None = None) -> str:
    """How to look at a store: the `mlflow ui` command for a local one, and the address of the
    experiment in the training view."""
    page = f"#/experiments/{experiment_id}?{CLASSIC_VIEW}" if experiment_id else f"#/experiments?{CLASSIC_VIEW}"
    if uri.startswith("sqlite:///"):
        return f"mlflow ui --backend-store-uri {uri}, then http://127.0.0.1:5000/{page}"
    return f"{uri.rstrip('/')}/{page}" if uri.startswith("http") else uri


def store_dir(run_dir: str | Path) -> Path:
    """Where the default store of a run lives: its own directory for a run made with one there,
    else its runs root (the directory that holds it)."""
    run_dir = Path(run_dir).resolve()
    return run_dir if (run_dir / STORE_FILE).is_file() else run_dir.parent


def tracking_uri(run_dir: str | Path) -> str:
    """`MLFLOW_TRACKING_URI` if set, else the SQLite store of the run's runs root (`store_dir`)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{store_dir(run_dir) / STORE_FILE}"


def ensure_local_store(root: Path) -> None:
    """`_ensure_store` under a lock beside the store: the runs of one runs root share it, and two
    starting at once must not both create it (the second rename would drop the first's runs)."""
    from filelock import FileLock

    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f".{STORE_FILE}.lock")):
        _ensure_store(root)


def _ensure_store(root: Path) -> None:
    """Make the SQLite store in `root` whole before anything logs to it: a new store is created and
    migrated under a temporary name, then renamed into place (a process killed meanwhile leaves no
    half-migrated `mlflow.db`); an existing store that cannot be read is kept aside and recreated."""
    store = root / STORE_FILE
    if store.is_file():
        if _readable(store):
            return
        aside = store.with_name(f"{STORE_FILE}.damaged-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
        os.rename(store, aside)
        print(
            f"warning: {store} could not be read (an interrupted creation?); kept aside as {aside.name}, "
            "starting a new one"
        )
    for leftover in root.glob(f".{STORE_FILE}.*.creating*"):  # a creation that was killed or failed
        leftover.unlink(missing_ok=True)
    tmp = root / f".{STORE_FILE}.{os.getpid()}.creating"
    try:
        _migrate(tmp)
        os.replace(tmp, store)
    except BaseException:  # a full disk, an interrupt: nothing half-made is left behind
        for partial in root.glob(f"{tmp.name}*"):  # with SQLite's journal files
            partial.unlink(missing_ok=True)
        raise


def _migrate(path: Path) -> None:
    """A new store at `path`: a copy of this MLflow schema's empty template when there is one (MLflow
    migrates a new SQLite file through every revision, ~4 s of CPU), opened by MLflow, which checks
    its schema and adds the default experiment with this store's artifact root."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    template = _template()
    if template is not None:
        shutil.copyfile(template, path)
    s = SqlAlchemyStore(f"sqlite:///{path}", (path.parent / "mlflow-artifacts").as_uri())
    s.engine.dispose()


def cache_dir() -> Path:
    """stepgrpo's cache of derived files: `STEPGRPO_CACHE_DIR`, else `$XDG_CACHE_HOME/stepgrpo`
    (`~/.cache/stepgrpo`). Nothing in it is trusted without a check: it can be deleted at any time."""
    if os.environ.get("STEPGRPO_CACHE_DIR"):
        return Path(os.environ["STEPGRPO_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "stepgrpo"


def _template() -> Path | None:
    """An empty, fully migrated store of this MLflow's latest schema revision (no experiment in it),
    made once per user and revision; None where the cache cannot be written (the caller migrates)."""
    from filelock import FileLock
    from mlflow.store.db.utils import _get_latest_schema_revision
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    try:
        root = cache_dir()
        root.mkdir(parents=True, exist_ok=True)
        path = root / f"mlflow-store-{_get_latest_schema_revision()}.db"
        with FileLock(str(root / f".{path.name}.lock")):
            if _readable(path, experiments=0):
                return path
            tmp = root / f".{path.name}.{os.getpid()}.creating"
            try:
                s = SqlAlchemyStore(f"sqlite:///{tmp}", (root / "unused-artifacts").as_uri())
                s.engine.dispose()
                with contextlib.closing(sqlite3.connect(tmp)) as db, db:
                    db.execute("DELETE FROM experiments")  # MLflow adds its default one to each copy
                os.replace(tmp, path)
            finally:
                for partial in root.glob(f"{tmp.name}*"):
                    partial.unlink(missing_ok=True)
        return path if _readable(path, experiments=0) else None
    except (OSError, sqlite3.Error):
        return None


def _readable(path: Path, experiments: int | None = None) -> bool:
    """Whether `path` is a whole MLflow store of this MLflow's schema (holding exactly `experiments`
    experiments, when given): read with `sqlite3` itself, so that no MLflow engine is left attached
    to a file that may be renamed away."""
    from mlflow.store.db.utils import _get_latest_schema_revision

    if not path.is_file():
        return False
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            (version,) = db.execute("SELECT version_num FROM alembic_version").fetchone()
            (count,) = db.execute("SELECT count(*) FROM experiments").fetchone()
    except (sqlite3.Error, TypeError):
        return False
    return version == _get_latest_schema_revision() and experiments in (None, count)


class Tracker:
    """The MLflow run of one stepgrpo run. `Tracker.start(...)` opens it (or reopens it when the
    run is resumed); use as a context manager to end it.

    The run's status is FINISHED when the `with` block exits normally, FAILED otherwise.
    """

    def __init__(self, client: Any, run_id: str, uri: str, resumed: bool = False) -> None:
        self.client = client
        self.run_id = run_id
        self.uri = uri
        self.resumed = resumed
        self._logged: dict[str, set[int]] = {}  # metric -> steps already in the store (a resumed run)

    @classmethod
    def start(
        cls, run_dir: str | Path, experiment: str, run_name: str, tags: Mapping[str, str] | None = None
    ) -> Tracker:
        """The MLflow run tagged `stepgrpo.run_id = run_name`, set running again: found in any
        experiment of the store (a run made when the experiment was its config's name resumes
        there); else a new one in `experiment` (with the source and git tags)."""
        from mlflow.tracking import MlflowClient

        uri = tracking_uri(run_dir)
        local = not os.environ.get("MLFLOW_TRACKING_URI")
        if local:
            ensure_local_store(store_dir(run_dir))
        client = MlflowClient(tracking_uri=uri)
        earlier = _find(client, run_name)  # in this experiment, or in the config's (runs made before)
        if earlier is not None:
            client.update_run(earlier.info.run_id, status="RUNNING")
            return cls(client, earlier.info.run_id, uri, resumed=True)
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            # Only the default, local store gets an artifact root beside it; a server decides its own.
            artifacts = (store_dir(run_dir) / "mlflow-artifacts").as_uri() if local else None
            exp_id = client.create_experiment(experiment, artifact_location=artifacts, tags=dict([EXPERIMENT_KIND]))
        else:
            exp_id = exp.experiment_id
            if exp.tags.get(EXPERIMENT_KIND[0]) is None:
                client.set_experiment_tag(exp_id, *EXPERIMENT_KIND)
        run = client.create_run(
            exp_id, run_name=run_name, tags={**source_tags(), **dict(tags or {}), RUN_TAG: run_name}
        )
        return cls(client, run.info.run_id, uri)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.client.set_terminated(self.run_id, "FINISHED")
            return
        try:  # the run failed: its own error is what the user must see (a full disk fails MLflow too)
            self.client.set_terminated(self.run_id, "FAILED")
        except Exception as err:
            print(f"warning: MLflow could not mark run {self.run_id} failed ({type(err).__name__}: {err})")

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:PARAM_MAX_CHARS]) for k, v in sorted(params.items())]
        for i in range(0, len(items), PARAM_BATCH):
            self.client.log_batch(self.run_id, params=items[i : i + PARAM_BATCH])

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Finite scalar metrics at `step`; NaN / None entries are skipped, and so are the steps a
        resumed run logged before (a cached stage reports the same numbers again)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [
            Metric(k, float(v), now, step)
            for k, v in sorted(metrics.items())
            if v is not None
            and isinstance(v, int | float)
            and math.isfinite(float(v))
            and step not in self._steps_of(k)
        ]
        if rows:
            self.client.log_batch(self.run_id, metrics=rows)
            for row in rows:
                self._logged.setdefault(row.key, set()).add(step)

    def logged_steps(self, key: str) -> set[int]:
        """The steps of metric `key` this MLflow run holds (a resumed run's, read once)."""
        return set(self._steps_of(key))

    def _steps_of(self, key: str) -> set[int]:
        if key not in self._logged:
            history = self.client.get_metric_history(self.run_id, key) if self.resumed else []
            self._logged[key] = {m.step for m in history}
        return self._logged[key]

    def log_by_compute(self, key: str, value: float, compute: float, step: int, unit: str = "nfe") -> None:
        """`key` against `compute` (cumulative training NFEs): logged at step = int(compute), so
        MLflow's default x-axis (step) compares runs at equal compute with no chart setting."""
        self.log_metrics({key: value}, step=int(compute))

    def log_image(self, image: Image.Image, key: str, step: int) -> None:
        """An image at `step`: MLflow's image history of `key` (the UI shows it with a step slider);
        a step a resumed run logged before is not logged again."""
        logged = self._logged.get(f"image:{key}")
        if logged is None:
            logged = self._logged[f"image:{key}"] = self._image_steps(key) if self.resumed else set()
        if step not in logged:
            self.client.log_image(self.run_id, image, key=key, step=step)
            logged.add(step)

    def _image_steps(self, key: str) -> set[int]:
        """The steps of the images logged under `key` (MLflow stores them as `images/<key>+step+<k>+...`)."""
        try:
            files = self.client.list_artifacts(self.run_id, "images")
        except OSError:  # no image logged yet
            return set()
        names = (Path(f.path).name for f in files)
        return {int(n.split("+")[2]) for n in names if n.startswith(f"{key}+step+")}

    def log_artifact(self, local_file: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(local_file), artifact_path)

    def log_dir(self, local_dir: str | Path, artifact_path: str) -> None:
        self.client.log_artifacts(self.run_id, str(local_dir), artifact_path)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        for k, v in tags.items():
            self.client.set_tag(self.run_id, k, str(v))

    def set_note(self, text: str) -> None:
        """The run's description (Markdown), shown at the top of its page in the MLflow UI."""
        self.client.set_tag(self.run_id, "mlflow.note.content", text)


def start_tracker(cfg: Any, run_dir: str | Path, run_name: str, tags: Mapping[str, str]) -> Any:
    """The training run's tracker for `cfg.tracking.backend`: MLflow's `Tracker`, or W&B's
    (`stepgrpo.reporting.wandb_tracker`), which take the same calls."""
    if cfg.tracking.backend == "wandb":
        from stepgrpo.reporting.wandb_tracker import WandbTracker

        return WandbTracker.start(run_dir, cfg.tracking.project or experiment_name(), run_name, tags)
    return Tracker.start(run_dir, experiment_name(), run_name, tags)


def find_mlflow_run(run_dir: str | Path, run_id: str | None = None) -> tuple[Any, Any]:
    """`(client, MLflow run)` of the stepgrpo run at `run_dir` (its run id: `run_id`, else the
    directory's name) in its tracking store; run None if it has none."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri(run_dir))
    return client, _find(client, run_id or Path(run_dir).name)


def _find(client: Any, name: str) -> Any:
    """The MLflow run tagged `stepgrpo.run_id = name` in any experiment of the store, else None."""
    ids = [e.experiment_id for e in client.search_experiments()]
    found = client.search_runs(ids, filter_string=f"tags.`{RUN_TAG}` = '{name}'", max_results=1) if ids else []
    return found[0] if found else None


def source_tags() -> dict[str, str]:
    """MLflow's source tags: the command, and the git commit of the code when it is a checkout."""
    import sys

    from stepgrpo.storage.run import code_version

    version = code_version()
    tags = {"mlflow.source.name": " ".join(Path(a).name if i == 0 else a for i, a in enumerate(sys.argv[:3]))}
    tags["mlflow.source.type"] = "LOCAL"
    if version.get("git_commit"):
        tags["mlflow.source.git.commit"] = version["git_commit"]
    if version.get("package"):
        tags["stepgrpo.version"] = version["package"]
    return tags


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
