"""A run directory is data: opening, inspecting, resuming, re-scoring or re-crediting a run someone
sent imports no module it names, connects nowhere it names, writes nowhere its links point, and
allocates nothing its metadata sizes beyond the run's config (docs/RELIABILITY.md, "A stored config is data
too"). Each attack is built here, in a temporary directory; none starts a flow."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import prefect  # noqa: F401  (Prefect binds its log handlers at import: not inside CliRunner's streams)
import pytest
from typer.testing import CliRunner

from stepgrpo.storage.publish import seal
from stepgrpo_cli import app
from stepgrpo_core.registry import PLUGINS_ENV, PluginError, allow, allowed

runner = CliRunner()


@pytest.fixture(autouse=True)
def _plugins_as_they_were(monkeypatch):
    """What a test allows (`STEPGRPO_PLUGINS`) is forgotten after it."""
    monkeypatch.setenv(PLUGINS_ENV, os.environ.get(PLUGINS_ENV, ""))


@pytest.fixture
def evil(tmp_path, monkeypatch):
    """A module on sys.path that leaves a marker file when it is imported, and the marker's path."""
    marker = tmp_path / "imported"
    pkg = tmp_path / "site"
    pkg.mkdir()
    (pkg / "evil_mod.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\nx = 1\n")
    monkeypatch.syspath_prepend(str(pkg))
    sys.modules.pop("evil_mod", None)
    return marker


def make_run(root: Path, **sections) -> Path:
    """A run directory with its manifest only; `sections` replace parts of the default config."""
    from stepgrpo.config import load_config
    from stepgrpo.storage.run import Run

    cfg = load_config(None, ["run.runs_root=runs"]).model_dump(mode="json")
    run = Run.create(root, "r", cfg).path
    manifest = json.loads((run / "manifest.json").read_text())
    for name, value in sections.items():
        manifest["config"][name] = {**manifest["config"][name], **value}
    (run / "manifest.json").write_text(json.dumps(seal(manifest)))  # a crafted run seals what it edits
    return run


ATTACKS = {
    "reward": {"reward": {"name": "evil_mod:x", "options": {}}},
    "scheme": {"credit": {"scheme": "evil_mod:x", "options": {}}},
    "weighted part": {"reward": {"name": "weighted", "options": {"parts": "shapes:1,evil_mod:x:0.5"}}},
}
COMMANDS = {
    "inspect": lambda r: ["inspect", str(r)],
    "inspect --verify": lambda r: ["inspect", str(r), "--verify"],
    "credit": lambda r: ["credit", str(r), "--scheme", "outcome"],
    "rescore": lambda r: ["rescore", str(r), "--reward", "jpeg_compressibility"],
    "evaluate": lambda r: ["evaluate", str(r)],
    "prune": lambda r: ["prune", str(r), "--dry-run"],
    "train --run-dir": lambda r: ["train", "--run-dir", str(r), "--set", "run.runs_root=runs"],
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_stored_plugin_reference_is_never_imported(tmp_path, monkeypatch, evil, attack, command):
    monkeypatch.chdir(tmp_path)
    run = make_run(tmp_path / "runs", **ATTACKS[attack])
    result = runner.invoke(app, COMMANDS[command](run))
    assert not evil.exists(), (command, result.output)  # the module never ran
    assert "evil_mod" not in sys.modules
    assert "Starting temporary server" not in result.output, result.output  # all said before any server
    if command == "inspect":  # inspect still shows the run
        assert result.exit_code == 0, result.output
    elif command in ("rescore", "credit", "evaluate", "train --run-dir"):  # refused, or no data yet
        assert result.exit_code == 1, result.output


@pytest.mark.parametrize("module", ["venv.__main__", "flask.__main__", "tqdm.__main__", "this"])
def test_main_modules_and_programs_named_by_a_manifest_do_not_run(tmp_path, monkeypatch, module):
    """`venv.__main__` made a virtual environment, `flask.__main__` ran an `app.py` of the run's
    directory, `tqdm.__main__` waited on stdin, `this` prints: none is imported."""
    run = make_run(tmp_path / "runs", reward={"name": f"{module}:x", "options": {}})
    (run / "app.py").write_text(f"open({str(tmp_path / 'app-ran')!r}, 'w').write('ran')\n")
    monkeypatch.chdir(run)
    before = set(sys.modules)
    result = runner.invoke(app, ["inspect", "."], input="")
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "app-ran").exists() and not (run / "x").exists()
    assert not any(m.endswith("__main__") or m == "this" for m in set(sys.modules) - before)


def test_main_modules_are_refused_even_when_the_user_names_them():
    with pytest.raises(PluginError, match="__main__"):
        allow("venv.__main__:x")
    assert "venv.__main__:x" not in allowed()


def test_a_reference_the_user_names_is_imported_and_its_mark_read_without_running_it(tmp_path, monkeypatch):
    """The user's own reference loads; an object whose attribute access runs code is refused by its
    (missing) mark without that code running."""
    from stepgrpo.rewards import REWARDS

    pkg = tmp_path / "site"
    pkg.mkdir()
    (pkg / "tricky_mod.py").write_text(
        textwrap.dedent(
            f"""
            class Meta(type):
                def __getattr__(cls, name):
                    open({str(tmp_path / "getattr-ran")!r}, "w").write(name)
                    raise AttributeError(name)
            class Tricky(metaclass=Meta):
                pass
            """
        )
    )
    monkeypatch.syspath_prepend(str(pkg))
    with pytest.raises(PluginError, match="not given"):
        REWARDS.get("tricky_mod:Tricky")  # not named by the user: not even imported
    assert "tricky_mod" not in sys.modules
    allow("tricky_mod:Tricky")
    with pytest.raises(PluginError, match="not a stepgrpo reward"):
        REWARDS.get("tricky_mod:Tricky")
    assert not (tmp_path / "getattr-ran").exists()


def test_a_config_file_and_overrides_allow_the_references_they_name(tmp_path):
    from stepgrpo.config import apply_overrides, load_config

    (tmp_path / "c.yaml").write_text("reward:\n  name: mypkg.rewards:Mine\n")
    with pytest.raises(ValueError):
        load_config(tmp_path / "c.yaml")  # mypkg does not exist: but it was allowed, then tried
    assert "mypkg.rewards:Mine" in allowed()
    apply_overrides({}, ["credit.scheme=other.pkg:scheme", "optim.lr=1"])
    assert "other.pkg:scheme" in allowed()


def test_where_to_run_comes_from_the_command_not_the_stored_run(tmp_path):
    """A stored `scale.workers: ray` at an address: the command runs in its own process, and
    connects nowhere (a listener here sees no connection)."""
    from stepgrpo.runs import open_stored

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    run = make_run(tmp_path / "runs", scale={"workers": "ray", "address": f"ray://127.0.0.1:{port}", "threads": 1})
    _, cfg = open_stored(run)
    assert (cfg.scale.workers, cfg.scale.address, cfg.scale.threads) == ("process", None, 1)
    _, cfg = open_stored(run, ["scale.num_workers=3"])
    assert (cfg.scale.workers, cfg.scale.num_workers) == ("process", 3)
    result = runner.invoke(app, ["credit", str(run), "--scheme", "outcome"])
    assert result.exit_code == 1  # no rollout yet (said before any flow starts)
    with pytest.raises(TimeoutError):
        listener.accept()
    listener.close()


@pytest.mark.parametrize("link", ["lora", "eval", "iter_0", "rewards", "calibration.json"])
def test_no_write_follows_a_link_out_of_the_run(tmp_path, link):
    from stepgrpo.storage.errors import StorageError
    from stepgrpo.storage.run import Run

    run_dir = make_run(tmp_path / "runs")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep me")
    os.symlink(outside, run_dir / link)
    run = Run.open(run_dir)
    with pytest.raises(StorageError, match="symbolic link"):
        run.inside(run_dir / link / "pytorch_lora_weights.safetensors")
    if link == "iter_0":
        with pytest.raises(StorageError, match="symbolic link"):
            run.save_draw(0, {"prompts": [1]}, {"key": "k"})
    if link == "rewards":
        import numpy as np

        with pytest.raises(StorageError, match="symbolic link"):
            run.tables.append_rewards(0, "shapes", "1", np.arange(2), np.zeros(2, int), np.zeros(2))
    assert [p.name for p in outside.iterdir()] == ["precious"] and (outside / "precious").read_text() == "keep me"


def test_the_lora_export_refuses_a_linked_folder_before_loading_a_model(tmp_path):
    from stepgrpo.config import load_config
    from stepgrpo.loops.update import export_lora
    from stepgrpo.storage.errors import StorageError
    from stepgrpo.storage.run import Run

    run_dir = make_run(tmp_path / "runs")
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", run_dir / "lora")
    t0 = time.perf_counter()
    with pytest.raises(StorageError, match="symbolic link"):
        export_lora(Run.open(run_dir), load_config(None), 0)
    assert time.perf_counter() - t0 < 5  # refused before the policy loaded
    assert list((tmp_path / "outside").iterdir()) == []


def test_huge_consistent_dims_are_refused_before_anything_is_allocated(tmp_path, monkeypatch):
    """B = 10^12 in a published rollout's manifest and Zarr metadata: `inspect` and `inspect
    --verify` answer at once, naming the dim, instead of allocating terabytes or looping."""
    from test_storage_roundtrip import rollout_inputs, write_rollout

    from stepgrpo.storage.run import Run

    run_dir = make_run(tmp_path / "runs", run={"prompts_per_iteration": 2, "group_size": 2}, sampler={"steps": 3})
    write_rollout(Run.open(run_dir), 0, rollout_inputs())
    stage = run_dir / "iter_0" / "rollout.zarr"
    published = json.loads((stage / "_published.json").read_text())
    published["attrs"]["B"] = 10**12
    (stage / "_published.json").write_text(json.dumps(seal(published)))  # consistent, sealed again
    group = json.loads((stage / "zarr.json").read_text())
    group["attributes"]["B"] = 10**12
    (stage / "zarr.json").write_text(json.dumps(group))
    for array in stage.glob("*/zarr.json"):
        meta = json.loads(array.read_text())
        if meta["shape"] and meta["shape"][0] == 4:
            meta["shape"][0] = 10**12
            array.write_text(json.dumps(meta))
    monkeypatch.chdir(tmp_path)
    for args in (["inspect", str(run_dir)], ["inspect", str(run_dir), "--verify"]):
        t0 = time.perf_counter()
        result = runner.invoke(app, args)
        assert time.perf_counter() - t0 < 20, args
        assert result.exit_code == 1, result.output
        assert "dim B = 1000000000000" in result.output, result.output


def _listening(pid: int) -> list[str]:
    """The local addresses of the TCP sockets process `pid` listens on (Linux /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                found.append(cols[1])
    return found


LOOPBACK_HEX = ("0100007F", "00000000000000000000000001000000")  # 127.0.0.1, ::1


@pytest.mark.slow  # rank processes
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("warm", [False, True], ids=["new processes", "forked by a warm process"])
def test_update_ranks_listen_on_loopback_only_and_die_with_their_launcher(tmp_path, warm):
    """Two ranks formed as the update forms them (`stepgrpo.runtime.parallel`; as new processes, and
    forked by the warm process the launcher keeps, `stepgrpo.runtime.warm`): every socket they listen
    on is on the loopback interface; a kill -9 of the process that launched them kills them too."""
    script = tmp_path / "ranks.py"
    cmd = (
        '[sys.executable, "-m", "rank"], 2, "ranks", "", ("torch",)'
        if warm
        else '[sys.executable, "rank.py"], 2, "ranks", ""'
    )
    script.write_text(
        textwrap.dedent(
            f"""
            import json, os, sys, time
            from stepgrpo.runtime import parallel
            pool = parallel.RankPool(lambda d: {cmd})
            print(json.dumps([p.pid for p in pool.procs]), flush=True)
            time.sleep(600)
            """
        )
    )
    (tmp_path / "rank.py").write_text(
        textwrap.dedent(
            f"""
            import json, os, time
            from stepgrpo.runtime import parallel
            parallel.die_with_parent()
            import torch.distributed as dist
            parallel.init_group("gloo")
            dist.all_reduce(__import__("torch").ones(1))
            open({str(tmp_path)!r} + "/ready-" + os.environ["RANK"], "w").write("1")
            time.sleep(600)
            """
        )
    )
    launcher = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        pids = json.loads(launcher.stdout.readline())
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready-{r}").exists() for r in range(2)):
            assert time.monotonic() < deadline, "the ranks did not form a group"
            time.sleep(0.2)
        for pid in pids:
            addresses = _listening(pid)
            assert all(a.split(":")[0] in LOOPBACK_HEX for a in addresses), addresses
    finally:
        launcher.kill()
        launcher.wait()
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() and _alive(pid) for pid in pids):
        assert time.monotonic() < deadline, "a rank outlived its launcher"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")
