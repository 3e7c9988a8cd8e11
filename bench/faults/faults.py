"""Faults: kill -9 at random moments, a flipped byte in every kind of stored file, two writers at once.

Every run is the real console script (`stepgrpo train ...`, a process of its own) on the shipped
model with a small recipe that still publishes every kind of stage (rollout, completions, decoded
images, rewards, advantages, checkpoints, evaluations, the MLflow store, the exported LoRA).

1. kill -9: a reference run trains uninterrupted. Then, `--kills` times, a run is killed at a
   moment drawn (seeded) from its whole length, or the moment its MLflow store is being created,
   and resumed by the same command. A trial passes when the resumed run's checkpoints and exported
   LoRA are byte-identical to the reference's, every stored item matches (bench/costs/digests.py), and
   no stage published before the kill was published again.
2. A flipped byte: in a copy of the reference run, one byte of one file of each kind is flipped;
   then `train` (resume), `rescore`, `credit` and `inspect --verify` run on their own copy. Each
   must notice: exit non-zero naming the damage, or say it, keep the damaged data aside and
   compute it again, ending with a run that verifies. A command that never reads a kind of file
   is reported as such (`-`), not counted.
3. Two writers: two `train` processes on one new run id at once, and a `rescore` while a `train`
   owns the run. One is refused naming the holder; the other finishes; the run verifies.
4. A run directory that attacks (docs/RELIABILITY.md, "A stored config is data too"): a manifest naming a
   module that writes a file when imported (every command), `venv.__main__` / `tqdm.__main__`, a
   stored Ray address with a listener, links `lora/` and `eval/` out of the run, `B = 10^12` in a
   stage's metadata; and a 2-process update killed by a kill -9 of the process group, of the
   command alone, and by SIGTERM: each case holds when nothing ran, connected or was written
   outside, the command answered in time, and no process the command started is left.

5. A user's second week: inputs that must be refused before any server starts or directory is
   made (absolute bounds, a YAML alias bomb, a runs root that is a file, a megabyte prompt, a
   reward's hub weights offline, an http reward's options, a token with a newline) and a checkpoint
   copied under another number (`inspect --verify`, `evaluate --iteration`): each holds when the
   command exits 1 in seconds with a short message naming the problem, and nothing was made.

    .venv/bin/python -m bench.faults.faults                 # writes bench/out/faults/faults.json
    .venv/bin/python -m bench.faults.faults --kills 3       # a quick look
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench._lib.common import OUT_DIR, ROOT, write_json
from bench._lib.digests import items
from bench._lib.warm import command_env  # the environment of a benchmark's `stepgrpo` command

RECIPE = [
    "run.iterations=2",
    "run.prompts_per_iteration=2",
    "run.group_size=4",
    "run.eval_prompts=8",
    "run.eval_seeds=1",
    "run.eval_every=1",
    "sampler.steps=4",
    "sampler.eval_steps=4",
    "optim.micro_batch=8",
    "completion.method=remaining",
    "credit.scheme=stepwise",
]
CONFIG = "configs/demo.yaml"


def stepgrpo(*args: str) -> list[str]:
    return [str(Path(sys.executable).parent / "stepgrpo"), *args]


def train_cmd(run_dir: Path) -> list[str]:
    return stepgrpo("train", "--config", CONFIG, "--run-dir", str(run_dir), *[a for o in RECIPE for a in ("--set", o)])


def run(cmd: list[str], out: Path, log: Path) -> tuple[int, str]:
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, env=command_env(out), stdout=f, stderr=subprocess.STDOUT).returncode
    return rc, log.read_text()


def file_digests(run_dir: Path) -> dict[str, str]:
    """sha256 of every file of the checkpoints and of the exported LoRA: what must be byte-identical."""
    files = sorted(run_dir.glob("checkpoints/iter_*/*")) + sorted(run_dir.glob("lora/*"))
    return {
        f.relative_to(run_dir).as_posix(): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in files
        if f.is_file() and f.name != "_published.json"
    }


def published(run_dir: Path) -> dict[str, float]:
    """Every published stage's manifest and its modification time."""
    return {p.relative_to(run_dir).as_posix(): p.stat().st_mtime_ns for p in run_dir.rglob("_published.json")}


# ---------------------------------------------------------------------------------- 1. kill -9


def kill_trial(out: Path, k: int, at: float | str, reference: Path) -> dict[str, Any]:
    run_dir = out / "kills" / f"trial_{k}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = run_dir.parent / f"trial_{k}.killed.log"
    with log.open("w") as f:
        proc = subprocess.Popen(
            train_cmd(run_dir),
            cwd=ROOT,
            env=command_env(out),
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        t0 = time.perf_counter()
        while proc.poll() is None:
            elapsed = time.perf_counter() - t0
            if (at == "mlflow" and list(run_dir.glob(".mlflow.db.*.creating"))) or (at != "mlflow" and elapsed >= at):
                os.killpg(proc.pid, signal.SIGKILL)  # the flow and its temporary Prefect server
                break
            time.sleep(0.01)
        proc.wait()
        killed_at = time.perf_counter() - t0
    finished_anyway = proc.returncode == 0
    before = published(run_dir) if run_dir.exists() else {}
    rc, text = run(train_cmd(run_dir), out, run_dir.parent / f"trial_{k}.resumed.log")
    after = published(run_dir) if run_dir.exists() else {}
    republished = sorted(k_ for k_, t in before.items() if after.get(k_) != t)
    ours, theirs = file_digests(run_dir), file_digests(reference)
    a, b = items(run_dir), items(reference)
    differ = sorted(x for x in set(a) | set(b) if a.get(x) != b.get(x))
    ok = rc == 0 and ours == theirs and not differ and not republished
    return {
        "trial": k,
        "kill_at": at if at == "mlflow" else round(at, 2),
        "killed_after_s": round(killed_at, 2),
        "finished_before_kill": finished_anyway,
        "stages_published_before": len(before),
        "resume_rc": rc,
        "bit_identical_files": ours == theirs,
        "items_differ": differ,
        "republished": republished,
        "pass": ok,
    }


# ----------------------------------------------------------------------------- 2. flipped bytes


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


KINDS = {  # kind -> the file to flip in a run directory
    "rollout chunk": lambda r: sorted((r / "iter_1" / "rollout.zarr" / "states").glob("c.*"))[0],
    "rollout zarr.json": lambda r: r / "iter_1" / "rollout.zarr" / "states" / "zarr.json",
    "completion chunk": lambda r: sorted((r / "iter_1" / "completions" / "remaining.zarr" / "latents").glob("c.*"))[0],
    "images chunk": lambda r: sorted((r / "iter_1" / "images" / "remaining.zarr" / "images").glob("c.*"))[0],
    "stage manifest": lambda r: r / "iter_1" / "rollout.zarr" / "_published.json",
    "rewards part": lambda r: sorted((r / "rewards").glob("part-*.parquet"))[0],
    "advantages part": lambda r: sorted((r / "advantages").glob("part-*.parquet"))[0],
    "prompts table": lambda r: r / "prompts.parquet",
    "checkpoint tensors": lambda r: r / "checkpoints" / "iter_1" / "lora.safetensors",
    "checkpoint state": lambda r: r / "checkpoints" / "iter_1" / "state.json",
    "run manifest": lambda r: r / "manifest.json",
    "a stage key's bit": lambda r: r / "iter_1" / "rollout.zarr" / "_published.json",
    "exported LoRA": lambda r: r / "lora" / "pytorch_lora_weights.safetensors",
    "evaluation record": lambda r: r / "eval" / "base.json",
}
KEY_FLIP = "a stage key's bit"  # flipped inside the key's hex digits: the JSON stays valid
# Which commands read which kinds (a command that never reads a file cannot notice its damage).
READS = {
    "resume": set(KINDS),
    "rescore": {
        "rollout chunk",
        "rollout zarr.json",
        "completion chunk",
        "images chunk",
        "stage manifest",
        "rewards part",
        "prompts table",
        "run manifest",
    },
    "credit": {
        "rollout chunk",
        "rollout zarr.json",
        "stage manifest",
        "rewards part",
        "advantages part",
        "run manifest",
    },
    "inspect --verify": set(KINDS),
}
READS["resume"] -= {"exported LoRA"}  # a resume writes the export again (it does not read it)
READS["rescore"] |= {KEY_FLIP}
READS["credit"] |= {KEY_FLIP}


def flip_trial(out: Path, reference: Path, kind: str, command: str) -> dict[str, Any]:
    import stepgrpo.storage.run

    run_dir = out / "flips" / f"{kind.replace(' ', '_').replace(chr(39), '')}-{command.split()[0]}"
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.copytree(reference, run_dir)
    target = KINDS[kind](run_dir)
    if kind == KEY_FLIP:
        text = target.read_text()
        key = json.loads(text)["inputs"]["key"]
        target.write_text(text.replace(key, key[:-1] + ("1" if key[-1] != "1" else "0")))
    else:
        flip(target)
    cmd = {
        "resume": train_cmd(run_dir),
        "rescore": stepgrpo("rescore", str(run_dir), "--reward", "jpeg_compressibility"),
        "credit": stepgrpo("credit", str(run_dir), "--scheme", "dense"),
        "inspect --verify": stepgrpo("inspect", str(run_dir), "--verify"),
    }[command]
    rc, text = run(cmd, out, run_dir.parent / f"{run_dir.name}.log")
    named = (
        "damaged" in text
        or "does not match" in text
        or "no longer match" in text
        or "differs" in text
        or "not JSON" in text
        or "cannot be read" in text
        or "not a readable" in text
        or "published from other inputs" in text
        or "another config" in text
        or "seal" in text
    )
    # noticed: stopped naming the damage, or said it, kept the damaged data aside, recomputed it and
    # left a run that verifies
    repaired = rc == 0 and named and stepgrpo.storage.run.Run.open(run_dir).verify_all() == []
    detected = named and (rc != 0 or repaired)
    return {
        "kind": kind,
        "command": command,
        "file": target.relative_to(run_dir).as_posix(),
        "rc": rc,
        "detected": detected,
        "reads": kind in READS[command],
        "said": next((line.strip() for line in text.splitlines() if "damaged" in line or "error" in line), "")[:200],
    }


# -------------------------------------------------------------- 4. a run directory that attacks


def _copy_of(out: Path, reference: Path, name: str) -> Path:
    run_dir = out / "trust" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.copytree(reference, run_dir)
    return run_dir


def _edit_config(run_dir: Path, section: str, values: dict[str, Any]) -> None:
    """Edit the run's stored config as a crafted run would: consistently, sealed again."""
    from stepgrpo.storage.publish import seal

    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest["config"][section] = {**manifest["config"][section], **values}
    (run_dir / "manifest.json").write_text(json.dumps(seal(manifest)))


def _trial(case: str, held: bool, said: str) -> dict[str, Any]:
    line = next((x.strip() for x in said.splitlines() if "error" in x.lower() or "damaged" in x), said.strip())
    print(f"{case}: {'held' if held else 'NOT HELD'}  {line[:110]}", flush=True)
    return {"case": case, "held": held, "said": line[:300]}


def trust_trials(out: Path, reference: Path) -> list[dict[str, Any]]:
    """Each attack of a run directory, on a copy of the reference run, through the console script."""
    import socket

    from stepgrpo.storage.publish import seal

    trials = []
    site = out / "trust" / "site"
    site.mkdir(parents=True, exist_ok=True)
    marker = out / "trust" / "imported"
    (site / "evil_mod.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\nx = 1\n")
    commands = {
        "inspect": lambda r: stepgrpo("inspect", str(r)),
        "credit": lambda r: stepgrpo("credit", str(r), "--scheme", "dense"),
        "rescore": lambda r: stepgrpo("rescore", str(r), "--reward", "jpeg_compressibility"),
        "evaluate": lambda r: stepgrpo("evaluate", str(r)),
        "train (resume)": train_cmd,
    }
    for name, command in commands.items():
        run_dir = _copy_of(out, reference, "plugin")
        _edit_config(run_dir, "reward", {"name": "evil_mod:x"})
        marker.unlink(missing_ok=True)
        with (out / "trust" / "plugin.log").open("w") as f:
            rc = subprocess.run(
                command(run_dir),
                cwd=ROOT,
                env={**command_env(out), "PYTHONPATH": str(site)},
                stdout=f,
                stderr=subprocess.STDOUT,
            ).returncode
        said = (out / "trust" / "plugin.log").read_text()
        trials.append(_trial(f"manifest names a module (reward.name), {name}", not marker.exists(), said or f"rc {rc}"))
    for module in ("venv.__main__", "tqdm.__main__"):
        run_dir = _copy_of(out, reference, "main")
        _edit_config(run_dir, "reward", {"name": f"{module}:x"})
        t0 = time.perf_counter()
        done = subprocess.run(
            stepgrpo("inspect", "."), cwd=run_dir, env=command_env(out), capture_output=True, text=True, timeout=120
        )
        held = done.returncode == 0 and not (run_dir / "x").exists() and time.perf_counter() - t0 < 60
        trials.append(_trial(f"manifest names {module}, inspect", held, done.stdout + done.stderr))
    run_dir = _copy_of(out, reference, "scale")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    _edit_config(run_dir, "scale", {"workers": "ray", "address": f"ray://127.0.0.1:{listener.getsockname()[1]}"})
    rc, said = run(stepgrpo("rescore", str(run_dir), "--reward", "jpeg_compressibility"), out, out / "trust" / "s.log")
    try:
        listener.accept()
        connected = True
    except TimeoutError:
        connected = False
    listener.close()
    trials.append(_trial("stored scale.address of a Ray cluster, rescore", rc == 0 and not connected, said))
    for link, command in (("lora", train_cmd), ("eval", None)):
        run_dir = _copy_of(out, reference, f"link-{link}")
        outside = out / "trust" / f"outside-{link}"
        shutil.rmtree(outside, ignore_errors=True)
        outside.mkdir()
        (outside / "pytorch_lora_weights.safetensors").write_text("precious")
        shutil.rmtree(run_dir / link)
        os.symlink(outside, run_dir / link)
        cmd = command(run_dir) if command else stepgrpo("evaluate", str(run_dir), "--set", "run.eval_prompts=3")
        rc, said = run(cmd, out, out / "trust" / f"link-{link}.log")
        kept = [p.name for p in outside.iterdir()] == ["pytorch_lora_weights.safetensors"]
        held = rc != 0 and kept and (outside / "pytorch_lora_weights.safetensors").read_text() == "precious"
        trials.append(_trial(f"a link {link}/ out of the run, {'train' if command else 'evaluate'}", held, said))
    run_dir = _copy_of(out, reference, "dims")
    stage = run_dir / "iter_0" / "rollout.zarr"
    for meta in [stage / "_published.json", stage / "zarr.json", *stage.glob("*/zarr.json")]:
        data = json.loads(meta.read_text())
        if "attrs" in data:
            data["attrs"]["B"] = 10**12
            data = seal(data)  # consistent: sealed again, as a crafted run would be
        if "attributes" in data and "B" in data["attributes"]:
            data["attributes"]["B"] = 10**12
        if data.get("shape") and data["shape"][0] == 8:
            data["shape"][0] = 10**12
        meta.write_text(json.dumps(data))
    for args in (["inspect", str(run_dir)], ["inspect", str(run_dir), "--verify"]):
        t0 = time.perf_counter()
        rc, said = run(stepgrpo(*args), out, out / "trust" / "dims.log")
        held = rc == 1 and "dim B" in said and time.perf_counter() - t0 < 60
        trials.append(_trial(f"B = 10^12 in a stage's metadata, {' '.join(args[::2][:1] + args[2:])}", held, said))
    trials += orphan_trials(out)
    return trials


def orphan_trials(out: Path) -> list[dict[str, Any]]:
    """A 2-process update killed three ways: every process the command started ends with it."""
    from stepgrpo.runtime.reaper import descendants, start_time

    trials = []
    for how in ("kill -9 of the process group", "kill -9 of the command alone", "SIGTERM of the command"):
        run_dir = out / "trust" / "orphans"
        shutil.rmtree(run_dir, ignore_errors=True)
        log = out / "trust" / "orphans.log"
        cmd = [*train_cmd(run_dir), "--set", "scale.update_processes=2"]
        with log.open("w") as f:
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=command_env(out), stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )
        seen: dict[int, str] = {}
        deadline = time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline:
            seen.update(descendants(proc.pid))
            ranks = [p for p in seen if "stepgrpo.loops.update" in _cmdline(p)]
            if len(ranks) == 2 and all(start_time(p) for p in ranks):
                time.sleep(1.0)
                break
            time.sleep(0.1)
        seen.update(descendants(proc.pid))
        ranks = sum("stepgrpo.loops.update" in _cmdline(p) for p in seen)  # counted while they live
        if how == "kill -9 of the process group":
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            os.kill(proc.pid, signal.SIGKILL if "9" in how else signal.SIGTERM)
        proc.wait()
        time.sleep(10)
        left = [p for p, t in seen.items() if start_time(p) == t and _state(p) not in ("Z", "X")]
        trials.append(
            _trial(f"{how} during a 2-process update ({ranks} ranks seen)", ranks == 2 and not left, f"left {left}")
        )
        for p in left:
            os.kill(p, signal.SIGKILL)
    return trials


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


# ------------------------------------------------------------------------------ 3. two writers


def concurrency(out: Path, reference: Path) -> list[dict[str, Any]]:
    import stepgrpo.storage.run

    results = []
    run_dir = out / "concurrent" / "same-id"
    shutil.rmtree(run_dir.parent, ignore_errors=True)
    run_dir.parent.mkdir(parents=True)
    logs = [run_dir.parent / f"train_{i}.log" for i in (0, 1)]
    procs = [
        subprocess.Popen(
            train_cmd(run_dir), cwd=ROOT, env=command_env(out), stdout=log.open("w"), stderr=subprocess.STDOUT
        )
        for log in logs
    ]
    rcs = [p.wait() for p in procs]
    texts = [log.read_text() for log in logs]
    refused = [i for i, t in enumerate(texts) if "is in use: held by pid" in t]
    a, b = items(run_dir), items(reference)
    results.append(
        {
            "case": "two train processes, one new run id",
            "exit_codes": rcs,
            "refused": len(refused),
            "finished": rcs.count(0),
            "verifies": stepgrpo.storage.run.Run.open(run_dir).verify_all() == [],
            "same_as_reference": a == b,
            "pass": sorted(rcs) == [0, 1] and len(refused) == 1 and a == b,
        }
    )
    # a rescore while a train owns the run (the train resumes the finished run, then re-exports)
    copy = run_dir.parent / "busy"
    shutil.copytree(reference, copy)
    trainer = subprocess.Popen(
        train_cmd(copy),
        cwd=ROOT,
        env=command_env(out),
        stdout=(copy.parent / "busy.train.log").open("w"),
        stderr=subprocess.STDOUT,
    )
    while not (copy.parent / ".busy.lock.holder").exists() and trainer.poll() is None:
        time.sleep(0.05)
    rc, text = run(
        stepgrpo("rescore", str(copy), "--reward", "jpeg_compressibility"), out, copy.parent / "busy.rescore.log"
    )
    trc = trainer.wait()
    results.append(
        {
            "case": "rescore while train owns the run",
            "exit_codes": [trc, rc],
            "refused": int("is in use" in text),
            "finished": int(trc == 0),
            "verifies": stepgrpo.storage.run.Run.open(copy).verify_all() == [],
            "same_as_reference": None,
            "pass": trc == 0 and rc == 1 and "is in use" in text,
        }
    )
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=OUT_DIR / "faults")
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip", nargs="*", default=[], choices=["kills", "flips", "concurrency", "trust", "second-week"])
    p.add_argument("--report", action="store_true", help="print the tables of OUT/faults.json and stop")
    a = p.parse_args()
    if a.report:
        report(json.loads((a.out / "faults.json").read_text()))
        return
    a.out.mkdir(parents=True, exist_ok=True)
    reference = a.out / "reference"
    if not (reference / "lora").is_dir():
        shutil.rmtree(reference, ignore_errors=True)
        t0 = time.perf_counter()
        rc, text = run(train_cmd(reference), a.out, a.out / "reference.log")
        if rc != 0:
            sys.exit(f"the reference run failed; see {a.out / 'reference.log'}")
        write_json(a.out / "reference.json", {"seconds": time.perf_counter() - t0})
    length = json.loads((a.out / "reference.json").read_text())["seconds"]
    result_file = a.out / "faults.json"
    results: dict[str, Any] = json.loads(result_file.read_text()) if result_file.is_file() else {}
    results["recipe"] = {"config": CONFIG, "overrides": RECIPE, "reference_seconds": round(length, 1)}

    if "kills" not in a.skip:
        rng = random.Random(a.seed)
        moments: list[float | str] = ["mlflow"] + [rng.uniform(0.5, length) for _ in range(a.kills - 1)]
        trials = []
        for k, at in enumerate(moments):
            trials.append(kill_trial(a.out, k, at, reference))
            t = trials[-1]
            print(
                f"kill {k:2d} at {t['kill_at']!s:>7}: published before {t['stages_published_before']:2d}, "
                f"resume rc {t['resume_rc']}, bit-identical {t['bit_identical_files']}, "
                f"republished {len(t['republished'])}, differing items {len(t['items_differ'])} -> "
                f"{'pass' if t['pass'] else 'FAIL'}",
                flush=True,
            )
        results["kills"] = trials
        write_json(result_file, results)
    if "flips" not in a.skip:
        flips = []
        for kind in KINDS:
            for command in READS:
                flips.append(flip_trial(a.out, reference, kind, command))
                f = flips[-1]
                print(
                    f"flip {kind:19s} {command:17s} reads {f['reads']!s:5} rc {f['rc']} detected {f['detected']}: "
                    f"{f['said'][:90]}",
                    flush=True,
                )
        results["flips"] = flips
        write_json(result_file, results)
    if "concurrency" not in a.skip:
        results["concurrency"] = concurrency(a.out, reference)
        for c in results["concurrency"]:
            print(
                f"{c['case']}: exit codes {c['exit_codes']}, refused {c['refused']}, verifies {c['verifies']} -> "
                f"{'pass' if c['pass'] else 'FAIL'}",
                flush=True,
            )
        write_json(result_file, results)
    if "trust" not in a.skip:
        results["trust"] = trust_trials(a.out, reference)
        write_json(result_file, results)
    if "second-week" not in a.skip:
        results["second_week"] = second_week_trials(a.out, reference)
        write_json(result_file, results)
    report(results)


def second_week_trials(out: Path, reference: Path) -> list[dict[str, Any]]:
    """Section 5 of the module doc: each case through the console script, in a directory of its own."""
    lines = ["reward:", "  name: shapes", "  options:", "    a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"    a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    http = "reward.options={url: 'http://127.0.0.1:9', name: r, version: '1'}"
    cases: list[tuple[str, list[str], str, dict[str, str]]] = [
        ("run.group_size=1000000000", ["--set", "run.group_size=1000000000"], "run.group_size", {}),
        ("sampler.steps=10000000", ["--set", "sampler.steps=10000000"], "sampler.steps", {}),
        ("optim.lr=1e300", ["--set", "optim.lr=1e300"], "optim.lr", {}),
        ("a YAML alias bomb (581 bytes)", ["--config", "bomb.yaml"], "aliases expand", {}),
        ("a runs root that is a file", ["--set", "run.runs_root=a-file"], "is a file", {}),
        ("a prompt of a megabyte", ["--set", "run.prompts=big.txt"], "characters", {}),
        ("pickscore's weights offline", ["--set", "reward.name=pickscore"], "HF_HUB_OFFLINE is set",
         {"HF_HUB_OFFLINE": "1"}),
        ("an http reward without name and version", ["--set", "reward.name=http", "--set",
         "reward.options={url: 'http://127.0.0.1:9'}"], "`name`, `version` missing", {}),
        ("a reward token with a newline", ["--set", "reward.name=http", "--set", http], "STEPGRPO_REWARD_TOKEN",
         {"STEPGRPO_REWARD_TOKEN": "secret-value\n"}),
    ]  # fmt: skip
    trials = []
    for case, args, says, env in cases:
        here = out / "second-week" / case.replace(" ", "_").replace("/", "_")[:40]
        shutil.rmtree(here, ignore_errors=True)
        here.mkdir(parents=True)
        (here / "bomb.yaml").write_text("\n".join(lines) + "\n")
        (here / "a-file").write_text("")
        (here / "big.txt").write_text("a red circle\n" + "x" * 1_000_000 + "\n")
        before = sorted(p.name for p in here.iterdir())
        t0 = time.perf_counter()
        done = subprocess.run(
            [*stepgrpo("train", *args, "--run-id", "x")], cwd=here, env={**command_env(here), **env},
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        seconds, said = time.perf_counter() - t0, done.stdout + done.stderr
        made = sorted(set(p.name for p in here.iterdir()) - set(before) - {"prefect-home"})
        held = done.returncode == 1 and says in said and not made and len(said.strip().splitlines()) <= 4
        held = held and "secret-value" not in said
        trials.append(_trial(case, held, said) | {"seconds": round(seconds, 1), "lines": len(said.splitlines())})
    copy = _copy_of(out, reference, "copied-checkpoint")
    last = max(int(p.name.removeprefix("iter_")) for p in (copy / "checkpoints").glob("iter_*"))
    shutil.copytree(copy / "checkpoints" / "iter_0", copy / "checkpoints" / f"iter_{last + 5}")
    for command in (["inspect", str(copy), "--verify"], ["evaluate", str(copy), "--iteration", str(last + 5)]):
        rc, said = run(stepgrpo(*command), out, out / f"copied-{command[0]}.log")
        held = rc == 1 and "holds the checkpoint of iteration 0" in said and "failed: Exit" not in said
        trials.append(_trial(f"a checkpoint copied under another number, {command[0]}", held, said))
    return trials


def report(results: dict[str, Any]) -> None:
    kills = results.get("kills", [])
    if kills:
        print(
            f"\nkill -9: {sum(t['pass'] for t in kills)}/{len(kills)} resumed with byte-identical checkpoints and "
            f"LoRA and every item equal to the uninterrupted run's, "
            f"{sum(len(t['republished']) for t in kills)} published stages recomputed"
        )
        phases: dict[int, int] = {}
        for t in kills:
            phases[t["stages_published_before"]] = phases.get(t["stages_published_before"], 0) + 1
        print(
            "  stages published when killed: "
            + ", ".join(f"{n}: {c} kills" for n, c in sorted(phases.items()))
            + f"; runs that had finished: {sum(t['finished_before_kill'] for t in kills)}; "
            f"killed while creating the MLflow store: {sum(t['kill_at'] == 'mlflow' for t in kills)}"
        )
    flips = results.get("flips", [])
    if flips:
        print("\nflipped byte: detected / commands that read the file")
        print(f"{'file kind':20s} " + " ".join(f"{c:>17s}" for c in READS))
        for kind in KINDS:
            row = [f for f in flips if f["kind"] == kind]
            cells = [
                ("yes" if f["detected"] else "NO") if f["reads"] else ("(yes)" if f["detected"] else "-") for f in row
            ]
            print(f"{kind:20s} " + " ".join(f"{c:>17s}" for c in cells))
        counted = [f for f in flips if f["reads"]]
        print(f"detected {sum(f['detected'] for f in counted)}/{len(counted)} where the command reads the file")
    for c in results.get("concurrency", []):
        print(f"{c['case']}: {'pass' if c['pass'] else 'FAIL'} (exit codes {c['exit_codes']})")
    trust = results.get("trust", [])
    if trust:
        print(
            f"\na run directory that attacks, processes left behind: {sum(t['held'] for t in trust)}/{len(trust)} held"
        )
        for t in trust:
            print(f"  {'held    ' if t['held'] else 'NOT HELD'} {t['case']}")
    week = results.get("second_week", [])
    if week:
        print(f"\na user's second week: {sum(t['held'] for t in week)} held, {sum(not t['held'] for t in week)} failed")
        for t in week:
            cost = f" ({t['seconds']} s, {t['lines']} lines)" if "seconds" in t else ""
            print(f"  {'held    ' if t['held'] else 'NOT HELD'} {t['case']}{cost}")


if __name__ == "__main__":
    main()
