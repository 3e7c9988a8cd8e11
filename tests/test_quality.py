"""The credit-quality check's math on a case with a known answer (METHODS.md, "Judging credit").

The policy is the exact flow towards one data point `theta` (`stepgrpo_core.analytic`), a learnable
parameter, and the reward is linear in the final latent. Every kernel mean is affine in the state,
so `E[x_T | x_k]` is the noiseless run of the kernel means from `x_k`, and `V(x_k) = w . E[x_T | x_k]`
and `A*_k` are exact. The check must recover them from Monte-Carlo continuations, give a scheme
that returns the exact `A*` a cosine of 1 within its interval, and one that returns noise about 0.
"""

import pytest
import torch

from stepgrpo_core.kernels import step_moments
from stepgrpo_core.quality import (
    GradientSums,
    continue_states,
    gradient_check,
    reliability,
    shifted_window,
    step_table,
    true_advantages,
    true_values,
)
from stepgrpo_core.rollout import rollout, step_log_prob

T, GROUPS, G, M = 6, 24, 4, 16
SIGMAS = torch.linspace(1.0, 0.0, T + 1)
SHAPE = (1, 8, 8)  # 64 parameters: a random direction's cosine with a fixed one is about +-0.12
WINDOW = (0, T)


class Flow:
    """`v(x, s) = (x - theta) / s`: the exact velocity towards the point `theta`."""

    def __init__(self) -> None:
        self.theta = torch.nn.Parameter(torch.full(SHAPE, 0.5))

    def __call__(self, x, sigma, cond=None):
        return (x - self.theta) / sigma.reshape(-1, 1, 1, 1)


W = torch.randn(SHAPE, generator=torch.Generator().manual_seed(5))


def reward(x):
    return (x * W).sum(dim=(1, 2, 3))


def exact_value(flow, x, k):
    """`w . E[x_T | x_k]`: the kernel means run without noise (affine maps commute with E)."""
    with torch.no_grad():
        for j in range(k, T):
            v = flow(x, SIGMAS[j].repeat(x.shape[0]))
            x = step_moments("flow", x, v, SIGMAS[j], SIGMAS[j + 1], 0.7)[0]
        return reward(x).double()


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(0)
    flow = Flow()
    B = GROUPS * G
    x0 = torch.randn(GROUPS, *SHAPE).repeat_interleave(G, 0)
    gids = torch.arange(GROUPS).repeat_interleave(G)
    with torch.no_grad():
        traj = rollout(flow, x0, SIGMAS, None, kernel="flow", noise=0.7, generator=torch.Generator().manual_seed(1))
    states = traj.states
    finals = torch.zeros(B, T + 1, M)
    gen = torch.Generator().manual_seed(2)
    for k in range(T + 1):
        rows = states[:, k].repeat_interleave(M, 0)
        finals[:, k] = reward(continue_states(flow, rows, SIGMAS, k, None, "flow", 0.7, WINDOW, gen)).reshape(B, M)
    exact = torch.stack([exact_value(flow, states[:, k], k) for k in range(T + 1)], dim=1)  # [B, T+1]
    return flow, states, gids, finals, exact


def test_true_values_recover_the_exact_values(case):
    flow, states, gids, finals, exact = case
    tv = true_values(finals)
    # the final state's value is its reward; the others agree within 5 Monte-Carlo standard errors
    torch.testing.assert_close(tv.value[:, -1], exact[:, -1], atol=1e-5, rtol=0)
    se = finals.double().std(2) / M**0.5
    assert bool(((tv.value - exact).abs() <= 5 * se + 1e-6).all())
    # and the halves average to the whole
    torch.testing.assert_close(tv.halves.mean(0), tv.value)
    # A* telescopes to R_T - V(x_0)
    torch.testing.assert_close(true_advantages(tv.value).sum(1), tv.value[:, -1] - tv.value[:, 0])


def scores_of(flow, states, gids, tables, steps):
    sums = GradientSums(tables, gids, flow.theta.numel())
    for b in range(states.shape[0]):
        for k in steps:
            lp = step_log_prob(flow, states[b : b + 1], SIGMAS, None, k, "flow", 0.7).log_prob.sum()
            (grad,) = torch.autograd.grad(lp, [flow.theta])
            sums.add(b, k, grad)
    return sums


def test_a_scheme_that_returns_the_true_advantage_gets_cosine_one_and_noise_about_zero(case):
    flow, states, gids, finals, exact = case
    tv = true_values(finals)
    steps = list(range(T - 1))  # the final step is not trained
    a_exact = true_advantages(exact)
    noise = torch.randn(a_exact.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    tables = {
        "true": true_advantages(tv.value),
        "true_a": true_advantages(tv.halves[0]),
        "true_b": true_advantages(tv.halves[1]),
        "exact": a_exact,
        "noise": noise,
    }
    sums = scores_of(flow, states, gids, tables, steps)
    check = gradient_check(sums.sums, ["exact", "noise"], baseline="noise", draws=500)
    by = {r["scheme"]: r for r in check.rows}
    assert 0 < check.reliability < 1  # the Monte-Carlo estimate of G* is noisy, and corrected for
    assert by["exact"]["low"] <= 1.0 <= by["exact"]["high"]
    assert by["exact"]["cosine"] == pytest.approx(1.0, abs=0.1)
    assert by["exact"]["raw"] < by["exact"]["cosine"]  # attenuated before the correction
    assert abs(by["noise"]["cosine"]) < 0.3 and by["noise"]["low"] < 0 < by["noise"]["high"]
    # the per-step correlations say the same
    rows = step_table(finals[:, :, 0], tv, {"exact": a_exact, "noise": noise}, gids, steps)
    assert [r["step"] for r in rows] == steps
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    for r in rows:
        if r["reliability"] > 0.5:
            assert r["corr/exact"] == pytest.approx(1.0, abs=0.15)
            assert abs(r["corr/noise"]) < 0.35


def test_gradient_sums_match_the_batch_gradient(case):
    # sum over groups of G_g(A) is the gradient of sum_{b,k} A_{b,k} log pi: the loop equals autograd
    flow, states, gids, finals, exact = case
    A = true_advantages(exact)[:8]
    sums = scores_of(flow, states[:8], gids[:8], {"a": A}, [1, 2])
    total = sum(
        (A[b, k] * step_log_prob(flow, states[b : b + 1], SIGMAS, None, k, "flow", 0.7).log_prob.sum())
        for b in range(8)
        for k in (1, 2)
    )
    (grad,) = torch.autograd.grad(total, [flow.theta])
    torch.testing.assert_close(sums.sums["a"].sum(0), grad.double().reshape(-1), atol=1e-5, rtol=1e-5)


def test_window_bookkeeping_and_reliability():
    assert shifted_window((0, 3), 0, 10) == (0, 3)
    assert shifted_window((0, 3), 2, 10) == (0, 1)
    assert shifted_window((0, 3), 3, 10) is None
    assert shifted_window((2, 4), 1, 10) == (1, 4)
    assert reliability(1.0) == 1.0 and reliability(1 / 3) == pytest.approx(0.5)
    assert reliability(-0.2) != reliability(-0.2)  # NaN: no correction when the halves disagree
    with pytest.raises(ValueError, match="M >= 2"):
        true_values(torch.zeros(2, 3, 1))


def test_the_oracle_scheme_returns_the_true_advantage(case):
    """Oracle credit (`oracle_advantages`, the benchmarks' bound) on the exact values is `A*` at
    outcome's scale, 0 on untrained steps; on Monte-Carlo values it tracks the exact `A*`."""
    from stepgrpo_core.credit import STD_EPS
    from stepgrpo_core.quality import oracle_advantages

    _, _, _, finals, exact = case
    trained = torch.ones(T, dtype=torch.bool)
    trained[-1] = False
    adv = oracle_advantages(exact, trained)
    scale = exact[:, -1].std(correction=0) + STD_EPS
    expected = (exact[:, 1:] - exact[:, :-1]) / scale  # A*_k = V(x_{k+1}) - V(x_k), outcome's scale
    torch.testing.assert_close(adv[:, :-1], expected[:, :-1])
    assert bool((adv[:, -1] == 0).all())
    # summed over every step it is the final reward's deviation from V(x_0), at outcome's scale
    full = oracle_advantages(exact)
    torch.testing.assert_close(full.sum(1), (exact[:, -1] - exact[:, 0]) / scale)
    mc = oracle_advantages(true_values(finals).value, trained)
    corr = torch.corrcoef(torch.stack([mc[:, :-1].reshape(-1), expected[:, :-1].reshape(-1)]))[0, 1]
    assert corr > 0.3  # M = 16 continuations: ~0.5 here; the Monte-Carlo noise of a difference of means
    with pytest.raises(ValueError, match=r"\[B, T\+1\]"):
        oracle_advantages(exact[:, :1])


def test_continuations_at_chosen_steps_take_the_kernel_there_alone():
    """`continue_states(..., sde_steps=S)` (a tree's split steps): the kernel at the steps of S from
    `k` on, the ODE elsewhere; one step is the window of that step alone, and no step left is the ODE."""
    torch.manual_seed(0)

    def velocity(x, sigma, cond):
        return 0.3 * x + sigma.reshape(-1, 1, 1, 1)

    sigmas = torch.linspace(1, 0, 7)
    x = torch.randn(4, 2, 3, 3)

    def go(k, window, steps=None, kernel="flow"):
        gen = torch.Generator().manual_seed(1)
        return continue_states(velocity, x, sigmas, k, None, kernel, 0.7, window, gen, steps)

    assert torch.equal(go(1, (3, 1)), go(1, (0, 6), [3]))
    assert torch.equal(go(4, (0, 6), [1, 3]), go(4, (0, 6), kernel="ode"))  # no split step left: the ODE
    two = go(0, (0, 6), [1, 4])
    assert not torch.equal(two, go(0, (0, 6), [1])) and not torch.equal(two, go(0, (1, 4)))
