"""The flow-matching update objectives (stepgrpo_core.objectives) against plain loops written from
the formulas (docs/METHODS.md, "Update objectives"): one row at a time, no broadcasting."""

from __future__ import annotations

import math

import pytest
import torch

from stepgrpo_core.objectives import OBJECTIVES, MatchingBatch, awm_log_prob, noised

N, C, H, W = 6, 2, 3, 3


def batch(seed: int = 0, with_old: bool = True) -> MatchingBatch:
    g = torch.Generator().manual_seed(seed)
    r = lambda: torch.randn(N, C, H, W, generator=g, dtype=torch.float64)  # noqa: E731
    return MatchingBatch(
        x0=r(),
        eps=r(),
        t=torch.rand(N, generator=g, dtype=torch.float64) * 0.9 + 0.05,
        advantages=torch.randn(N, generator=g, dtype=torch.float64) * 4,
        v=r().requires_grad_(),
        v_old=r() if with_old else None,
        v_ref=r(),
        v_ema=r(),
    )


def mean_sq(x: torch.Tensor) -> float:
    return float((x**2).mean())


def nft_by_hand(b: MatchingBatch, beta: float, adv_clip: float, kl_beta: float) -> float:
    total = 0.0
    for i in range(N):
        t = float(b.t[i])
        x_t = (1 - t) * b.x0[i] + t * b.eps[i]
        a = min(max(float(b.advantages[i]), -adv_clip), adv_clip)
        r = min(max(0.5 + a / (2 * adv_clip), 0.0), 1.0)
        v, old = b.v[i].detach(), b.v_old[i]
        x0_pos = x_t - t * (beta * v + (1 - beta) * old)
        x0_neg = x_t - t * ((1 + beta) * old - beta * v)
        w_pos = max(float((x0_pos - b.x0[i]).abs().mean()), 1e-5)
        w_neg = max(float((x0_neg - b.x0[i]).abs().mean()), 1e-5)
        row = (r * mean_sq(x0_pos - b.x0[i]) / w_pos + (1 - r) * mean_sq(x0_neg - b.x0[i]) / w_neg) / beta
        total += adv_clip * row / N + kl_beta * mean_sq(v - b.v_ref[i]) / N
    return total


@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_nft_equals_its_formula_row_by_row(beta):
    b = batch()
    out = OBJECTIVES.get("nft")(b, beta=beta)
    assert out.loss.item() == pytest.approx(nft_by_hand(b, beta, 5.0, 1e-4), rel=1e-10)


def test_nft_pulls_toward_good_samples_and_needs_the_old_policy():
    b = batch()
    b.advantages = torch.full((N,), 5.0, dtype=torch.float64)  # r = 1: only the positive branch
    out = OBJECTIVES.get("nft")(b, kl_beta=0.0)
    out.loss.backward()
    x0_pos = noised(b.x0, b.eps, b.t) - b.t.reshape(-1, 1, 1, 1) * b.v  # beta = 1: v+ = v
    # the gradient moves v+ so that x_t - t v+ approaches x0 (a step against it lowers the error)
    with torch.no_grad():
        stepped = b.v - 1e-3 * b.v.grad
        after = noised(b.x0, b.eps, b.t) - b.t.reshape(-1, 1, 1, 1) * stepped
    assert mean_sq(after - b.x0) < mean_sq(x0_pos.detach() - b.x0)
    with pytest.raises(ValueError, match="v_old"):
        OBJECTIVES.get("nft")(batch(with_old=False))


def awm_by_hand(b: MatchingBatch, weighting: str, power: float, kl_beta: float, ema_beta: float) -> float:
    total = 0.0
    for i in range(N):
        t = float(b.t[i])
        err = mean_sq(b.v[i].detach() - (b.eps[i] - b.x0[i]))
        lp = {"uniform": -err, "t": -err * t, "t**2": -err * t * t}.get(weighting)
        if weighting == "ghuber":
            lp = -((err + 1e-10) ** power - 1e-10**power) * t / power
        a = min(max(float(b.advantages[i]), -5.0), 5.0) / 5.0
        total += -a * math.exp(lp - lp) / N  # on-policy: the ratio is 1
        total += (
            kl_beta * mean_sq(b.v[i].detach() - b.v_ref[i]) / N + ema_beta * mean_sq(b.v[i].detach() - b.v_ema[i]) / N
        )
    return total


@pytest.mark.parametrize("weighting", ["ghuber", "uniform", "t", "t**2"])
def test_awm_equals_its_formula_row_by_row_and_its_gradient_is_the_weighted_likelihood(weighting):
    b = batch(1)
    out = OBJECTIVES.get("awm")(b, weighting=weighting)
    assert out.loss.item() == pytest.approx(awm_by_hand(b, weighting, 0.25, 1e-3, 1.0), rel=1e-10)
    # on-policy the policy term's gradient is -mean(A grad log p): compare with autograd of that
    out.loss.backward()
    got = b.v.grad.clone()
    v = b.v.detach().clone().requires_grad_()
    a = b.advantages.clamp(-5, 5) / 5
    want = -(a * awm_log_prob(v, b.x0, b.eps, b.t, weighting, 0.25)).mean()
    want = (
        want + 1e-3 * ((v - b.v_ref) ** 2).mean(dim=(1, 2, 3)).mean() + ((v - b.v_ema) ** 2).mean(dim=(1, 2, 3)).mean()
    )
    want.backward()
    torch.testing.assert_close(got, v.grad, rtol=1e-9, atol=1e-12)


def test_each_row_carries_its_own_advantage():
    """Step credit inside the objectives: row (sample, time) is weighted by its own advantage, so
    changing one row's advantage changes that row's gradient only."""
    for name in ("nft", "awm"):
        grads = []
        for bump in (0.0, 2.0):
            b = batch(2)
            b.advantages = b.advantages.clone()
            b.advantages[3] += bump
            OBJECTIVES.get(name)(b).loss.backward()
            grads.append(b.v.grad.clone())
        moved = [(grads[0][i] - grads[1][i]).abs().max().item() > 0 for i in range(N)]
        assert moved == [i == 3 for i in range(N)], name


def test_the_objectives_declare_what_the_update_must_evaluate():
    assert OBJECTIVES.facts("dgpo")["whole_groups"] and OBJECTIVES.facts("dgpo")["needs_ref"] is True
    assert OBJECTIVES.facts("grpo")["rows"] == "transitions" and not OBJECTIVES.facts("grpo")["keeps_zero_advantage"]
    assert OBJECTIVES.facts("nft")["needs_old"] and not OBJECTIVES.facts("nft")["needs_ema"]
    assert OBJECTIVES.facts("awm")["needs_ema"] and not OBJECTIVES.facts("awm")["needs_old"]
    with pytest.raises(ValueError, match="weighting"):
        OBJECTIVES.get("awm")(batch(), weighting="huber")


def test_grid_times_follow_the_authors_rules():
    from stepgrpo_core.objectives import grid_times, times_count

    g = torch.Generator().manual_seed(0)
    ks = grid_times("random", 0.99, 10, 5, g)  # DiffusionNFT: 9 of 10, each sample its own draw
    assert ks.shape == (5, 9)
    assert all(len(set(row.tolist())) == 9 and max(row) <= 9 for row in ks)
    assert len({tuple(row.tolist()) for row in ks}) > 1
    ks = grid_times("stratified", 6, 14, 4, g)  # AWM discrete_wo_init: strata of [1, 14)
    strata = [(1, 3), (3, 5), (5, 7), (7, 9), (9, 11), (11, 14)]
    assert all(lo <= int(k) < hi for k, (lo, hi) in zip(ks[0], strata))
    assert bool((ks == ks[0]).all())  # one draw for the batch
    ks = grid_times("stratified", 6, 14, 2, g, span=0.9)  # its timestep_fraction 0.9: strata of [1, 12)
    strata = [(1, 2), (2, 4), (4, 6), (6, 8), (8, 10), (10, 12)]
    assert all(lo <= int(k) < hi for k, (lo, hi) in zip(ks[0], strata))
    with pytest.raises(ValueError, match=r"update.times: 6 stratified grid times over steps 1..3"):
        times_count("stratified", 6, 4)


def test_step_credit_takes_the_advantage_of_the_step_at_the_rows_grid_time():
    from stepgrpo_core.objectives import row_advantages

    adv = torch.tensor([[1.0, 2.0, float("nan"), 4.0], [5.0, 6.0, 7.0, 8.0]])
    steps = torch.tensor([[3, 2, 0], [1, 1, 2]])
    assert row_advantages(adv, steps).tolist() == [[4.0, 0.0, 1.0], [6.0, 6.0, 7.0]]
    outcome = torch.tensor([[0.5] * 4, [-1.0] * 4])  # outcome credit: the papers' one advantage a sample
    assert row_advantages(outcome, steps).tolist() == [[0.5] * 3, [-1.0] * 3]


def test_the_companion_follows_the_authors_decay():
    from stepgrpo_core.objectives import companion_update

    companion, weights = {"w": torch.zeros(2)}, {"w": torch.ones(2)}
    assert companion_update(companion, weights, 1, 0.001, 0.5) == 0.001  # d = min(rate step, cap)
    torch.testing.assert_close(companion["w"], torch.full((2,), 0.999))
    assert companion_update(companion, weights, 900, 0.001, 0.5) == 0.5


def test_the_update_weights_each_row_by_its_steps_advantage_at_that_steps_time(tmp_path, monkeypatch):
    """The update stage's loop (`training.update`) on the tiny model: every row the
    objective sees is noised to `sigmas[k]` of a step k and carries the scheme's advantage of
    step k for its sample."""
    from stepgrpo.config import load_config
    from stepgrpo.loops import training, workspace
    from stepgrpo.loops.sampling import encode
    from stepgrpo.shapes.model import build_pipeline, tiny_spec
    from stepgrpo_core import objectives

    path = tmp_path / "tiny"
    build_pipeline(tiny_spec(), seed=0).save_pretrained(str(path))
    cfg = load_config(
        None,
        [f"model.path={path}", "model.lora_rank=4", "model.guidance_scale=1.0", "sampler.steps=4",
         "sampler.kernel=ode", "sampler.shared_x0=false", "update.objective=nft", "update.times=3",
         "optim.micro_batch=2", "run.prompts_per_iteration=2", "run.group_size=2"],
    )  # fmt: skip
    pol = workspace.policy(cfg)
    workspace.set_lora(pol, workspace.initial_lora(cfg))
    B, T = 4, 4
    sigmas = pol.sigmas(T)
    adv = torch.tensor([[10.0 * i + k for k in range(T)] for i in range(B)])  # (sample i, step k) -> 10 i + k
    seen = []
    real = objectives.OBJECTIVES.get("nft")

    def spy(b, **options):
        seen.append((b.x0.clone(), b.t.clone(), b.advantages.clone()))
        return real(b, **options)

    monkeypatch.setitem(objectives.OBJECTIVES._items, "nft", spy)
    g = torch.Generator().manual_seed(0)
    states = torch.randn(B, T + 1, *pol.latent_shape, generator=g)
    batch = training.Batch(
        states=states,
        old_log_probs=torch.full((B, T), float("nan")),
        advantages=adv,
        group_ids=torch.tensor([0, 0, 1, 1]),
        cond=encode(pol, ["a red circle", "two blue squares"], [0, 0, 1, 1]),
        sigmas=sigmas,
        kernel="ode",
        noise=0.0,
    )
    opt = training.make_optimizer(pol.trainable_parameters(), cfg)
    companion = workspace.lora_state(pol)
    out = training.update(pol, opt, cfg, batch, torch.Generator().manual_seed(1), companion)
    assert out["rows"] == B * 3 and len(seen) == 3 * 2  # 3 times x 2 micro-batches of 2 samples
    grid = sigmas[:T].tolist()
    for x0, t, a in seen:
        for r in range(len(t)):
            i = next(i for i in range(B) if torch.equal(x0[r], states[i, -1]))  # the row's sample
            k = min(range(T), key=lambda k: abs(grid[k] - float(t[r])))
            assert float(t[r]) == pytest.approx(grid[k], abs=1e-7)  # a grid time
            assert float(a[r]) == 10.0 * i + k  # that step's advantage of that sample


def dgpo_by_hand(b: MatchingBatch, groups: list[int], beta_dpo: float, adv_clip: float, clip: float, kl_beta: float):
    """DGPO's loss from the formula: a plain loop over the groups, then over the rows."""
    target = [b.eps[i] - b.x0[i] for i in range(N)]
    d = [mean_sq(b.v[i].detach() - target[i]) for i in range(N)]
    d_ref = [mean_sq(b.v_ref[i] - target[i]) for i in range(N)]
    d_old = [mean_sq(b.v_old[i] - target[i]) for i in range(N)]
    a = [min(max(float(b.advantages[i]), -adv_clip), adv_clip) for i in range(N)]
    s = {}
    for g in set(groups):
        members = [i for i in range(N) if groups[i] == g]
        s[g] = sum(beta_dpo * a[i] * (d[i] - d_ref[i]) / len(members) for i in members)
    total, clipped = 0.0, []
    for i in range(N):
        ratio = math.exp(d_old[i] - d[i])
        clipped.append(ratio > 1 + clip if a[i] > 0 else ratio < 1 - clip)
        w = 1 / (1 + math.exp(-s[groups[i]]))
        total += w * a[i] * d[i] / N + kl_beta * mean_sq(b.v[i].detach() - b.v_ref[i]) / N
    return total, clipped


@pytest.mark.parametrize("clip", [1e-2, 0.3])
def test_dgpo_equals_a_plain_loop_over_its_groups(clip):
    """The loss value and which rows the clip stops, and the gradient: sigmoid(s_G) A_i grad d_i
    for the rows the clip lets through, none for the others (s_G is a constant of the step)."""
    groups = [0, 0, 0, 1, 1, 1]
    b = batch()
    b.groups = torch.tensor(groups)
    g = torch.Generator().manual_seed(3)
    b.v_old = b.v.detach() + 0.05 * torch.randn(N, C, H, W, dtype=torch.float64, generator=g)
    out = OBJECTIVES.get("dgpo")(b, clip_range=clip)
    expected, clipped = dgpo_by_hand(b, groups, 101.0, 5.0, clip, 0.02)
    assert out.loss.item() == pytest.approx(expected, rel=1e-9)
    assert out.stats["clip_frac"] == pytest.approx(sum(clipped) / N)
    assert 0 < sum(clipped) < N or clip == 0.3  # the small clip stops some rows, not all
    b.v.grad = None
    OBJECTIVES.get("dgpo")(b, clip_range=clip, kl_beta=0.0).loss.backward()
    for i in range(N):
        if clipped[i]:
            assert float(b.v.grad[i].abs().max()) == 0.0
        else:
            assert float(b.v.grad[i].abs().max()) > 0.0


def test_dgpo_needs_every_member_of_a_group_and_its_references():
    b = batch()
    with pytest.raises(ValueError, match="groups"):
        OBJECTIVES.get("dgpo")(b)
    b.groups = torch.tensor([0, 0, 0, 1, 1, 1])
    b.v_ref = None
    with pytest.raises(ValueError, match="base model"):
        OBJECTIVES.get("dgpo")(b)


def test_dgpo_weights_a_group_by_how_far_it_already_moved():
    """s_G rises with the advantage-weighted error above the reference: a group whose good samples
    the policy fits worse than the base (d > d_ref for A > 0) weighs more than one fitted better."""
    b = batch()
    b.groups = torch.tensor([0, 0, 0, 1, 1, 1])
    b.advantages = torch.tensor([1.0, -1.0, 0.0, 1.0, -1.0, 0.0], dtype=torch.float64)
    target = b.eps - b.x0
    v = target.clone()
    v[0] += 0.5  # group 0's good sample: worse than the reference, which fits it exactly
    v[3] += 0.0
    b.v_ref = target.clone()
    b.v_ref[3] += 0.5  # group 1's good sample: better than the reference
    b.v, b.v_old = v.requires_grad_(), v.detach()
    out = OBJECTIVES.get("dgpo")(b, beta_dpo=10.0)
    # s_0 = 10 / 3 * (1 * (0.25 - 0)), s_1 = 10 / 3 * (1 * (0 - 0.25)): each group's weight on its 3 rows
    sigmoid = lambda s: 1 / (1 + math.exp(-s))  # noqa: E731
    assert out.stats["preference_weight"] == pytest.approx((sigmoid(10 * 0.25 / 3) + sigmoid(-10 * 0.25 / 3)) / 2)


def test_whole_groups_stay_whole_in_parts_micro_batches_and_ranks():
    from stepgrpo.loops.batching import DataParallel
    from stepgrpo.loops.rows import group_batches, group_parts

    gids = torch.arange(7).repeat_interleave(3)  # 7 groups of 3
    rows = torch.arange(21)
    parts = group_parts(rows, gids, 3, torch.Generator().manual_seed(0))
    assert sorted(torch.cat(parts).tolist()) == list(range(21))
    seen = []
    for part in parts:
        for mb in group_batches(part, gids, 7):  # at most 7 rows: two groups a micro-batch
            assert len(mb) <= 7
            for g in set(gids[mb].tolist()):
                assert int((gids[mb] == g).sum()) == 3  # every member of each group it holds
            for r in range(2):
                mine = DataParallel(r, 2).whole(group_batches(part, gids, 7))
                seen += [(r, g) for c in mine for g in gids[c].tolist()]
    owners = {}
    for r, g in seen:
        owners.setdefault(g, set()).add(r)
    assert all(len(o) == 1 for o in owners.values())  # a group is one rank's


def test_the_update_loop_reads_facts_never_an_objective_name():
    """No module of the update branches on an objective's name or the old `matching` switch: the
    objectives differ only through their registry facts."""
    import ast
    from pathlib import Path

    import stepgrpo.loops as loops

    names = set(OBJECTIVES.names())
    for module in ("training.py", "rows.py", "update.py", "reference.py"):
        tree = ast.parse((Path(loops.__file__).parent / module).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert node.value not in names, f"{module}: the objective name {node.value!r} in the update's code"
            if isinstance(node, ast.Attribute):
                assert node.attr != "matching", f"{module}: branches on update.matching"


@pytest.mark.parametrize("objective", OBJECTIVES.names())
def test_every_objective_trains_through_the_one_loop(objective, tmp_path, monkeypatch):
    """Each registered objective, GRPO included, takes one AdamW step on the tiny model through
    `training.update`: the weights move, the loss is finite, every trained row went backward; where
    it reads whole groups, every call holds whole groups whose rows share their time and noise."""
    from stepgrpo.config import load_config
    from stepgrpo.loops import training, workspace
    from stepgrpo.loops.sampling import encode
    from stepgrpo.shapes.model import build_pipeline, tiny_spec

    path = tmp_path / "tiny"
    build_pipeline(tiny_spec(), seed=0).save_pretrained(str(path))
    on_transitions = OBJECTIVES.facts(objective)["rows"] == "transitions"
    sampler = ["sampler.kernel=flow", "sampler.noise=0.7"]
    if not on_transitions:
        sampler = ["sampler.kernel=ode", "sampler.shared_x0=false"]
    times = [] if on_transitions else ["update.times=2", "update.time_span=1.0"]
    cfg = load_config(
        None,
        [f"model.path={path}", "model.lora_rank=4", "model.guidance_scale=1.0", "sampler.steps=4", *sampler,
         f"update.objective={objective}", *times, "optim.micro_batch=4", "optim.optimizer_steps=1",
         "run.prompts_per_iteration=2", "run.group_size=2"],
    )  # fmt: skip
    pol = workspace.policy(cfg)
    workspace.set_lora(pol, workspace.initial_lora(cfg))
    from stepgrpo.loops.sampling import generator, iteration_plan, sample_iteration
    from stepgrpo.prompts import prompt_source

    prompts = prompt_source(cfg)
    plan = iteration_plan(cfg, prompts.splits, 0)
    chunks = list(sample_iteration(pol, cfg, prompts.texts, plan, 0, cfg.sampler.noise))
    states = torch.cat([c.sde.states for c in chunks])
    B, T = states.shape[0], cfg.sampler.steps
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5]).unsqueeze(1).expand(B, T).clone()
    batch = training.Batch(
        states, torch.cat([c.sde.log_probs for c in chunks]), adv, torch.from_numpy(plan.group_ids),
        encode(pol, prompts.texts, plan.prompt_ids), pol.sigmas(T), cfg.sampler.kernel, cfg.sampler.noise,
    )  # fmt: skip
    opt = training.make_optimizer(pol.trainable_parameters(), cfg)
    companion = workspace.lora_state(pol) if workspace.companion_group(cfg) else None
    before = workspace.lora_state(pol)
    seen, real = [], OBJECTIVES.get(objective)

    def spy(b, **options):
        seen.append(b)
        return real(b, **options)

    if not on_transitions:
        monkeypatch.setitem(OBJECTIVES._items, objective, spy)
    out = training.update(pol, opt, cfg, batch, generator(0, "update", 0), companion)
    if OBJECTIVES.facts(objective)["whole_groups"]:
        assert seen
        for b in seen:
            for g in set(b.groups.tolist()):
                rows = (b.groups == g).nonzero().reshape(-1)
                assert len(rows) == cfg.run.group_size
                assert bool((b.t[rows] == b.t[rows[0]]).all()) and bool((b.eps[rows] == b.eps[rows[0]]).all())
    assert math.isfinite(out["loss"]) and out["optimizer_steps"] == 1.0
    assert out["backward_rows"] > 0 and out["trained_trajectories"] == B
    after = workspace.lora_state(pol)
    assert any(not torch.equal(before[n], after[n]) for n in before)
