"""A stored run read back as typed rows: what `stepgrpo runs` and `stepgrpo inspect` print, for
scripts and notebooks too. Reading only: nothing here writes, imports a plug-in or runs code a run
names. A damaged record never stops a listing: it comes back as a `Damaged` row beside the rest.

    from stepgrpo.inspection import list_runs, evaluations, iteration_rows, diagnostics
    for row in list_runs("runs"):
        print(row.run_id, row.status, row.rewards)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stepgrpo.config import UpdateConfig
from stepgrpo.results import UpdateStats
from stepgrpo.storage.errors import StorageError
from stepgrpo.storage.publish import read_json
from stepgrpo.storage.run import Run


@dataclass(frozen=True)
class Damaged:
    """A stored record that could not be read, and why."""

    path: Path
    error: str


@dataclass(frozen=True)
class Evaluation:
    """One held-out evaluation at the run's own settings."""

    label: str  # "base" or "iter_<k>"
    reward_mean: float
    record: dict[str, Any]

    @property
    def order(self) -> int:
        return -1 if self.label == "base" else int(self.label.removeprefix("iter_"))


def evaluations(run: Run) -> tuple[list[Evaluation], list[Damaged]]:
    """The run's held-out evaluations at its own settings, oldest first (one made with other
    settings, `evaluate --set ...`, is stored under another name and left out), and the damaged."""
    found, damaged = [], []
    for path in run.record_paths(Run.EVAL_DIR):
        try:
            e = read_json(path, "evaluation record")
            evaluation = Evaluation(e["label"], float(e["reward_mean"]), e)
            evaluation.order  # noqa: B018  (a label other than base or iter_<k> is damage)
        except (StorageError, KeyError, TypeError, ValueError, AttributeError) as err:
            damaged.append(Damaged(path, str(err)))
            continue
        if path.stem == evaluation.label:
            found.append(evaluation)
    return sorted(found, key=lambda e: e.order), damaged


@dataclass(frozen=True)
class RunRow:
    """One run under a runs root (`stepgrpo runs`); `error` set when its manifest is unreadable."""

    run_id: str
    config_name: str = ""
    scheme: str = ""  # "scheme" or "scheme @ completion"
    status: str = ""  # running, finished, stopped at k/n
    created: str = ""
    checkpoints: int = 0
    iterations: int = 0
    rewards: list[Evaluation] = field(default_factory=list)
    error: str | None = None
    damaged: list[Damaged] = field(default_factory=list)  # evaluation records that could not be read


def list_runs(root: Path) -> list[RunRow]:
    """Every run directory under `root`, by name; one broken run hides no other."""
    from stepgrpo.runs import in_use

    rows = []
    for path in sorted(p for p in Path(root).glob("*") if (p / "manifest.json").is_file()):
        try:
            m = read_json(path / "manifest.json", "run manifest")
            cfg = m.get("config", {})
            run = Run(path, m)
            done = len(run.iterations("checkpoint"))
            evals, damaged = evaluations(run)
            total = int(cfg.get("run", {}).get("iterations", 0))
            method = cfg.get("completion", {}).get("method")
            scheme = str(cfg.get("credit", {}).get("scheme", "")) + (f" @ {method}" if method else "")
            # the update objective's name beside the credit where it is not the default's (PPO-clip GRPO)
            objective = (cfg.get("update") or {}).get("objective")
            if objective and objective != UpdateConfig.model_fields["objective"].default:
                scheme = f"{objective}, {scheme}"
        except (OSError, ValueError, KeyError, TypeError, AttributeError, StorageError) as err:
            rows.append(RunRow(path.name, error=str(err)))
            continue
        status = "running" if in_use(path) else "finished" if total and done >= total else f"stopped at {done}/{total}"
        total = max(total, done)  # a run extended past its first length (`--set run.iterations=...`)
        rows.append(
            RunRow(
                path.name,
                str(cfg.get("run", {}).get("name", "")),
                scheme,
                status,
                str(m.get("created_at", "")),
                done,
                total,
                evals,
                damaged=damaged,
            )
        )
    return rows


@dataclass(frozen=True)
class IterationRow:
    """What one iteration stored (`stepgrpo inspect`'s first table)."""

    iteration: int
    trajectories: int | None  # None: no rollout published
    rollout_pruned: bool
    completions: list[tuple[str, bool]]  # (stored method name, pruned)
    rewards: list[tuple[str, str, float]]  # (reward, version, mean of the final samples)
    schemes: list[str]  # the credit schemes with stored advantages
    checkpoint: str | None  # "yes", "thinned" (weights pruned) or None


def iterations(run: Run) -> list[int]:
    """The iterations with a rollout or a checkpoint stored."""
    return sorted(set(run.iterations("rollout")) | set(run.iterations("checkpoint")))


def iteration_rows(run: Run) -> list[IterationRow]:
    rewards = run.tables.read_rewards().to_pandas() if (run.path / "rewards").is_dir() else None
    advantages = run.tables.read_advantages().to_pandas() if (run.path / "advantages").is_dir() else None
    rows = []
    for i in iterations(run):
        rew: list[tuple[str, str, float]] = []
        if rewards is not None:
            sel = rewards[rewards.iteration == i]
            final = sel[sel.k == sel.k.max()] if len(sel) else sel
            rew = [(n, str(v), float(g.value.mean())) for (n, v), g in final.groupby(["reward_name", "reward_version"])]
        schemes = sorted(set(advantages[advantages.iteration == i].scheme)) if advantages is not None else []
        rollout = run.stage_manifest(i, "rollout")
        comps = [(c, bool(run.pruned(i, f"completions/{c}"))) for c in run.published_completions(i)]
        checkpoint = None
        if run.stage_manifest(i, "checkpoint"):
            checkpoint = "thinned" if run.pruned(i, "checkpoint") else "yes"
        rows.append(
            IterationRow(
                i,
                int(rollout["counts"]["trajectories"]) if rollout else None,
                bool(run.pruned(i, "rollout")),
                comps,
                rew,
                schemes,
                checkpoint,
            )
        )
    return rows


@dataclass(frozen=True)
class DiagnosticsRow:
    """The learning diagnostics of one trained iteration: the update's statistics and the
    training reward's summary (`stepgrpo.loops.scoring.reward_summary`; empty when the run's
    reward has no stored rows)."""

    iteration: int
    stats: UpdateStats
    score: dict[str, Any]


def diagnostics(run: Run, reward: str | None) -> tuple[list[DiagnosticsRow], list[Damaged], str | None]:
    """Every checkpointed iteration's diagnostics, the damaged states, and the signal watch's
    warning (`stepgrpo.reporting.report.SignalWatch`) if the run's gradients read as noise."""
    import torch
    from pydantic import ValidationError

    from stepgrpo.loops.scoring import reward_summary
    from stepgrpo.reporting.report import SignalWatch

    rows, damaged = [], []
    watch, warning = SignalWatch(), None
    for i in iterations(run):
        try:
            stats = UpdateStats.model_validate(run.checkpoint_state(i)["update"])
        except FileNotFoundError:
            continue
        except (StorageError, KeyError, TypeError, ValidationError) as err:
            damaged.append(Damaged(run.stage_path(i, "checkpoint") / "state.json", str(err)))
            continue
        score: dict[str, Any] = {}
        names = (
            set(run.tables.read_rewards(i).column("reward_name").to_pylist())
            if run.stage_manifest(i, "rollout")
            else set()
        )
        if reward in names:
            groups = torch.from_numpy(run.stages.read_array(i, "rollout", "group_ids")).long()
            score = reward_summary(
                run.tables.reward_grid(i, reward), run.tables.reward_grid(i, reward, field="strict"), groups
            )
        rows.append(DiagnosticsRow(i, stats, score))
        warning = warning or watch.see(i, stats)
    return rows, damaged, warning


@dataclass(frozen=True)
class QualityCheck:
    """One stored credit-quality check (`stepgrpo credit-quality`): per scheme its corrected
    gradient cosine, and its paired difference to outcome with the 95 % interval."""

    iteration: int
    continuations: int
    groups: int
    rows: list[dict[str, Any]]


def quality_checks(run: Run) -> tuple[list[QualityCheck], list[Damaged]]:
    checks, damaged = [], []
    for path in run.record_paths(Run.QUALITY_DIR, "iter_*"):
        try:
            c = read_json(path, "credit-quality record")
            checks.append(
                QualityCheck(int(c["iteration"]), c["continuations"], c["groups"], c["gradient"]["uniform"]["rows"])
            )
        except (StorageError, KeyError, TypeError, ValueError) as err:
            damaged.append(Damaged(path, str(err)))
    return checks, damaged


def run_json(run: Run) -> dict[str, Any]:
    """The run for scripts (`stepgrpo inspect --json`): each iteration's NFEs and seconds per stage
    (`stepgrpo.reporting.costs.iteration_costs`), each trained iteration's learning diagnostics (the
    update's `UpdateStats`: loss terms, clipping by optimizer step and trained step, the signal
    check, the weights' movement; what `inspect`'s diagnostics table shows) and every evaluation's
    headline numbers."""
    from stepgrpo.reporting.costs import iteration_costs

    keep = ("label", "reward_mean", "reward_strict", "prompts", "seeds", "nfe", "seconds")
    evals = []
    for path in run.record_paths(Run.EVAL_DIR):
        e = read_json(path, "evaluation record")
        if isinstance(e, dict) and "reward_mean" in e:
            evals.append({k: e.get(k) for k in keep})
    cfg = run.config
    return {
        "run_id": run.run_id,
        "run_dir": str(run.path),
        "scheme": (cfg.get("credit") or {}).get("scheme"),
        "completion": (cfg.get("completion") or {}).get("method"),
        "reward": (cfg.get("reward") or {}).get("name"),
        "iterations": iteration_costs(run),
        "diagnostics": [
            {"iteration": r.iteration, **r.stats.model_dump(mode="json")} for r in diagnostics(run, None)[0]
        ],
        "evaluations": evals,
    }


def training_images(run: Run, iteration: int) -> tuple[Any, list[str]]:
    """The final samples a training iteration stored (`iter_<k>/images/`, decoded when it was
    scored), `[B, 3, H, W]` uint8, each captioned with its prompt and its reward(s)."""
    from stepgrpo.prompts import stored_prompts
    from stepgrpo.storage.errors import NotPublishedError

    sources = ["rollout", *(f"completions/{m}" for m in run.published_completions(iteration))]
    found = next(
        (d for src in sources if run.stage_manifest(iteration, src) and (d := run.stages.read_images(iteration, src))),
        None,
    )
    if found is None:
        raise NotPublishedError(
            f"run {run.run_id} iteration {iteration} stores no decoded images (storage.images: false, pruned, or "
            "not scored yet): `stepgrpo rescore` of that iteration decodes and stores them"
        )
    images = found.images[:, -1]  # the last stored state of each trajectory: its final sample
    ids = run.stages.read_array(iteration, "rollout", "prompt_ids")
    prompts = stored_prompts(run).texts_of(ids)
    rewards = run.tables.read_rewards(iteration).to_pandas() if (run.path / "rewards").is_dir() else None
    captions = []
    for b, prompt in enumerate(prompts):
        scores = ""
        if rewards is not None:
            rows = rewards[(rewards.traj == b) & (rewards.k == rewards.k.max())]
            scores = " ".join(f"{n} {v:.3f}" for n, v in zip(rows.reward_name, rows.value))
        captions.append(f"{prompt} | {scores}" if scores else prompt)
    return images, captions
