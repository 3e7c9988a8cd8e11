"""One owner per run, whatever path reaches it: the lock beside the run (taken before the directory
exists) and the lock inside it (one file through every mount of the directory)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from stepgrpo.config import load_config
from stepgrpo.errors import StageError
from stepgrpo.runs import OWNER_LOCK, owned
from stepgrpo.storage.run import Run

HOLD = textwrap.dedent(
    """
    import sys, time
    from stepgrpo.runs import owned
    with owned(sys.argv[1]):
        print("held", flush=True)
        time.sleep(120)
    """
)


def _run(root):
    cfg = load_config(None, [])
    return Run.create(root, "r", cfg.model_dump(mode="json")).path


def test_a_run_is_owned_once_through_another_path(tmp_path):
    """The same directory under a second mount point: a second owner through it is refused."""
    path = _run(tmp_path / "a")
    other = tmp_path / "b" / "r"
    other.mkdir(parents=True)
    bound = subprocess.run(["mount", "--bind", str(path), str(other)], capture_output=True)
    if bound.returncode != 0:
        pytest.skip("bind mounts need privileges this machine does not give")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert (other / "manifest.json").is_file() and (other / OWNER_LOCK).is_file()  # one directory, two paths
        with pytest.raises(StageError, match="in use through another path"):
            with owned(other):
                pass
    finally:
        holder.kill()
        holder.wait()
        for _ in range(20):
            if subprocess.run(["umount", str(other)], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
    with owned(other):  # its owner is gone: the kernel released both locks
        pass


def test_the_inner_lock_is_released_with_the_outer(tmp_path):
    path = _run(tmp_path)
    with owned(path):
        with owned(path):  # re-entrant within a process
            pass
    with owned(path):
        pass


def test_a_resume_on_another_number_of_update_processes_says_the_bytes_will_differ(tmp_path, capsys):
    from stepgrpo.runs import check_resumable

    path = _run(tmp_path)
    check_resumable(load_config(None, []), path)
    assert "note:" not in capsys.readouterr().out
    check_resumable(load_config(None, ["scale.update_processes=2"]), path)
    note = capsys.readouterr().out
    assert "on 1 process(es), this resume on 2" in note and "differ in their last bits" in note


def test_a_read_only_run_is_refused_before_anything_writes(tmp_path):
    """`rescore` / `evaluate` on a run on a read-only mount: one line naming it, nothing written beside it."""
    from typer.testing import CliRunner

    from stepgrpo_cli import app

    path = _run(tmp_path / "rw")
    view = tmp_path / "ro" / "r"
    view.mkdir(parents=True)
    mounted = subprocess.run(["mount", "--bind", "-o", "ro", str(path), str(view)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("bind mounts need privileges this machine does not give")
    try:
        if subprocess.run(["touch", str(view / "probe")], capture_output=True).returncode == 0:
            pytest.skip("this kernel made the bind mount writable")
        for args in (["evaluate", str(view)], ["rescore", str(view), "--reward", "shapes"]):
            result = CliRunner().invoke(app, args)
            assert result.exit_code == 1 and "is read-only" in result.output and "cp -a" in result.output
        assert not (tmp_path / "ro" / "mlflow.db").exists()
    finally:
        subprocess.run(["umount", str(view)], capture_output=True)
