"""The credit-quality screen: in which regime does step-level credit beat outcome credit?

For each SDE window size (3 / 6 / 9 steps from step 0, of the 10) and noise level `a` (0.5 / 0.7)
of the `flow` kernel, one stored iteration of the shipped model with the `shapes` reward (64
prompt groups x 8 samples, the base policy, `remaining` completion so every scheme reads the same
step rewards), then `stepgrpo credit-quality` on it with `--continuations` SDE continuations per
state: every scheme's batch LoRA gradient against the gradient of the Monte-Carlo true advantages
on the same rows (cosine corrected for the Monte-Carlo noise, 95 % bootstrap over prompt groups,
and the paired difference to `outcome`), with uniform and `noise` step weighting.

Every step is a user's command (`stepgrpo train`, `stepgrpo credit-quality`), one torch thread,
resumable: a stored iteration and a stored check are reused. Written to `--out` (default
`docs/bench/credit_quality`): `screen.csv` (one row per configuration, weighting and scheme),
`steps.csv` (the per-step table), `screen.png` (cosine per scheme per configuration, with
intervals) and `summary.md` (the table and the regimes read off it).

    .venv/bin/python -m bench.credit_quality.credit_quality                 # the screen of docs/BENCHMARKS.md (~1 h)
    .venv/bin/python -m bench.credit_quality.credit_quality --quick         # every path at tiny settings (~2 min)
    .venv/bin/python -m bench.credit_quality.credit_quality --methods       # the estimators judged per NFE (below)

`--methods`: the same stored iterations (a = 0.7) judged with the step rewards of every completion
method (`stepgrpo credit-quality --method`: `remaining`, `substeps:1/2/3/5`, `tweedie`, `rollout`,
on the same rows and continuations), each with its transformer NFEs per trajectory: `methods.csv`
(a column `nfe_per_trajectory`), `methods.png` (cosine against NFEs per scheme and window) and
`methods.md`.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench._lib.common import ROOT, machine, relative, write_json
from bench._lib.warm import Stepgrpo

WINDOWS = (3, 6, 9)
NOISES = (0.5, 0.7)
SCHEMES = ("outcome", "stepwise", "dense", "turning_point")
# the completion methods of `--methods`; the stored iterations are completed by the first
METHODS = ("remaining", "substeps:1", "substeps:2", "substeps:3", "substeps:5", "tweedie", "rollout")


def command(stepgrpo: Stepgrpo, args: list[str], log: Path) -> None:
    """Run one `stepgrpo` command as a user runs it (in a warm worker); its output goes to `log`."""
    rc = stepgrpo.run(args, log)
    if rc != 0:
        raise SystemExit(f"stepgrpo {' '.join(args)} failed ({rc}); see {relative(log)}")


def stored_check(run_dir: Path, methods: bool = False) -> dict[str, Any] | None:
    """The stored check of the run's iteration 0: with `methods`, the one that judged other methods too."""
    found = [json.loads(f.read_text()) for f in sorted((run_dir / "credit_quality").glob("iter_0-*.json"))]
    found = [c for c in found if bool(c.get("methods")) == methods]
    return found[-1] if found else None


def screen_one(window: int, noise: float, args: argparse.Namespace, out: Path, stepgrpo: Stepgrpo) -> dict[str, Any]:
    """One configuration: train one iteration (the stored rollout and rewards), then the check."""
    name = f"w{window}_a{noise}"
    run_dir = out / "runs" / name
    overrides = [
        f"sampler.sde_window_size={window}",
        f"sampler.noise={noise}",
        f"run.prompts_per_iteration={args.groups}",
        f"run.group_size={args.group_size}",
        "run.iterations=1",
        "run.eval_prompts=1",
        "run.eval_seeds=1",
        f"run.seed={args.seed}",
        "optim.diagnostics=false",
        *args.set,
    ]
    t0 = time.perf_counter()
    if not (run_dir / "checkpoints").is_dir() or not any((run_dir / "checkpoints").iterdir()):
        print(f"{name}: storing one iteration of {args.groups} x {args.group_size} trajectories", flush=True)
        command(
            stepgrpo,
            ["train", "--config", "configs/shapes_dense.yaml", "--run-dir", str(run_dir)]
            + [a for o in overrides for a in ("--set", o)],
            out / f"{name}.train.log",
        )
    found = stored_check(run_dir, args.methods)
    if found is None or found["continuations"] != args.continuations:
        print(f"{name}: credit-quality check, M = {args.continuations}", flush=True)
        command(
            stepgrpo,
            ["credit-quality", str(run_dir), "--iteration", "0", "--continuations", str(args.continuations)]
            + [a for s in SCHEMES for a in ("--scheme", s)]
            + [a for m in (METHODS if args.methods else ()) for a in ("--method", m)],
            out / f"{name}.check{'.methods' if args.methods else ''}.log",
        )
    check = stored_check(run_dir, args.methods)
    assert check is not None
    print(f"{name}: done in {time.perf_counter() - t0:.0f} s (check {check['seconds']:.0f} s)", flush=True)
    return {"name": name, "window": window, "noise": noise, "check": check}


def rows_of(results: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    screen, steps = [], []
    for r in results:
        c = r["check"]
        for weighting, g in c["gradient"].items():
            for row in g["rows"]:
                screen.append(
                    {
                        "window": r["window"],
                        "noise": r["noise"],
                        "weighting": weighting,
                        "scheme": row["scheme"],
                        "cosine": row["cosine"],
                        "low": row["low"],
                        "high": row["high"],
                        "raw": row["raw"],
                        "diff_vs_outcome": row.get("diff"),
                        "diff_low": row.get("diff_low"),
                        "diff_high": row.get("diff_high"),
                        "reliability": g["reliability"],
                        "groups": c["groups"],
                        "trajectories": c["trajectories"],
                        "continuations": c["continuations"],
                        "nfe": c["nfe"],
                        "seconds": round(c["seconds"], 1),
                    }
                )
        for s in c["steps"]:
            steps.append({"window": r["window"], "noise": r["noise"], **s})
    return screen, steps


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def fmt(x: Any, d: int = 2) -> str:
    return "-" if x is None else f"{x:+.{d}f}" if d else str(x)


def verdict(row: dict[str, Any]) -> str:
    """Ahead / behind outcome when the paired interval excludes 0, else a tie."""
    lo, hi = row.get("diff_low"), row.get("diff_high")
    if lo is None or hi is None:
        return ""
    return "ahead of outcome" if lo > 0 else "behind outcome" if hi < 0 else "tie"


def summary(screen: list[dict[str, Any]]) -> str:
    lines = [
        "| window | a | weighting | " + " | ".join(SCHEMES) + " | reliability |",
        "|---|---|---|" + "---|" * len(SCHEMES) + "---|",
    ]
    configs = sorted({(r["window"], r["noise"], r["weighting"]) for r in screen}, key=lambda c: (c[2] != "uniform", c))
    for w, a, weighting in configs:
        cells, rel = [], ""
        for s in SCHEMES:
            row = next(
                (r for r in screen if (r["window"], r["noise"], r["weighting"], r["scheme"]) == (w, a, weighting, s)),
                None,
            )
            if row is None:
                cells.append("-")
                continue
            rel = fmt(row["reliability"])
            cell = f"{fmt(row['cosine'])} [{fmt(row['low'])}, {fmt(row['high'])}]"
            if row.get("diff_vs_outcome") is not None:
                cell += f"<br>{fmt(row['diff_vs_outcome'])} [{fmt(row['diff_low'])}, {fmt(row['diff_high'])}]"
            cells.append(cell)
        lines.append(f"| {w} | {a} | {weighting} | " + " | ".join(cells) + f" | {rel} |")
    ahead = [r for r in screen if verdict(r) == "ahead of outcome"]
    behind = [r for r in screen if verdict(r) == "behind outcome"]
    lines += ["", "Step-level credit ahead of outcome (paired 95 % interval above 0):"]
    lines += [
        f"- W{r['window']} a {r['noise']} {r['weighting']}: {r['scheme']} {fmt(r['diff_vs_outcome'])}" for r in ahead
    ] or ["- none"]
    lines += ["", "Outcome ahead (a scheme's paired interval below 0):"]
    lines += [
        f"- W{r['window']} a {r['noise']} {r['weighting']}: {r['scheme']} {fmt(r['diff_vs_outcome'])}" for r in behind
    ] or ["- none"]
    return "\n".join(lines) + "\n"


def plot(screen: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = sorted({(r["window"], r["noise"]) for r in screen})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, weighting in zip(axes, ("uniform", "noise")):
        for i, s in enumerate(SCHEMES):
            xs, ys, lo, hi = [], [], [], []
            for j, (w, a) in enumerate(configs):
                row = next(
                    (
                        r
                        for r in screen
                        if (r["window"], r["noise"], r["weighting"], r["scheme"]) == (w, a, weighting, s)
                    ),
                    None,
                )
                if row is None or row["cosine"] is None:
                    continue
                xs.append(j + (i - 1.5) * 0.15)
                ys.append(row["cosine"])
                lo.append(row["cosine"] - (row["low"] if row["low"] is not None else row["cosine"]))
                hi.append((row["high"] if row["high"] is not None else row["cosine"]) - row["cosine"])
            ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o", capsize=3, label=s)
        ax.set_xticks(range(len(configs)), [f"W{w}\na {a}" for w, a in configs])
        ax.axhline(0, color="grey", lw=0.5)
        ax.set_title(f"gradient check, {weighting} step weighting")
        ax.set_ylabel("cos(G_scheme, G_true), corrected")
        ax.set_ylim(-0.2, 1.05)
    axes[0].legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def method_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per window, weighting, scheme and completion method: its cosine and its NFEs."""
    rows = []
    for r in results:
        c = r["check"]
        own = next(iter(c["methods"]))  # the stored iteration's own method (named by the scheme alone)
        for weighting, g in c["gradient"].items():
            for row in g["rows"]:
                scheme, _, method = row["scheme"].partition(":")
                method = method or own
                rows.append(
                    {
                        "window": r["window"],
                        "noise": r["noise"],
                        "weighting": weighting,
                        "scheme": scheme,
                        "method": method if scheme != "outcome" else "none (R_T only)",
                        "nfe_per_trajectory": c["methods"][method]["nfe_per_trajectory"] if scheme != "outcome" else 0,
                        "cosine": row["cosine"],
                        "low": row["low"],
                        "high": row["high"],
                        "diff_vs_outcome": row.get("diff"),
                        "diff_low": row.get("diff_low"),
                        "diff_high": row.get("diff_high"),
                        "reliability": g["reliability"],
                        "groups": c["groups"],
                        "continuations": c["continuations"],
                    }
                )
    return rows


def methods_md(rows: list[dict[str, Any]]) -> str:
    """Per window (uniform weighting): each scheme's cosine by method, with the method's NFEs."""
    lines = []
    for w in sorted({r["window"] for r in rows}):
        sel = [r for r in rows if r["window"] == w and r["weighting"] == "uniform"]
        schemes = [s for s in SCHEMES if s != "outcome" and any(r["scheme"] == s for r in sel)]
        groups = sel[0]["groups"]
        lines += [
            f"W = {w} ({groups} prompt groups, M = {sel[0]['continuations']}; corrected cosine with the "
            "true-advantage gradient, 95 % interval over prompt groups):",
            "",
            "| step rewards from | NFEs per trajectory | " + " | ".join(schemes) + " |",
            "|---|---|" + "---|" * len(schemes),
        ]
        for m in METHODS:
            cells = []
            nfe = None
            for s in schemes:
                row = next((r for r in sel if r["scheme"] == s and r["method"] == m), None)
                if row is None or row["cosine"] is None:
                    cells.append("-")
                    continue
                nfe = row["nfe_per_trajectory"]
                cells.append(f"{fmt(row['cosine'])} [{fmt(row['low'])}, {fmt(row['high'])}]")
            lines.append(f"| `{m}` | {'-' if nfe is None else f'{nfe:.0f}'} | " + " | ".join(cells) + " |")
        o = next((r for r in sel if r["scheme"] == "outcome"), None)
        if o is not None:
            lines.append(
                f"| outcome (no step rewards) | 0 | {fmt(o['cosine'])} [{fmt(o['low'])}, {fmt(o['high'])}] |"
                + " |" * (len(schemes) - 1)
            )
        lines.append("")
    return "\n".join(lines)


def plot_methods(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    windows = sorted({r["window"] for r in rows})
    fig, axes = plt.subplots(1, len(windows), figsize=(5 * len(windows), 4.2), sharey=True, squeeze=False)
    for ax, w in zip(axes[0], windows):
        sel = [r for r in rows if r["window"] == w and r["weighting"] == "uniform" and r["cosine"] is not None]
        for s in SCHEMES:
            pts = sorted((r["nfe_per_trajectory"], r["cosine"], r["method"]) for r in sel if r["scheme"] == s)
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", label=s)
            if s == "dense":
                for x, y, m in pts:
                    ax.annotate(m, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("symlog", linthresh=1)
        ax.set_xlabel("transformer NFEs per trajectory for the step rewards")
        ax.set_title(f"W = {w}")
        ax.axhline(0, color="grey", lw=0.5)
    axes[0][0].set_ylabel("cos(G_scheme, G_true), corrected")
    axes[0][0].legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "credit_quality")
    p.add_argument("--groups", type=int, default=64, help="prompt groups of the stored iteration")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--continuations", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--windows", type=int, nargs="+", default=list(WINDOWS))
    p.add_argument("--noises", type=float, nargs="+", default=list(NOISES))
    p.add_argument("--set", action="append", default=[], help="more overrides for every run")
    p.add_argument("--quick", action="store_true", help="every path at tiny settings (a smoke test)")
    p.add_argument("--methods", action="store_true", help="every completion method per NFE (module doc)")
    args = p.parse_args()
    if args.methods:
        args.noises = [0.7]
    if args.quick:
        args.groups, args.group_size, args.continuations = 2, 2, 2
        args.windows, args.noises = [2], [0.7]
        args.set += ["sampler.steps=3", "model.max_batch=16"]
        if args.out == ROOT / "docs" / "bench" / "credit_quality":
            args.out = ROOT / "bench" / "out" / "credit_quality_quick"
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    with Stepgrpo(1, out) as stepgrpo:
        results = [screen_one(w, a, args, out, stepgrpo) for w in args.windows for a in args.noises]
    if args.methods:
        rows = method_rows(results)
        write_csv(out / "methods.csv", rows)
        (out / "methods.md").write_text(methods_md(rows))
        plot_methods(rows, out / "methods.png")
        print((out / "methods.md").read_text())
        print(f"written to {relative(out)}")
        return
    screen, steps = rows_of(results)
    write_csv(out / "screen.csv", screen)
    write_csv(out / "steps.csv", steps)
    text = summary(screen)
    (out / "summary.md").write_text(text)
    write_json(out / "machine.json", {"machine": machine(), "argv": sys.argv[1:]})
    plot(screen, out / "screen.png")
    print(text)
    print(f"written to {relative(out)}")


if __name__ == "__main__":
    main()
