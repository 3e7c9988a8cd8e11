"""The GRPO loss (METHODS.md, "The policy loss"): a PPO-clip worked example, the KL term, and
ratio exactly 1 on-policy through the real rollout / re-scoring path."""

import pytest
import torch

from stepgrpo_core.loss import grpo_loss
from stepgrpo_core.rollout import rollout, step_log_prob


def test_ppo_clip_worked_example():
    # clip_range 0.2, adv_clip 5:
    # row 0: A = 2,  r = 1.5: max(-2 * 1.5, -2 * 1.2) = max(-3.0, -2.4) = -2.4  (clipped, no grad)
    # row 1: A = -1, r = 0.5: max(0.5, 0.8)                         =  0.8  (clipped, no grad)
    # row 2: A = 10 -> 5, r = 0.9: max(-4.5, -4.5)                  = -4.5  (inside, grad -5 r / 3)
    # loss = (-2.4 + 0.8 - 4.5) / 3 = -2.0333
    ratio = torch.tensor([1.5, 0.5, 0.9])
    old = torch.tensor([-1.0, -2.0, 0.5])
    new = (old + ratio.log()).requires_grad_()
    out = grpo_loss(new, old, torch.tensor([2.0, -1.0, 10.0]), clip_range=0.2, adv_clip=5.0)
    assert out.loss.item() == pytest.approx(-6.1 / 3, abs=1e-6)
    out.loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor([0.0, 0.0, -5 * 0.9 / 3]))
    assert out.clip_frac == pytest.approx(2 / 3)  # |r - 1| = 0.5, 0.5, 0.1 > 0.2?
    assert out.ratio_mean == pytest.approx(2.9 / 3, abs=1e-6)
    assert out.ratio_min == pytest.approx(0.5) and out.ratio_max == pytest.approx(1.5)
    # approx_kl = 0.5 mean(log r ^ 2)
    assert out.approx_kl == pytest.approx(0.5 * (ratio.log() ** 2).mean().item(), rel=1e-5)
    assert out.kl.item() == 0.0


def test_kl_term_worked_example():
    # mean - ref_mean = 0.2 everywhere, std 0.1: KL = 0.04 / (2 * 0.01) = 2 per row
    mean = torch.full((2, 1, 2, 2), 0.2, requires_grad=True)
    ref = torch.zeros(2, 1, 2, 2)
    std = torch.full((2, 1, 1, 1), 0.1)
    zeros = torch.zeros(2)
    out = grpo_loss(zeros, zeros, zeros, kl_beta=0.5, mean=mean, ref_mean=ref, kl_std=std)
    assert out.kl.item() == pytest.approx(2.0)
    assert out.loss.item() == pytest.approx(0.5 * 2.0)  # the policy term is 0 with A = 0
    out.loss.backward()
    assert mean.grad is not None and (mean.grad > 0).all()
    same = grpo_loss(zeros, zeros, zeros, kl_beta=0.5, mean=ref, ref_mean=ref, kl_std=std)
    assert same.kl.item() == 0.0


def test_ratio_exactly_one_on_policy():
    # rollout, then re-score the stored steps with the unchanged policy: the first inner step
    # must see ratio == 1 bit for bit, so the loss is -mean(A) and nothing is clipped.
    weight = torch.nn.Parameter(torch.tensor(0.8))

    def velocity(x, sigma, cond):
        return weight * torch.tanh(x) + cond.reshape(-1, 1, 1, 1)

    g = torch.Generator().manual_seed(0)
    sigmas = torch.tensor([1.0, 0.8, 0.5, 0.2, 0.0])
    cond = torch.tensor([0.1, -0.2, 0.3])
    with torch.no_grad():
        out = rollout(
            velocity,
            torch.randn(3, 2, 4, 4, generator=g),
            sigmas,
            cond,
            kernel="flow",
            noise=0.7,
            window=(1, 2),
            generator=g,
        )
    adv = torch.tensor([1.0, -0.5, 2.0])
    for k in (1, 2):
        new = step_log_prob(velocity, out.states, sigmas, cond, k, "flow", 0.7)
        loss = grpo_loss(
            new.log_prob,
            out.log_probs[:, k],
            adv,
            mean=new.mean,
            ref_mean=new.mean.detach(),
            kl_std=new.std,
            kl_beta=0.04,
        )
        assert loss.ratio_mean == 1.0 and loss.ratio_min == 1.0 and loss.ratio_max == 1.0
        assert loss.clip_frac == 0.0 and loss.approx_kl == 0.0 and loss.kl.item() == 0.0
        assert loss.loss.item() == pytest.approx(-adv.mean().item())
        loss.loss.backward()
        assert weight.grad is not None and weight.grad != 0
        weight.grad = None


def test_invalid_inputs():
    z = torch.zeros(3)
    with pytest.raises(ValueError, match="share a shape"):
        grpo_loss(z, torch.zeros(2), z)
    with pytest.raises(ValueError, match="needs mean, ref_mean and kl_std"):
        grpo_loss(z, z, z, kl_beta=0.04)
    with pytest.raises(ValueError, match="clip_range > 0"):
        grpo_loss(z, z, z, clip_range=0.0)


def test_zero_gradient_fraction_counts_the_clipped_side_only():
    # ratios e^0.3 (above 1 + 0.2), e^-0.3 (below 1 - 0.2), 1; advantages +, -, +, and + with low ratio.
    new = torch.tensor([0.3, -0.3, 0.0, -0.3])
    adv = torch.tensor([1.0, -1.0, 1.0, 1.0])
    out = grpo_loss(new, torch.zeros(4), adv, clip_range=0.2)
    # rows 0 (A > 0, ratio high) and 1 (A < 0, ratio low) get no gradient; row 3 is clipped but
    # the unclipped term is the max there (A > 0, ratio low), so it still has a gradient.
    assert out.zero_grad_frac == pytest.approx(2 / 4)
    assert out.clip_frac == pytest.approx(3 / 4)
    new.requires_grad_(True)
    grpo_loss(new, torch.zeros(4), adv, clip_range=0.2).loss.backward()
    assert [bool(g != 0) for g in new.grad] == [False, False, True, True]


def test_flow_grpo_kl_form_is_the_exact_kl_with_beta_times_dt():
    from stepgrpo_core.kernels import diffusion_coefficient, step_moments

    g = torch.Generator().manual_seed(0)
    x, v, dv = (torch.randn(2, 3, 4, 4, generator=g) for _ in range(3))
    sigma, sigma_next = 0.6, 0.45
    mean, std = step_moments("flow", x, v, sigma, sigma_next, 0.7)
    ref_mean, _ = step_moments("flow", x, v + 0.1 * dv, sigma, sigma_next, 0.7)
    zeros = torch.zeros(2)
    eps = diffusion_coefficient("flow", std, sigma, sigma_next)
    flow_grpo = grpo_loss(zeros, zeros, zeros, kl_beta=0.04, mean=mean, ref_mean=ref_mean, kl_std=eps)
    exact = grpo_loss(
        zeros, zeros, zeros, kl_beta=0.04 * (sigma - sigma_next), mean=mean, ref_mean=ref_mean, kl_std=std
    )
    # Flow-GRPO's expression, written out: mean_CHW((mu - mu_ref)^2) / (2 eps_t^2), eps_t = 0.7 sqrt(s / (1 - s))
    by_hand = (((mean - ref_mean) ** 2).mean(dim=(1, 2, 3)) / (2 * (0.7**2 * sigma / (1 - sigma)))).mean()
    torch.testing.assert_close(flow_grpo.kl, by_hand, rtol=1e-5, atol=0)
    torch.testing.assert_close(flow_grpo.loss, exact.loss, rtol=1e-5, atol=0)


def test_step_weights_worked_example():
    import math

    from stepgrpo_core.loss import step_weights

    # flow kernel, a = 0.7, grid [1, 0.5, 0.25, 0]: step 0's std is 0.7 sqrt(1 / (1 - 0.5)) sqrt(0.5) = 0.7
    # (s_d = sigmas[1] at s = 1), step 1's 0.7 sqrt(0.5 / 0.5) sqrt(0.25) = 0.35: weights 0.7 / 0.525
    # and 0.35 / 0.525 = 4/3 and 2/3 (mean 1 over the trained steps).
    sigmas = torch.tensor([1.0, 0.5, 0.25, 0.0])
    w = step_weights("noise", "flow", sigmas, 0.7, [0, 1])
    torch.testing.assert_close(w, torch.tensor([4 / 3, 2 / 3]))
    assert step_weights("uniform", "flow", sigmas, 0.7, [0, 1]).tolist() == [1.0, 1.0]
    # psi reads its table; one trained step always weighs 1
    w = step_weights("noise", "psi", sigmas, torch.tensor([1.0, 2.0, 3.0]), [1, 2])
    s1, s2 = 2.0 * math.sqrt(0.25), 3.0 * math.sqrt(0.25)
    torch.testing.assert_close(w, torch.tensor([s1, s2]) / ((s1 + s2) / 2))
    assert step_weights("noise", "flow", sigmas, 0.7, [2]).tolist() == [1.0]
    with pytest.raises(ValueError, match="uniform, noise"):
        step_weights("late", "flow", sigmas, 0.7, [0])
    with pytest.raises(ValueError, match="stochastic kernel"):
        step_weights("noise", "ode", sigmas, 0.7, [0])
