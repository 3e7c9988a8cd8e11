"""Compute counted as spent, and gains read at equal compute.

A record's passes per iteration (forwards, and 2 a backward row: `stepgrpo.reporting.costs`), as
its stages ran them or, for a GRPO record made before they were stored, rebuilt from what its config
ran; the held-out gain of one record over another, per prompt (each run paired with its own base,
so runs whose initial noises differ compare prompt by prompt); and one arm against a reference read
at the reference's evaluation nearest the arm's passes.
"""

from __future__ import annotations

import functools
from typing import Any

from bench._lib.common import ROOT
from bench._lib.stats import by_prompt, pooled


def grpo_passes(r: dict[str, Any]) -> list[int]:
    """A GRPO record's passes per iteration: stored as its stages ran, or, for a record made before
    they were, rebuilt from what its config ran (`rebuilt_passes`)."""
    if "passes" in r:
        return list(r["passes"])
    return rebuilt_passes(r["argv"], r["nfe"])


def rebuilt_passes(argv: list[str], nfe: list[int]) -> list[int]:
    """The passes of a GRPO record stored with NFEs alone (`nfe`: the rollout's, the completion's
    and the update's forwards, as `bench._lib.common.read_run` summed them then: without the ODE
    reference's), from what the config of `argv` ran: the rollout's `B T` forwards, the ODE
    reference's (`reference_passes`, not in `nfe`), no completion forwards (final-only, or the
    rollout's own x0 predictions; any other completion is refused), and the update's forwards
    `U = nfe - B T`, one backward for each of the policy's (`U / 2` with the KL's base forwards):
    passes = nfe + reference + 2 backward. `tests/test_bench_frontier.py` runs iteration 0 of each
    GRPO recipe read here and compares."""
    from stepgrpo.reporting.costs import BACKWARD_PASSES

    rollout, reference, per_backward = _what_ran(tuple(argv))
    return [n + reference + BACKWARD_PASSES * ((n - rollout) // per_backward) for n in nfe]


@functools.lru_cache
def _what_ran(argv: tuple[str, ...]) -> tuple[int, int, int]:
    """(rollout forwards, ODE reference forwards, update forwards per backward) an iteration of `argv`."""
    from stepgrpo.config import load_config
    from stepgrpo_core.completions import COMPLETIONS, Method

    cfg = load_config(ROOT / argv[0], list(argv[1:]))
    method = cfg.completion.method
    if method is not None and not COMPLETIONS.facts(Method.parse(method).name)["rollout_velocity"]:
        raise ValueError(f"{list(argv)}: completion {method!r} spends forwards a record's NFEs do not separate")
    rollout = cfg.run.prompts_per_iteration * cfg.run.group_size * cfg.sampler.steps
    return rollout, reference_passes(list(argv)), 2 if cfg.optim.kl_beta > 0 else 1


def reference_passes(argv: list[str]) -> int:
    """The passes an iteration of the run with `argv` spent on its ODE reference (the ODE sample of
    each distinct initial noise, `stepgrpo.loops.sampling.sample_groups`): a diagnostic in every run
    compared here, whose credit (outcome, or step rewards from the rollout's own x0 predictions)
    does not read it. A deterministic rollout is its own reference, and `sampler.ode_reference: false`
    samples none (0)."""
    from stepgrpo.config import load_config
    from stepgrpo_core.kernels import KERNELS

    cfg = load_config(ROOT / argv[0], argv[1:])
    sp = cfg.sampler
    if not sp.ode_reference or (sp.sde_solver is None and KERNELS.facts(sp.kernel)["deterministic"]):
        return 0
    return sp.steps * cfg.run.prompts_per_iteration * (1 if sp.shared_x0 else cfg.run.group_size)


def by_prompt_gain(r: dict[str, Any], it: int) -> list[float] | None:
    """The record's held-out gain at `it` over its own base, per prompt (averaged over the noise
    seeds): paired within the run, so runs whose initial noises differ compare prompt by prompt."""
    e, b = r["evals"].get(str(it)), r["evals"].get("0")
    if e is None or b is None:
        return None
    P = int(e["prompts"])
    return [x - y for x, y in zip(by_prompt(e["scores"], P), by_prompt(b["scores"], P))]


def contrast(a: dict[str, Any], ia: int, b: dict[str, Any] | None, ib: int) -> dict[str, Any] | None:
    """Gain of `a` at `ia` minus gain of `b` at `ib` (`b` None: `a`'s gain alone), per prompt."""
    ga = by_prompt_gain(a, ia)
    gb = by_prompt_gain(b, ib) if b is not None else [0.0] * len(ga or [])
    if ga is None or gb is None or len(ga) != len(gb):
        return None
    d = [x - y for x, y in zip(ga, gb)]
    return {"mean": sum(d) / len(d), "prompts": d}


def equal_compute(o: dict[str, Any], cost: float, tolerance: float = 0.15, less: int = 0) -> int | None:
    """outcome's evaluation nearest `cost` cumulative passes, when within `tolerance` of it (`less`:
    passes an iteration not charged to outcome)."""
    p = [x - less for x in grpo_passes(o)]
    its = [int(i) for i in o["evals"] if int(i) > 0]
    near = min(its, key=lambda i: abs(sum(p[:i]) - cost))
    return near if abs(sum(p[:near]) / cost - 1) <= tolerance else None


def at_equal_compute(
    rec: dict[tuple[str, int], dict[str, Any]],
    arm: str,
    ref: str,
    seeds: int,
    every: int,
    N: int,
    less: tuple[int, int] = (0, 0),
    every_seed: bool = True,
) -> dict[str, Any] | None:
    """`arm` minus the GRPO record `ref` at equal passes: the arm at its latest evaluation that every
    seed's `ref` record reaches within 15 % (`equal_compute`), pooled over the seeds (`every_seed`
    False: the latest that some seeds' records reach, pooled over those). `less`: passes an
    iteration not charged to the arm and to `ref` (`reference_passes`)."""
    have = [k for k in range(seeds) if (arm, k) in rec and (ref, k) in rec]
    for e in range(N - N % every, 0, -every):
        rows, read = {}, []
        for k in have:
            a, o = rec[arm, k], rec[ref, k]
            spent = sum(a["passes"][:e]) - less[0] * e
            near = equal_compute(o, spent, less=less[1])
            if near is not None and (c := contrast(a, e, o, near)):
                rows[k] = c
                read.append([near, round((sum(grpo_passes(o)[:near]) - less[1] * near) / spent, 3)])
        if rows and (len(rows) == len(have) or not every_seed):
            v = pooled(rows)
            return v | {"at": e, "outcome_read_at": read, "beats": bool(v["prompts"]["lo"] > 0)}
    return None


def fmt_pooled(v: dict[str, Any] | None) -> str:
    if not v:
        return "n/a"
    p, t = v["prompts"], v["seeds"]
    each = ", ".join(f"{x:+.3f}" for x in v["per_seed"].values())
    return (
        f"{p['mean']:+.3f} [{p['lo']:+.3f}, {p['hi']:+.3f}] (per seed {each}; t over the {v['n']} seeds "
        f"[{t['lo']:+.3f}, {t['hi']:+.3f}])"
    )
