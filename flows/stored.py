"""The Python entry's calls on stored runs that run no flow (`stepgrpo.flows.api` hands them on):
`export` a run's weights with their model card, and `compare` runs at equal compute. Light to
import: what they use is imported when they are called."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def export(
    run: str | Path,
    *,
    iteration: int | None = None,
    out: str | Path | None = None,
    push_to_hub: str | None = None,
    private: bool = False,
) -> Path:
    """Write `run`'s export again (lora/: weights, model card, samples, config; the weights rebuilt if
    lora/ was deleted), or checkpoint `iteration`'s into `out`; with `push_to_hub` (`owner/name`)
    upload it. Returns the export's folder."""
    from stepgrpo.loops.update import export_iteration
    from stepgrpo.reporting.card import push_to_hub as push
    from stepgrpo.runs import open_stored, owned

    stored, cfg = open_stored(str(run))
    with owned(stored.path):
        folder = export_iteration(stored, cfg, iteration, Path(out) if out is not None else None)
    if push_to_hub is not None:
        push(folder, push_to_hub, private, f"stepgrpo export of run {stored.run_id}")
    return folder


def compare(runs: Sequence[str | Path], *, x: str | None = None) -> dict[str, Any]:
    """`runs` at equal compute: `{"axis", "budget", "runs": each run's curve (held-out reward
    against compute), "read": each run's evaluation at the largest budget every run reached, with its
    paired gain over its base}`; `x`: passes, nfe or seconds (default passes where every run has them)."""
    from stepgrpo.reporting.compare import at_equal, axis_for
    from stepgrpo.reporting.compare import compare as curves_of
    from stepgrpo.storage.run import Run, find_run

    curves = curves_of([Run.open(find_run(str(r))) for r in runs])
    axis = axis_for(curves, x)
    budget, read = at_equal(curves, axis)
    return {"axis": axis, "budget": budget, "runs": curves, "read": read}
