"""Storage: crashes, corruption, locks and concurrent writers, with real child processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from stepgrpo.storage import CorruptChunkError, Run, StageLockedError
from stepgrpo.storage.publish import lock_path, partial_path

REPO = Path(__file__).resolve().parents[1]

# Shared by the test and its child processes: the deterministic content of trajectory b.
HELPERS = """
import numpy as np
B, T, LATENT = 8, 4, (4, 16, 16)

def traj(b):
    rng = np.random.default_rng(b)
    return {
        "states": rng.standard_normal((1, T + 1, *LATENT)).astype(np.float16),
        "log_probs": rng.standard_normal((1, T)).astype(np.float32),
        "stds": rng.random((1, T)).astype(np.float32),
        "ode_final": rng.standard_normal((1, *LATENT)).astype(np.float16),
        "velocities": rng.standard_normal((1, T, *LATENT)).astype(np.float16),
    }

def begin(run):
    return run.stages.begin_rollout(
        0, sigmas=np.linspace(1, 0, T + 1), seeds=np.arange(B), prompt_ids=np.arange(B) // 2,
        group_ids=np.arange(B) // 2, latent_shape=LATENT, latent_dtype="float16", kernel="sde",
        kernel_params={"eta": 1.0},
    )
"""
ns: dict = {}
exec(HELPERS, ns)
B, traj, begin = ns["B"], ns["traj"], ns["begin"]


def child(code: str, *args: str) -> subprocess.Popen:
    """Start `python -c HELPERS + code args...` with the repository importable."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-c", HELPERS + code, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def expected(b: int) -> dict:
    return {k: v[0] for k, v in traj(b).items()}


def check_rollout(run: Run) -> None:
    data = run.stages.read_rollout(0)
    for b in range(B):
        for name, value in expected(b).items():
            assert getattr(data, name)[b].tobytes() == value.tobytes(), (name, b)


CRASHING_WRITER = """
import sys, time
from stepgrpo.storage import Run
run = Run.open(sys.argv[1])
w = begin(run)
for b in range(B):
    w.write(b, **traj(b))
    print(b, flush=True)
    if b == 3:
        time.sleep(60)  # killed here, mid-stage
"""


def test_killed_writer_leaves_nothing_published_and_a_rerun_completes(tmp_path):
    run = Run.create(tmp_path, "r", {})
    proc = child(CRASHING_WRITER, str(run.path))
    for line in proc.stdout:
        if line.strip() == "3":
            break
    else:
        pytest.fail(f"writer died early: {proc.stderr.read()}")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    final = run.stage_path(0, "rollout")
    assert run.stage_manifest(0, "rollout") is None and not final.exists()
    assert partial_path(final).exists()  # the leftovers of the crashed attempt
    assert json.loads(lock_path(final).read_text())["pid"] == proc.pid  # stale: its pid is dead
    # the next attempt cleans the stale lock and the leftovers, and redoes the stage
    with begin(run) as w:
        assert not any(w.path.glob("states/c.*"))
        for b in range(B):
            w.write(b, **traj(b))
        w.publish()
    assert not partial_path(final).exists() and not lock_path(final).exists()
    check_rollout(run)


def test_crash_between_manifest_and_rename_is_not_published(tmp_path, monkeypatch):
    run = Run.create(tmp_path, "r", {})
    w = begin(run)
    for b in range(B):
        w.write(b, **traj(b))

    def crash(*_):
        raise KeyboardInterrupt("killed just before the rename")

    monkeypatch.setattr(os, "rename", crash)
    with pytest.raises(KeyboardInterrupt):
        w.publish()
    monkeypatch.undo()
    assert (w.path / "_published.json").exists() and run.stage_manifest(0, "rollout") is None
    release = lock_path(run.stage_path(0, "rollout"))
    release.unlink()  # the crashed process's lock (this test process is alive, so it is not stale)
    with begin(run) as w2:
        for b in range(B):
            w2.write(b, **traj(b))
        w2.publish()
    check_rollout(run)


ATTACHED_WRITER = """
import sys, time
from stepgrpo.storage import Run
run = Run.open(sys.argv[1])
w = run.attach(0, "rollout", sys.argv[2])
for b in range(int(sys.argv[3]), int(sys.argv[4])):
    w.write(b, **traj(b))
    time.sleep(0.01)  # interleave with the other writer
print("done", flush=True)
"""


def test_two_processes_write_disjoint_trajectories_of_one_stage(tmp_path):
    run = Run.create(tmp_path, "r", {})
    with begin(run) as w:
        procs = [child(ATTACHED_WRITER, str(run.path), w.token, str(lo), str(lo + B // 2)) for lo in (0, B // 2)]
        for p in procs:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0 and "done" in out, err
        manifest = w.publish()
    assert manifest["counts"]["trajectories"] == B
    check_rollout(run)


SECOND_WRITER = """
import sys
from stepgrpo.storage import Run, StageLockedError
run = Run.open(sys.argv[1])
try:
    begin(run)
except StageLockedError as err:
    print("refused:", err, flush=True)
"""


def test_second_writer_on_the_same_stage_is_refused(tmp_path):
    run = Run.create(tmp_path, "r", {})
    with begin(run) as w:
        out, err = child(SECOND_WRITER, str(run.path)).communicate(timeout=60)
        assert out.startswith("refused:"), err
        assert f"pid {os.getpid()}" in out and "being written by another writer" in out
        with pytest.raises(StageLockedError):  # also within one process
            begin(run)
        with pytest.raises(StageLockedError, match="does not hold the lock"):
            run.attach(0, "rollout", "not-the-token")
        w.abort()
    with begin(run) as w:  # released: the stage can be begun again
        w.abort()


@pytest.fixture
def published(tmp_path) -> Run:
    run = Run.create(tmp_path, "r", {})
    with begin(run) as w:
        for b in range(B):
            w.write(b, **traj(b))
        w.publish()
    return run


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_flipped_byte_in_a_chunk_is_detected_naming_array_and_chunk(published):
    store = published.stage_path(0, "rollout")
    flip_byte(store / "states" / "c.2.0.0.0.0", 1000)
    with pytest.raises(
        CorruptChunkError, match=r"rollout\.zarr/states chunk \(2, 0, 0, 0, 0\) \(trajectory 2\) failed its crc32c"
    ):
        published.stages.read_rollout(0)
    # the other trajectories are still readable
    assert published.stages.read_rollout(0, [0, 1, 3]).states[2].tobytes() == expected(3)["states"].tobytes()
    flip_byte(store / "log_probs" / "c.5.0", 0)
    with pytest.raises(CorruptChunkError, match=r"log_probs chunk \(5, 0\) \(trajectory 5\)"):
        published.stages.read_array(0, "rollout", "log_probs", [5])
    flip_byte(store / "sigmas" / "c.0", 2)
    with pytest.raises(CorruptChunkError, match=r"sigmas chunk \(0,\) failed"):
        published.stages.read_array(0, "rollout", "sigmas")


def test_truncated_or_missing_chunk_is_detected(published):
    store = published.stage_path(0, "rollout")
    chunk = store / "states" / "c.6.0.0.0.0"
    chunk.write_bytes(chunk.read_bytes()[:100])
    with pytest.raises(CorruptChunkError, match=r"states chunk \(6, 0, 0, 0, 0\) \(trajectory 6\) has the wrong size"):
        published.stages.read_array(0, "rollout", "states", [6])
    chunk.unlink()
    with pytest.raises(CorruptChunkError, match=r"\(trajectory 6\) is missing"):
        published.stages.read_array(0, "rollout", "states", [6])


def _begin_resumable(run, key, kernel="sde"):
    import numpy as np

    T, latent = 4, (4, 16, 16)
    return run.stages.begin_rollout(
        0,
        sigmas=np.linspace(1, 0, T + 1),
        seeds=np.arange(B),
        prompt_ids=np.arange(B) // 2,
        group_ids=np.arange(B) // 2,
        latent_shape=latent,
        latent_dtype="float16",
        kernel=kernel,
        kernel_params={"eta": 1.0},
        resume=key,
    )


def test_a_resumable_stage_keeps_its_finished_shards_only_under_the_same_key(tmp_path):
    from stepgrpo.storage.ledger import finished, record

    run = Run.create(tmp_path, "r", {})
    with pytest.raises(RuntimeError):
        with _begin_resumable(run, "key-a") as w:
            for b in range(4):
                w.write(b, **traj(b))
            record(w.ledger, range(0, 4), "key-a", {"nfe": 1})
            w.write(4, **traj(4))  # half of the second shard, then a failure
            raise RuntimeError("a shard failed")
    partial = partial_path(run.stage_path(0, "rollout"))
    assert partial.exists() and not lock_path(run.stage_path(0, "rollout")).exists()  # kept, unlocked
    with _begin_resumable(run, "key-a") as w:  # the same key: resumed with its record and rows
        assert w.resumed and finished(w.ledger, range(0, 4), "key-a") == {"nfe": 1}
        assert w.store().rows_intact(range(0, 4)) and not w.store().rows_intact(range(4, 8))
    with _begin_resumable(run, "key-b") as w:  # another key: started over
        assert not w.resumed and finished(w.ledger, range(0, 4), "key-b") is None
        assert not w.store().rows_intact(range(0, 4))
    with _begin_resumable(run, "key-b", kernel="other") as w:  # same key, other attributes: started over
        assert not w.resumed and w.store().attrs["kernel"] == "other"
        for b in range(B):
            w.write(b, **traj(b))
        w.publish()
    assert not partial.exists() and not (run.stage_path(0, "rollout") / "_shards").exists()
    run.verify(0, "rollout")


def test_a_full_disk_leaves_no_temporary_file(tmp_path, monkeypatch):
    """ENOSPC in the middle of a write: the error surfaces, and no empty or partial `.tmp` file stays."""
    import errno
    from pathlib import Path

    import pyarrow as pa
    import pyarrow.parquet as pq

    from stepgrpo.storage import tables
    from stepgrpo.storage.publish import write_file_atomic

    def full(self, data):  # creates the file, then the disk is full
        self.open("wb").close()
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full)
    with pytest.raises(OSError, match="No space left"):
        write_file_atomic(tmp_path / "record.json", b"{}")
    monkeypatch.undo()

    def full_table(table, where, **kwargs):
        Path(where).write_bytes(b"PAR1")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pq, "write_table", full_table)
    with pytest.raises(OSError, match="No space left"):
        tables.write_once(tmp_path / "once.parquet", pa.table({"x": [1]}), "a table")
    assert [p.name for p in tmp_path.iterdir()] == []
