"""A run directory as the pipeline opens it: bound to one config and one model, found by id or path.

`stepgrpo.storage.run.Run` holds the data; this module adds what the pipeline knows: the config a run was
created with (and the diff when another one is asked for), and the model's fingerprint, computed
once when the run is created and recorded in its manifest, so that a cache key never needs the
model files (`stepgrpo.tasks.keys`).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from stepgrpo.config import Config, apply_overrides, validate_config
from stepgrpo.errors import StageError
from stepgrpo.runtime import environment
from stepgrpo.storage.run import Run, find_run
from stepgrpo.storage.schema import NAME_RE, completion_stage

MODEL_FACT = "model_identity"  # manifest fact: `workspace.policy_identity` of the run's model (and init LoRA)

# Locks this process holds, by lock path: (the lock, how many holders in this process).
_held: dict[str, tuple[Any, int]] = {}


def lock_path(run_dir: Path) -> Path:
    """The run's lock, beside it (so it is taken before the run directory exists)."""
    return run_dir.parent / f".{run_dir.name}.lock"


OWNER_LOCK = ".owner.lock"  # inside a run directory: its owner's lock, the same file through any path to it


class _Both:
    """The run's two locks, released together."""

    def __init__(self, outer: Any, inner: Any) -> None:
        self.outer, self.inner = outer, inner

    def release(self) -> None:
        if self.inner is not None:
            self.inner.release()
        self.outer.release()


@contextmanager
def owned(run_dir: str | Path) -> Iterator[Path]:
    """Hold the run's lock for the block: one process owns a run at a time, and a second one is
    refused at once with a message naming the holder. An OS-level lock (`filelock`): the kernel
    releases it when its holder dies, so a killed run is resumed without clean-up. Re-entrant
    within a process (the CLI takes it before the flow starts, the flow takes it again)."""
    from filelock import FileLock, Timeout

    run_dir = Path(run_dir).resolve()
    path = lock_path(run_dir)
    name = str(path)
    if name in _held:
        lock, count = _held[name]
        _held[name] = (lock, count + 1)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(name, timeout=0)
        try:
            lock.acquire()
        except Timeout:
            raise StageError(
                f"run {run_dir.name} is in use: {_holder(path)}; wait for it to finish, or stop it"
            ) from None
        # the same run reached through another path (a second mount of it): its own lock, inside it,
        # is one file whatever the path (the outer one is taken before the run directory exists)
        inner = FileLock(str(run_dir / OWNER_LOCK), timeout=0) if (run_dir / "manifest.json").is_file() else None
        if inner is not None:
            try:
                inner.acquire()
            except Timeout:
                lock.release()
                raise StageError(
                    f"run {run_dir.name} is in use through another path to it (another mount of the same "
                    "directory); wait for it to finish, or stop it"
                ) from None
        lock = _Both(lock, inner)
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": " ".join(sys.argv[:4]),
        }
        Path(name + ".holder").write_text(json.dumps(holder) + "\n")
        _held[name] = (lock, 1)
    try:
        yield run_dir
    finally:
        lock, count = _held[name]
        if count > 1:
            _held[name] = (lock, count - 1)
        else:
            del _held[name]
            Path(name + ".holder").unlink(missing_ok=True)
            lock.release()


def in_use(run_dir: Path) -> bool:
    """Whether a process holds the run's lock now (a listing writes nothing: no lock file, no use)."""
    from filelock import FileLock, Timeout

    path = lock_path(Path(run_dir).resolve())
    if str(path) in _held:
        return True
    if not path.is_file():
        return False
    lock = FileLock(str(path), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        return True
    lock.release()
    return False


def _holder(path: Path) -> str:
    try:
        h = json.loads(Path(str(path) + ".holder").read_text())
        return f"held by pid {h['pid']} on {h['host']} since {h['since']} ({h['command']})"
    except (OSError, ValueError, KeyError):
        return f"another process holds {path.name}"


def resolve_run_dir(cfg: Config, run_dir: str | None = None, run_id: str | None = None) -> Path:
    """`--run-dir` as given; else `<runs_root>/<run_id>`; else a new id `<name>-<UTC time>`.
    A run id is one name: it never leaves `run.runs_root`."""
    if run_dir:
        path = Path(run_dir).resolve()
        _not_a_file(path, "--run-dir", "a run directory (it is made if it does not exist)")
        _not_a_file(path.parent, "--run-dir's parent", "the directory the run directory is made in")
        return path
    _not_a_file(Path(cfg.run.runs_root).resolve(), "run.runs_root", "the directory that holds run directories")
    if not run_id:
        run_id = f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    if not NAME_RE.match(run_id):
        raise StageError(
            f"run id {run_id!r} is not one name (letters, digits, _ . -, not starting with . or -): a run id names "
            f"a directory inside run.runs_root ({cfg.run.runs_root}); give a path with --run-dir instead"
        )
    path = (Path(cfg.run.runs_root) / run_id).resolve()
    _not_a_file(path, f"--run-id {run_id}: run.runs_root's", "a run id whose directory it may make or resume")
    return path


def _not_a_file(path: Path, what: str, wanted: str) -> None:
    """Refuse a path that exists and is not a directory, before anything starts."""
    if path.exists() and not path.is_dir():
        raise StageError(f"{what} {str(path)!r} is a file, not a directory; name {wanted}")


def open_run(cfg: Config, run_dir: str | Path) -> Run:
    """Create the run directory bound to `cfg` and its model, or open it to resume (same config
    and the same model files required)."""
    from stepgrpo.loops import workspace

    run_dir = Path(run_dir)
    identity = workspace.policy_identity(cfg.model)
    try:
        run = Run.create(
            run_dir.parent, run_dir.name, cfg.model_dump(mode="json"), exist_ok=True, facts={MODEL_FACT: identity}
        )
    except ValueError as err:
        if "different config" not in str(err):
            raise
        check_resumable(cfg, run_dir)  # refuses any change but where and how long the stages run
        run = Run.open(run_dir)
    check_length(cfg, run)
    if run.fact(environment.THREADS_FACT) is None:  # the count this run computes with from now on (RELIABILITY.md)
        run.record_fact(environment.THREADS_FACT, str(environment.compute_threads(cfg)))
    recorded = run.fact(MODEL_FACT)
    if recorded is None:
        run.record_fact(MODEL_FACT, identity)  # a run created before models were fingerprinted
    elif recorded != identity:
        raise StageError(
            f"run {run.run_id}: the files of model.path {cfg.model.path!r} changed since the run was created "
            "(their fingerprint differs); restore that model or start a new --run-id"
        )
    return run


def check_resumable(cfg: Config, run_dir: Path) -> None:
    """An existing run directory must hold a run of the same config (checked before anything starts)."""
    if not (run_dir / "manifest.json").exists():
        return
    stored = with_defaults(Run.open(run_dir).config)
    # `scale` says where stages run, retention what is kept afterwards, not what they compute
    changed = [f for f in config_diff(stored, cfg.model_dump(mode="json")) if not resumable_change(f)]
    if changed:
        raise StageError(
            f"run {run_dir.name} was created with another config (changed: {', '.join(changed)}); "
            "resume it with the same config, pick a new --run-id, or use `stepgrpo rescore` / "
            "`stepgrpo credit` to try another reward / scheme on its stored trajectories. A resume may change "
            f"only {', '.join(LENGTH_FIELDS)} (a larger run.iterations extends the run), "
            f"{', '.join(RETENTION_FIELDS)} and scale.*"
        )
    ranks = (stored.get("scale") or {}).get("update_processes", 1)
    if ranks != cfg.scale.update_processes:
        print(
            f"note: run {run_dir.name} trained its updates on {ranks} process(es), this resume on "
            f"{cfg.scale.update_processes}: the sums of the ranks' gradients change order, so its next checkpoints "
            'will differ in their last bits from an uninterrupted run\'s (docs/RELIABILITY.md, "Same bytes")'
        )
    check_length(cfg, Run.open(run_dir))


def resume_point(run: Run, iterations: int) -> tuple[int, int] | None:
    """Where a training run resumes: the iterations finished in a row from 0 (checkpoint
    published) and the stages stored so far (every published stage store and checkpoint); None
    for a run with nothing stored yet."""
    stages = ["rollout", "draw", "checkpoint"]
    stages += run.completion_stages()
    stored = sum(len(run.iterations(stage)) for stage in stages)
    if stored == 0:
        return None
    done = set(run.iterations("checkpoint"))
    finished = next((i for i in range(iterations) if i not in done), iterations)
    return finished, stored


def check_length(cfg: Config, run: Run) -> None:
    """A run is extended by a larger `run.iterations`, never shortened: its export is the weights of
    its last iteration, which a shorter resume would overwrite with an earlier one's."""
    trained = run.iterations("checkpoint")
    gaps = sorted(set(range(max(trained, default=-1) + 1)) - set(trained))
    if gaps and max(trained) >= cfg.run.iterations:  # a checkpoint past a gap: not this run's own sequence
        stray = [i for i in trained if i > gaps[0]]
        raise StageError(
            f"run {run.run_id} holds checkpoints {stray} after the missing iteration {gaps[0]}: they are not this "
            f"run's (a copy or a stray folder); move checkpoints/iter_{stray[0]} and the others aside, then resume "
            "with the same command (`stepgrpo inspect RUN --verify` names what is damaged)"
        )
    if trained and cfg.run.iterations < max(trained) + 1:
        raise StageError(
            f"run.iterations={cfg.run.iterations} is fewer than the {max(trained) + 1} iterations run {run.run_id} "
            "has trained: a run is extended, never shortened (its export is the last iteration's); evaluate an "
            "earlier checkpoint with `stepgrpo evaluate RUN --iteration K`"
        )


def with_defaults(stored: dict[str, Any]) -> dict[str, Any]:
    """A stored config with the defaults of fields added since it was written (a run made before
    a section existed resumes under its defaults, which compute what that run computed)."""
    try:
        return validate_config(stored).model_dump(mode="json")
    except ValueError:  # no longer valid: compared as stored, so the diff names what changed
        return stored


RETENTION_FIELDS = ("storage.keep", "storage.keep_last", "storage.checkpoint_every")
# How long a run goes and how often it is evaluated: no stage's key reads them, so a run resumes with
# them changed (a finished run is extended by a larger `run.iterations`, every stored stage reused).
LENGTH_FIELDS = ("run.iterations", "run.eval_every")


def resumable_change(field: str) -> bool:
    """Whether a run may resume with `field` changed: where stages run (`scale`) or are tracked
    (`tracking`), retention, or its length and evaluation cadence."""
    return field.split(".")[0] in ("scale", "tracking") or field in RETENTION_FIELDS or field in LENGTH_FIELDS


def retention_plan(run: Run, storage: Any) -> list[tuple[int, str]]:
    """What `storage` (a `StorageConfig`) does not keep of the run's finished iterations
    (`stepgrpo.storage.retention.plan`); a checkpoint that was evaluated keeps its weights."""
    from stepgrpo.storage import retention

    evaluated = {int(p.stem.removeprefix("iter_")) for p in run.record_paths(run.EVAL_DIR, "iter_*")}
    return retention.plan(run, storage.keep, storage.keep_last, storage.checkpoint_every, evaluated)


def apply_retention(run: Run, storage: Any, why: str) -> Any:
    """Prune `retention_plan`, recording `why`; returns the `PruneReport`."""
    from stepgrpo.storage import retention

    return retention.prune(run, retention_plan(run, storage), why)


def check_rescorable(run: Run, method: str | None, iterations: Sequence[int]) -> None:
    """A re-score reads each iteration's clean latents (or the images decoded from them): a clear
    error, before anything runs, when retention pruned both."""
    source = completion_stage(method)
    images = run.stages.images_stage(source)
    gone = [
        i
        for i in iterations
        if run.pruned(i, source) and (run.stage_manifest(i, images) is None or run.pruned(i, images))
    ]
    if gone:
        why = run.pruned(gone[0], source)["why"]
        kept = [i for i in iterations if i not in gone]
        raise StageError(
            f"run {run.run_id}: the latents of iteration(s) {gone} were pruned ({why}), so they cannot be re-scored; "
            + (f"iterations that keep them: {kept} (--iteration K)" if kept else "no iteration keeps them")
            + ". `stepgrpo credit` still recomputes advantages from the stored rewards"
        )


def config_diff(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted fields whose values differ between two config dicts (options compared whole)."""
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict) and k != "options":
            out += config_diff(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k}")
    return out


def open_stored(
    run: str | Path, overrides: Sequence[str] = (), replace: Mapping[str, Any] | None = None
) -> tuple[Run, Config]:
    """The run named by `run` (a directory or a run id under runs/) and its stored config, read as
    data (docs/RELIABILITY.md, "A stored config is data too"):

    - `replace`: whole sections this command gives (its reward, its scheme), put in before the
      stored config is validated, so a stored name the command replaces is never resolved;
    - `overrides`: the command's `key=value` settings;
    - `scale` (where and how the stages run) is this command's, never the stored run's: its
      overrides, else the defaults, except `scale.threads`, which defaults to the run's (the bytes
      a computation gives depend on it: docs/RELIABILITY.md);
    - a plug-in reference the stored config names is imported only if this command named it too
      (`stepgrpo_core.registry.allow`): else the error says how to name it.
    """
    path = find_run(run)
    stored = Run.open(path)
    return stored, stored_config(stored, overrides, replace)


def stored_config(run: Run, overrides: Sequence[str] = (), replace: Mapping[str, Any] | None = None) -> Config:
    """`run`'s config as `open_stored` reads it."""
    data = dict(run.config) if isinstance(run.config, Mapping) else {}
    threads = (data.get("scale") or {}).get("threads") if isinstance(data.get("scale"), Mapping) else None
    data = {k: v for k, v in data.items() if k != "scale"} | dict(replace or {})
    data["scale"] = {"threads": threads}
    return validate_config(apply_overrides(data, overrides))


@contextmanager
def owned_stored(
    run: str | Path, overrides: Sequence[str] = (), replace: Mapping[str, Any] | None = None
) -> Iterator[tuple[Run, Config]]:
    """`open_stored` for the block, holding the run's lock (`owned`)."""
    with owned(find_run(run)) as path:
        yield open_stored(path, overrides, replace)


def stored_iterations(run: Run) -> list[int]:
    """Iterations of the run whose rollout is published."""
    found = run.iterations("rollout")
    if not found:
        raise StageError(f"run {run.run_id} has no published rollout yet")
    return found


def latest_checkpoint(run: Run) -> int:
    latest = run.checkpoints.latest_checkpoint()
    if latest is None:
        raise StageError(f"run {run.run_id} has no checkpoint yet; evaluate the base model with --iteration -1")
    return latest
