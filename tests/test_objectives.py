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
    """The update stage's loop (`training.update_matching`) on the tiny model: every row the
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
    out = training.update_matching(pol, opt, cfg, batch, torch.Generator().manual_seed(1), companion)
    assert out["rows"] == B * 3 and len(seen) == 3 * 2  # 3 times x 2 micro-batches of 2 samples
    grid = sigmas[:T].tolist()
    for x0, t, a in seen:
        for r in range(len(t)):
            i = next(i for i in range(B) if torch.equal(x0[r], states[i, -1]))  # the row's sample
            k = min(range(T), key=lambda k: abs(grid[k] - float(t[r])))
            assert float(t[r]) == pytest.approx(grid[k], abs=1e-7)  # a grid time
            assert float(a[r]) == 10.0 * i + k  # that step's advantage of that sample
