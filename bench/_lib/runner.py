"""How every benchmark trains and keeps a run: one `stepgrpo train` as a user runs it (in a warm
worker, `bench._lib.warm`), its durable record (costs per iteration, held-out scores per sample),
and a screen of arms x seeds that resumes from its records.

A record is written only after its run finished, under `<records>/<arm>/seed_<S>.json`; the run
directories (`--out`) are scratch.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench._lib.common import OUT_DIR, relative, write_json
from bench._lib.warm import Stepgrpo


def run_seed(config: str, seed: int, overrides: list[str], out: Path, stepgrpo: Stepgrpo) -> dict[str, Any]:
    """One training run as a user runs it (`stepgrpo train` in a warm worker of `stepgrpo`); returns
    its run directory and wall seconds (the run's, not the worker's imports)."""
    run_dir = out / f"seed_{seed}"
    log = out / f"seed_{seed}.log"
    timing = out / f"seed_{seed}.seconds.json"  # the wall time of the run that trained it
    if timing.is_file():  # trained already: the command below only re-reads it (a few seconds)
        recorded = json.loads(timing.read_text())
        if recorded.get("argv") == [config, *overrides]:
            print(
                f"seed {seed}: trained earlier in {recorded['seconds'] / 60:.1f} min ({relative(timing)})", flush=True
            )
            log = out / f"seed_{seed}.reread.log"
    args = ["train", "--config", config, "--run-dir", str(run_dir), "--set", f"run.seed={seed}"]
    args += [a for o in overrides for a in ("--set", o)]
    t0 = time.perf_counter()
    rc = stepgrpo.run(args, log)
    seconds = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"seed {seed}: `stepgrpo train` exited {rc}; see {relative(log)}")
    if timing.is_file() and json.loads(timing.read_text()).get("argv") == [config, *overrides]:
        return {"seed": seed, "run_dir": run_dir, "seconds": json.loads(timing.read_text())["seconds"]}
    write_json(timing, {"argv": [config, *overrides], "seconds": seconds})
    print(f"seed {seed}: done in {seconds / 60:.1f} min ({relative(log)})", flush=True)
    return {"seed": seed, "run_dir": run_dir, "seconds": seconds}


def read_seed(done: dict[str, Any]) -> dict[str, Any]:
    """The seed's evaluations (iteration -> record) and its paired gains over its base."""
    from stepgrpo.reporting.report import paired_gain
    from stepgrpo.results import EvaluateResult

    evals = {}
    for f in (done["run_dir"] / "eval").glob("*.json"):
        e = EvaluateResult.model_validate(json.loads(f.read_text())).record()  # older records: flat sub-scores
        if f.stem != e["label"]:
            continue  # an evaluation with other settings than the run's
        it = 0 if e["label"] == "base" else int(e["label"].removeprefix("iter_")) + 1
        evals[it] = e
    base = evals[0]
    points = []
    for it in sorted(evals):
        e = evals[it]
        gain = paired_gain(base, e) if it else (0.0, 0.0, 0.0)
        points.append(
            {
                "seed": done["seed"],
                "iteration": it,
                "reward": e["reward_mean"],
                "strict": e.get("reward_strict", float("nan")),
                "gain": gain[0],
                "gain_lo": gain[1],
                "gain_hi": gain[2],
                **{f"sub_{k}": v for k, v in e.get("sub", {}).items()},
            }
        )
    iterations = points[-1]["iteration"]
    return {
        **done,
        "points": points,
        "iterations": iterations,
        "seconds_per_iteration": done["seconds"] / max(1, iterations),
    }


def covers(recorded: list[str], wanted: list[str]) -> bool:
    """Whether a run made with argv `recorded` holds the run `wanted` asks for: the same argv, or
    the same but for more `run.iterations` (a longer run of a constant learning rate passes through
    the shorter one: same prompts, noise and updates, evaluated at the same iterations)."""

    def split(argv: list[str]) -> tuple[list[str], int]:
        rest = [x for x in argv if not x.startswith("run.iterations=")]
        n = [int(x.split("=", 1)[1]) for x in argv if x.startswith("run.iterations=")]
        return rest, (n[-1] if n else 0)

    (r, n_r), (w, n_w) = split(recorded), split(wanted)
    constant = not any(x.startswith("optim.lr_schedule=") and not x.endswith("=constant") for x in recorded)
    return r == w and (n_r == n_w or (n_r > n_w and constant))


def record_of(run_dir: Path, argv: list[str]) -> dict[str, Any]:
    """The durable record of a finished run: costs per iteration, training rewards, and every
    held-out evaluation with its per-sample scores (what pairing needs)."""
    from bench._lib.common import open_run_once, read_run
    from bench._lib.stats import read_evals  # the same reading as the early-window comparison
    from stepgrpo.reporting.costs import iteration_costs

    rec = read_run(run_dir)
    # every stage's passes as it ran (`stepgrpo.reporting.costs`: forwards, and 2 a backward row)
    costs = iteration_costs(open_run_once(run_dir))
    evals = {}
    for it, e in read_evals(run_dir).items():
        keep = ("label", "prompts", "seeds", "reward_mean", "reward_strict", "sub")
        evals[str(it)] = {k: e.get(k) for k in keep} | {"scores": [round(x, 6) for x in e["scores"]]}
    return {
        "argv": argv,
        "nfe": [sum(n.values()) for n in rec.nfe],
        "passes": [int(c["passes"]) for c in costs],
        "stages": [c["nfe_stages"] | {"backward": (int(c["passes"]) - int(c["nfe"])) // 2} for c in costs],
        "seconds": rec.iter_seconds,
        "setup_seconds": rec.setup_seconds,
        "train_reward": rec.train_reward,
        "evals": evals,
    }


# --------------------------------------------------------------------------------- a screen

FULL = {"iterations": 100, "eval_every": 25, "set": ["run.eval_seeds=8"]}  # every screen's budget
QUICK = {  # every path at tiny settings (`--quick`)
    "iterations": 2,
    "eval_every": 1,
    "set": ["run.prompts_per_iteration=2", "run.group_size=4", "run.eval_prompts=8", "run.eval_seeds=1"],
}


@dataclass
class Screen:
    """Arms x seeds of one question. Arm `a` runs `recipes[a]` (a config and its overrides) with the
    screen's overrides for `iterations` (or `iterations_of[a]`), evaluated every `eval_every`. A record
    in `records`, or for an arm another question recorded in one of `kept[a]`, that covers the run
    asked for (`covers`) is read instead of training again."""

    recipes: dict[str, tuple[str, list[str]]]
    iterations: int
    eval_every: int
    overrides: list[str]
    out: Path  # run directories (scratch)
    records: Path  # the durable records
    quick: bool = False
    kept: dict[str, list[Path]] = field(default_factory=dict)
    iterations_of: dict[str, int] = field(default_factory=dict)

    def argv(self, arm: str) -> list[str]:
        config, sets = self.recipes[arm]
        n = self.iterations_of.get(arm, self.iterations)
        return [config, *self.overrides, *sets, f"run.iterations={n}", f"run.eval_every={self.eval_every}"]

    def record_path(self, arm: str, seed: int) -> Path:
        """The arm's record of `seed`: this screen's own, or a kept record that covers it."""
        for d in [self.records, *self.kept.get(arm, [])]:
            p = d / arm / f"seed_{seed}.json"
            if p.is_file() and covers(json.loads(p.read_text())["argv"], self.argv(arm)):
                return p
        return self.records / arm / f"seed_{seed}.json"

    def load(self, arm: str, seed: int) -> dict[str, Any] | None:
        p = self.record_path(arm, seed)
        if not p.is_file():
            return None
        r = json.loads(p.read_text())
        return r if covers(r["argv"], self.argv(arm)) else None

    def loaded(self, arms: Iterable[str], seeds: int) -> dict[tuple[str, int], dict[str, Any]]:
        return {(arm, k): r for arm in arms for k in range(seeds) if (r := self.load(arm, k))}

    def train_one(
        self, arm: str, seed: int, stepgrpo: Stepgrpo, extra: Callable[[Path], dict[str, Any]] | None = None
    ) -> None:
        """Train `(arm, seed)` unless a record covers it; then its record (`extra`: more of the run's
        own, read from its run directory)."""
        if self.load(arm, seed) is not None:
            return
        path = self.record_path(arm, seed)
        out = self.out / arm
        out.mkdir(parents=True, exist_ok=True)
        argv = self.argv(arm)
        t0 = time.perf_counter()
        done = run_seed(argv[0], seed, argv[1:], out, stepgrpo)
        record = record_of(done["run_dir"], argv)  # its passes per stage as they ran
        write_json(path, record | (extra(done["run_dir"]) if extra else {}))
        print(f"{arm} seed {seed}: recorded after {time.perf_counter() - t0:.0f} s", flush=True)

    def report(self, analysis: dict[str, Any], summary: str, tag: str = "") -> None:
        """Write `analysis{tag}.json` and `summary{tag}.md` beside the records (`--quick`: in `out`)."""
        dest = self.out if self.quick else self.records.parent
        write_json(dest / f"analysis{tag}.json", analysis)
        (dest / f"summary{tag}.md").write_text(summary)
        print(summary)
        print(f"wrote {relative(dest)}/summary{tag}.md and analysis{tag}.json")

    def run(
        self, jobs: list[tuple[str, int]], workers: int, extra: Callable[[Path], dict[str, Any]] | None = None
    ) -> None:
        """Train the `(arm, seed)` jobs not recorded yet, `workers` at once (one torch thread each)."""
        with Stepgrpo(workers, self.out) as stepgrpo, ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda job: self.train_one(*job, stepgrpo, extra), jobs))


def screen_arguments(description: str, arms: list[str]) -> argparse.ArgumentParser:
    """The options every screen takes."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--quick", action="store_true", help="every path at tiny settings")
    ap.add_argument("--iterations", type=int)
    ap.add_argument("--seeds", type=int, help="at most this many seeds an arm")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (one torch thread each)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="key=value on every run")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--records", type=Path)
    ap.add_argument("--arms", nargs="+", choices=arms, help="only these arms (in the queue's order)")
    ap.add_argument("--report-only", action="store_true", help="read the records; train nothing")
    return ap


def screen(
    a: argparse.Namespace,
    name: str,
    recipes: dict[str, tuple[str, list[str]]],
    records: Path,
    kept: dict[str, list[Path]] | None = None,
    iterations_of: dict[str, int] | None = None,
) -> Screen:
    """The screen `name` as its options ask: `--quick` runs every path at tiny settings with its
    records under `--out` (and reads no kept ones)."""
    p = QUICK if a.quick else FULL
    out = (a.out or OUT_DIR / (f"{name}_quick" if a.quick else name)).resolve()
    return Screen(
        recipes=recipes,
        iterations=a.iterations or p["iterations"],
        eval_every=p["eval_every"],
        overrides=list(p["set"]) + list(getattr(a, "overrides", [])),
        out=out,
        records=(a.records or (out / "records" if a.quick else records)).resolve(),
        quick=a.quick,
        kept={} if a.quick else dict(kept or {}),
        iterations_of={} if a.quick else dict(iterations_of or {}),
    )
