"""Atomic publish, lock files and digests: the crash-safety primitives every writer uses.

A stage is written into a temporary sibling directory (`.<name>.partial`) and becomes visible by
one `os.rename` onto its final name, after a small `_published.json` manifest has been written
inside it. A directory under its final name is therefore always complete; a crash leaves only
the `.partial` directory, which the next writer (holding the lock) deletes before starting over.

Locks are files created with `O_CREAT | O_EXCL` semantics (a fully written temporary file is
hard-linked onto the lock name, so a lock file is never seen half-written). They hold the owner's
pid, host and a random token. A lock whose pid is dead on this host is stale and is removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stepgrpo.storage.errors import CorruptChunkError, StageLockedError, StorageError
from stepgrpo.storage.schema import PUBLISHED_FILE

LOCK_POLL_S = 0.05  # how often a waiting writer retries a held lock


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no whitespace, so equal content gives equal bytes (and digests)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=True)


def options_digest(options: Mapping[str, Any]) -> str:
    """Digest of a scheme's (or any component's) options: 16 hex chars of sha256 of canonical JSON."""
    return hashlib.sha256(canonical_json(dict(options)).encode()).hexdigest()[:16]


def check_json(obj: Any, where: str) -> None:
    """Raise a ValueError naming `where` if `obj` is not plain JSON (data, never code)."""
    try:
        json.dumps(obj, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"{where} must be plain JSON (dicts, lists, str, int, finite float, bool, None): {err}. "
            "Convert tensors to lists and paths to str before storing."
        ) from None


SEAL_KEY = "seal"  # a stored JSON record's own digest: a flipped byte anywhere in it is noticed


def seal(record: Mapping[str, Any]) -> dict[str, Any]:
    """`record` with its digest under `SEAL_KEY` (sha256 of its canonical JSON without the seal)."""
    body = {k: v for k, v in record.items() if k != SEAL_KEY}
    return {**body, SEAL_KEY: hashlib.sha256(canonical_json(body).encode()).hexdigest()}


def check_seal(record: Mapping[str, Any], path: Path) -> None:
    """A `CorruptChunkError` naming `path` if `record` carries a seal its content does not match
    (records written before seals existed carry none)."""
    if SEAL_KEY in record and seal(record)[SEAL_KEY] != record[SEAL_KEY]:
        raise CorruptChunkError(f"{path} does not match its seal (damaged or edited)")


def read_json(path: Path, what: str = "record") -> Any:
    """A stored JSON file, or a `CorruptChunkError` that names it when it does not parse (bad bytes,
    nesting deeper than the parser allows, integers longer than Python converts); `FileNotFoundError`
    when it is not there. A sealed record (`seal`) is checked."""
    try:
        data = json.loads(Path(path).read_bytes())
    except FileNotFoundError:
        raise
    except (ValueError, RecursionError, UnicodeDecodeError) as err:
        raise CorruptChunkError(
            f"{path} is not JSON that can be read ({type(err).__name__}: {str(err)[:120]}): the {what} is damaged"
        ) from None
    if isinstance(data, dict):
        check_seal(data, path)
    return data


def utc_now() -> str:
    """Current UTC time, ISO 8601."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# --- locks ------------------------------------------------------------------------------------


def _pid_alive(pid: int) -> bool:
    """True if `pid` is a live (non-zombie) process on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed child that was not reaped yet still answers kill(0): read its state
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return True


def read_lock(lock: Path) -> dict[str, Any] | None:
    """The lock's owner record, or None if there is no lock."""
    try:
        return json.loads(lock.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # unreadable: treated as held, never silently broken


def _is_stale(owner: Mapping[str, Any]) -> bool:
    return owner.get("host") == socket.gethostname() and not _pid_alive(int(owner.get("pid", -1)))


def acquire_lock(lock: Path, what: str, wait_s: float = 0.0) -> str:
    """Take `lock` for this process and return its token.

    A stale lock (dead pid on this host) is removed. A live one raises `StageLockedError` naming
    the owner, after waiting up to `wait_s` seconds.
    """
    token = secrets.token_hex(8)
    record = {"pid": os.getpid(), "host": socket.gethostname(), "token": token, "since": utc_now()}
    tmp = lock.with_name(f"{lock.name}.{token}.tmp")
    try:
        tmp.write_text(canonical_json(record))
    except BaseException:  # a full disk: no empty lock record is left
        tmp.unlink(missing_ok=True)
        raise
    deadline = time.monotonic() + wait_s
    try:
        while True:
            try:
                os.link(tmp, lock)  # atomic create-if-absent of a complete file
                return token
            except FileExistsError:
                pass
            owner = read_lock(lock)
            if owner is None:
                continue
            if owner and _is_stale(owner):
                # Remove only if it is still the same stale record (another cleaner may have won).
                if read_lock(lock) == owner:
                    lock.unlink(missing_ok=True)
                continue
            if time.monotonic() >= deadline:
                raise StageLockedError(
                    f"{what} is being written by another writer (lock {lock.name}: pid "
                    f"{owner.get('pid')} on {owner.get('host')} since {owner.get('since')}). "
                    "Wait for it to finish; if that process is gone on another host, delete the lock file."
                )
            time.sleep(LOCK_POLL_S)
    finally:
        tmp.unlink(missing_ok=True)


def check_token(lock: Path, token: str, what: str) -> None:
    """Raise `StageLockedError` unless `token` is the current holder of `lock`."""
    owner = read_lock(lock)
    if not owner or owner.get("token") != token:
        raise StageLockedError(
            f"{what}: this writer's token does not hold the lock {lock.name} (it was released or "
            "taken over as stale). Begin the stage again."
        )


def release_lock(lock: Path, token: str) -> None:
    """Release `lock` if `token` holds it."""
    owner = read_lock(lock)
    if owner and owner.get("token") == token:
        lock.unlink(missing_ok=True)


# --- publish ----------------------------------------------------------------------------------


def partial_path(final: Path) -> Path:
    """The temporary sibling a stage is written into before publish."""
    return final.with_name(f".{final.name}.partial")


def lock_path(final: Path) -> Path:
    """The lock file of the stage published at `final`."""
    return final.with_name(f".{final.name}.lock")


def fresh_partial(final: Path) -> Path:
    """Delete a crashed attempt's leftovers and return an empty `.partial` directory (lock held)."""
    tmp = partial_path(final)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_dir(tmp: Path, final: Path, manifest: Mapping[str, Any]) -> None:
    """Write `_published.json` into `tmp`, then rename `tmp` to `final` (the atomic step)."""
    check_json(dict(manifest), "a stage manifest")
    (tmp / PUBLISHED_FILE).write_text(json.dumps(seal(manifest), indent=1, sort_keys=True) + "\n")
    _fsync_path(tmp / PUBLISHED_FILE)
    os.rename(tmp, final)  # fails if final exists: stages are never replaced
    _fsync_path(final.parent)


def read_published(final: Path) -> dict[str, Any] | None:
    """The manifest of the stage published at `final`, or None if it is not published."""
    try:
        manifest = read_json(final / PUBLISHED_FILE, "stage manifest")
    except FileNotFoundError:
        return None
    if not isinstance(manifest, dict):
        raise CorruptChunkError(f"{final / PUBLISHED_FILE} is not a stage manifest: the stage's manifest is damaged")
    manifest.pop(SEAL_KEY, None)  # checked by read_json
    return manifest


def no_links(root: Path, path: Path) -> Path:
    """`path` if it lies under `root` and no part of it below `root` is a symbolic link, so that a
    write there stays inside `root` (a run directory someone sent may hold links to anywhere);
    else a `StorageError` naming the link."""
    root, path = Path(root), Path(path)
    try:
        parts = path.relative_to(root).parts
    except ValueError:
        raise StorageError(f"{path} is not inside {root}: stepgrpo writes a run's files inside it only") from None
    node = root
    for part in parts:
        node = node / part
        if part == ".." or node.is_symlink():
            raise StorageError(
                f"{node} is a symbolic link (or '..') inside the run directory {root}: stepgrpo writes nothing through "
                "it, since the write would land outside the run; replace it with a real directory or file"
            )
        if not node.exists():
            break
    return path


def write_file_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary sibling and a rename."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:  # a full disk (ENOSPC), a kill: no empty or partial temporary file is left
        tmp.unlink(missing_ok=True)
        raise
