"""Runs side by side at equal compute: each evaluation's held-out reward against the compute the
run had spent on training before it (`stepgrpo compare RUN...`: forward-equivalent passes by
default, or NFEs or seconds), read from the stored runs alone (evaluation records, stage
manifests), so runs of any scheme or objective, tracked anywhere or nowhere, compare the same way.
`at_equal` reads every run at the largest budget all of them reached. The chart colours runs by
recipe."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stepgrpo.reporting.costs import iteration_costs
from stepgrpo.reporting.report import paired_gain, stored_evaluations
from stepgrpo.storage.run import Run


def curve(run: Run) -> dict[str, Any]:
    """`{run_id, recipe, points: [{label, nfe, passes, seconds, reward_mean}], gain}`: the base
    evaluation at 0 NFEs, each later one at the cumulative NFEs (and forward-equivalent passes,
    None for a run stored before backward passes were recorded) of the iterations before it. The
    recipe is `scheme@completion`, prefixed `objective:` for an objective other than grpo."""
    cfg = run.config
    method = (cfg.get("completion") or {}).get("method")
    recipe = f"{(cfg.get('credit') or {}).get('scheme', '?')}@{method or 'final'}"
    objective = (cfg.get("update") or {}).get("objective", "grpo")
    if objective != "grpo":
        recipe = f"{objective}:{recipe}"
    spent: dict[int, tuple[int, float, int | None]] = {}
    nfe, seconds, passes = 0, 0.0, 0
    for row in iteration_costs(run):
        nfe, seconds = nfe + row["nfe"], seconds + row["seconds"]
        passes = None if passes is None or row["passes"] is None else passes + row["passes"]
        spent[row["iteration"]] = (nfe, seconds, passes)
    records = []
    for record in stored_evaluations(run):
        i = None if record["label"] == "base" else int(record["label"].removeprefix("iter_"))
        if i is None or i in spent:
            records.append((record, (0, 0.0, 0) if i is None else spent[i]))
    base = records[0][0] if records else None
    points = [
        {
            "label": r["label"], "nfe": n, "passes": p, "seconds": round(s, 3), "reward_mean": r["reward_mean"],
            "gain": paired_gain(base, r) if base is not None and r is not base else None,
        }
        for r, (n, s, p) in records
    ]  # fmt: skip
    gain = paired_gain(records[0][0], records[-1][0]) if len(records) > 1 else None
    return {"run_id": run.run_id, "recipe": recipe, "points": points, "gain": gain}


def compare(runs: Sequence[Run]) -> list[dict[str, Any]]:
    return [curve(run) for run in runs]


AXES = {
    "passes": "forward-equivalent passes (forwards + 2 per backward row)",
    "nfe": "transformer NFEs",
    "seconds": "seconds",
}


def axis_for(curves: list[dict[str, Any]], x: str | None) -> str:
    """The compute axis: `x`, or passes where every run recorded them (the one unit that compares
    objectives whose updates differ), else NFEs. `x=passes` on a run stored before backward passes
    were recorded is refused."""
    have = all(p["passes"] is not None for c in curves for p in c["points"])
    if x is None:
        return "passes" if have else "nfe"
    if x not in AXES:
        raise ValueError(f"--x {x!r}: one of {', '.join(AXES)}")
    if x == "passes" and not have:
        raise ValueError("--x passes: a run was stored before backward passes were recorded; use --x nfe")
    return x


def at_equal(curves: list[dict[str, Any]], x: str) -> tuple[float, list[dict[str, Any] | None]]:
    """The largest budget of `x` every run reached (the smallest of their last evaluations'), and each
    run's last evaluation within it (None where only its base is)."""
    budget = min(c["points"][-1][x] for c in curves)
    return budget, [[p for p in c["points"] if p[x] <= budget][-1] for c in curves]


def chart(curves: list[dict[str, Any]], out: Path, reward: str, x: str = "nfe") -> Path:
    """The held-out reward against cumulative training compute `x` (`AXES`), one line a run labelled
    by its id, a colour a recipe (runs of one recipe told apart by line style and marker)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--out needs matplotlib: pip install 'stepgrpo[plots]'") from None
    recipes = sorted({c["recipe"] for c in curves})
    colours = {r: plt.get_cmap("tab10")(i % 10) for i, r in enumerate(recipes)}
    styles = ["-", "--", ":", "-."]
    markers = ["o", "s", "^", "D", "v", "P"]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    nth: dict[str, int] = {}
    for c in curves:  # a colour a recipe; each run of it its own line style and marker, labelled by run id
        i = nth[c["recipe"]] = nth.get(c["recipe"], -1) + 1
        xs = [p[x] for p in c["points"]]
        ys = [p["reward_mean"] for p in c["points"]]
        ax.plot(
            xs, ys, styles[i % len(styles)], marker=markers[i % len(markers)], ms=3, color=colours[c["recipe"]],
            label=f"{c['run_id']} ({c['recipe']})", alpha=0.85,
        )  # fmt: skip
    ax.set_xlabel(f"{AXES[x]} spent on training (cumulative)")
    ax.set_ylabel(f"held-out reward ({reward})")
    ax.set_title("held-out reward at equal compute")
    ax.grid(alpha=0.3)
    ax.legend(title="run (recipe)", fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
