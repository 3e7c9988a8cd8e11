"""Ranks forked from a warm process (`stepgrpo.runtime.warm`, `RankPool(preload=...)`): each runs
what `python -m module args` runs, in the launcher's present environment and directory, with its
stdin, log and answer pipe; its exit status and its log reach the pool as a process's would; the
warm process is kept for later pools, replaced when the environment changes, and not used where
it could not fork safely."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from stepgrpo.errors import StageError
from stepgrpo.runtime import parallel, warm

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not warm.available(), reason="forks ranks on Linux only")]

PROBE = textwrap.dedent(
    """
    import json, os, sys
    from stepgrpo.runtime import parallel

    parallel.die_with_parent()
    answers = parallel.answer_pipe()
    for line in sys.stdin:
        command = json.loads(line)
        if "exit" in command:
            print("leaving with", command["exit"], flush=True)
            if command.get("hard"):
                os._exit(command["exit"])
            sys.exit(command["exit"])
        if command.get("raise"):
            raise RuntimeError("the probe's own error")
        seen = {"rank": os.environ["RANK"], "world": os.environ["WORLD_SIZE"], "ppid": os.getppid()}
        seen |= {"cwd": os.getcwd(), "argv": sys.argv[1:], "name": __name__, "said": command.get("say")}
        seen |= {"probe": os.environ.get("STEPGRPO_PROBE"), "path0": sys.path[0]}
        answers.write(json.dumps(seen) + "\\n")
        answers.flush()
    """
)


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """A directory holding the module `probe_rank` (`PROBE`), the working directory of the test."""
    (tmp_path / "probe_rank.py").write_text(PROBE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(warm, "_kept", None)  # this test's own warm processes
    yield tmp_path
    if warm._kept is not None:
        warm._kept.close()


def pool(preload=("json",), n=2) -> parallel.RankPool:
    return parallel.RankPool(lambda d: [sys.executable, "-m", "probe_rank", "an-arg"], n, "the probe", "", preload)


def test_a_forked_rank_runs_what_python_dash_m_runs_in_the_launchers_present_environment(probe, monkeypatch):
    plain = pool(preload=())
    try:
        expected = plain.run({"say": "hi"})
    finally:
        plain.close()
    assert [a["ppid"] for a in expected] == [os.getpid()] * 2
    monkeypatch.setenv("STEPGRPO_PROBE", "before")
    first = pool()
    try:
        monkeypatch.setenv("STEPGRPO_PROBE", "after")  # read by the ranks forked after this
        seen = first.run({"say": "hi"})
    finally:
        first.close()
    kept = warm._kept
    assert kept is not None and kept.alive
    ppid = seen[0]["ppid"]
    assert ppid != os.getpid() and [a["ppid"] for a in seen] == [ppid] * 2  # forked by the warm process
    strip = lambda answers: [{k: v for k, v in a.items() if k not in ("ppid", "probe")} for a in answers]  # noqa: E731
    assert strip(seen) == strip(expected)  # rank, world, cwd, argv, __main__, sys.path[0], stdin
    assert expected[0]["name"] == "__main__" and expected[0]["argv"] == ["an-arg"] and expected[0]["cwd"] == str(probe)
    assert [a["probe"] for a in seen] == ["before"] * 2  # the environment when the pool started them

    monkeypatch.setenv("STEPGRPO_PROBE", "later")  # stepgrpo's own: read when used, not at import
    second = pool()  # the same warm process: nothing the ranks' start-up depends on changed
    try:
        assert [(a["ppid"], a["probe"]) for a in second.run({})] == [(ppid, "later")] * 2
    finally:
        second.close()
    monkeypatch.setenv("PROBE_LIBRARY_SETTING", "1")  # what a library might read at import: a new one
    third = pool()
    try:
        assert {a["ppid"] for a in third.run({})} != {ppid}
    finally:
        third.close()
    assert not kept.alive  # the one it replaced has ended


@pytest.mark.parametrize(
    "command, status, said",
    [
        ({"exit": 3}, "exit 3", "leaving with 3"),
        ({"exit": 137, "hard": True}, "exit 137", "leaving with 137"),
        ({"raise": True}, "exit 1", "RuntimeError: the probe's own error"),
    ],
    ids=["sys.exit", "os._exit", "an exception"],
)
def test_a_forked_rank_that_ends_fails_the_pool_with_its_status_and_its_log(probe, command, status, said):
    ranks = pool()
    try:
        with pytest.raises(StageError, match="the probe over 2 processes failed") as failed:
            ranks.run(command)
        assert f"{status}):" in str(failed.value) and said in str(failed.value)
        assert ranks.broken and all(p.poll() is not None for p in ranks.procs)
    finally:
        ranks.close(wait=False)


def test_a_warm_process_that_cannot_fork_safely_leaves_the_ranks_to_new_processes(probe):
    """Importing a module that starts a thread: a fork would copy the thread's locks, not the thread."""
    (probe / "starts_a_thread.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    )
    ranks = pool(preload=("starts_a_thread",))
    try:
        assert [a["ppid"] for a in ranks.run({})] == [os.getpid()] * 2
    finally:
        ranks.close()
    assert warm._kept is not None and "threads" in json.dumps(warm._kept.refused)
