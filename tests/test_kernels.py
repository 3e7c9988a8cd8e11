"""Transition kernels (METHODS.md, "Transition kernels"): Euler, zero-noise limits, the exact
log-density, and marginal preservation with the exact point-mass velocity field."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stepgrpo_core.analytic import PointMassFlow
from stepgrpo_core.kernels import KERNELS, flow_scale, log_prob, step_moments
from stepgrpo_core.rollout import rollout

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True)
STOCHASTIC = ["flow", "cps", "ddim", "psi"]


@st.composite
def step_inputs(draw):
    """A random step: x, v [B, C, H, W] and 1 >= sigma > sigma_next >= 0."""
    seed = draw(st.integers(0, 2**16))
    batch = draw(st.integers(1, 4))
    sigma = draw(st.floats(0.05, 1.0))
    sigma_next = draw(st.floats(0.0, 0.99)) * sigma
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 2, 3, 3, generator=g)
    v = torch.randn(batch, 2, 3, 3, generator=g)
    return x, v, sigma, sigma_next


def test_an_unknown_kernel_is_refused_with_the_registry_list():
    with pytest.raises(KeyError, match=f"known kernels: {', '.join(KERNELS.names())}"):
        step_moments("sde", torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1), 1.0, 0.5, 0.7)


@SETTINGS
@given(step_inputs())
def test_ode_is_euler(inputs):
    x, v, sigma, sigma_next = inputs
    mean, std = step_moments("ode", x, v, sigma, sigma_next, None)
    torch.testing.assert_close(mean, x + v * (sigma_next - sigma))
    assert std.shape == (x.shape[0], 1, 1, 1) and bool((std == 0).all())


@SETTINGS
@given(step_inputs(), st.sampled_from(STOCHASTIC))
def test_zero_noise_is_ode(inputs, kind):
    x, v, sigma, sigma_next = inputs
    mean, std = step_moments(kind, x, v, sigma, sigma_next, 0.0)
    ode_mean, _ = step_moments("ode", x, v, sigma, sigma_next)
    torch.testing.assert_close(mean, ode_mean, atol=1e-6, rtol=1e-5)
    assert bool((std == 0).all())


@SETTINGS
@given(step_inputs(), st.sampled_from(STOCHASTIC), st.floats(0.0, 1.0))
def test_per_row_sigmas_match_scalar_calls(inputs, kind, noise):
    # [B] sigmas (one level per row, as in step_log_prob and completions) == one call per row.
    x, v, sigma, sigma_next = inputs
    b = x.shape[0]
    sig = torch.linspace(sigma, sigma * 0.5 + 0.01, b)
    nxt = sig * (sigma_next / sigma)
    mean, std = step_moments(kind, x, v, sig, nxt, noise)
    assert mean.shape == x.shape and std.shape == (b, 1, 1, 1)
    for i in range(b):
        m_i, s_i = step_moments(kind, x[i : i + 1], v[i : i + 1], float(sig[i]), float(nxt[i]), noise)
        torch.testing.assert_close(mean[i : i + 1], m_i, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(std[i : i + 1], s_i, atol=1e-6, rtol=1e-5)


def test_table_values():
    # Hand-worked values of the std column at s = 0.5, s' = 0.25 (dt = -0.25).
    x = torch.zeros(1, 1, 1, 1)
    _, std = step_moments("flow", x, x, 0.5, 0.25, 0.7)
    assert std.item() == pytest.approx(0.7 * math.sqrt(0.5 / 0.5) * math.sqrt(0.25))  # 0.35
    _, std = step_moments("cps", x, x, 0.5, 0.25, 0.7)
    assert std.item() == pytest.approx(0.25 * math.sin(0.7 * math.pi / 2))
    # ddim (DDIM eq. 16 on a = 1 - s, b = s): r = (1 - 0.5) 0.25 / (0.5 (1 - 0.25)) = 1/3,
    # std = eta s' sqrt(1 - r^2) = 0.25 sqrt(8/9); in DDIM's own terms with abar = a^2 / (a^2 + b^2)
    # (the VP rescaling x / sqrt(a^2 + b^2)) the same std comes out: checked in test_ddim_is_ddim.
    _, std = step_moments("ddim", x, x, 0.5, 0.25, 1.0)
    assert std.item() == pytest.approx(0.25 * math.sqrt(8.0 / 9.0))
    _, std = step_moments("psi", x, x, 0.5, 0.25, 0.3)
    assert std.item() == pytest.approx(0.3 * 0.5)
    # flow at s = 1: sigma_next (= sigmas[1] at step 0) replaces s in the denominator only:
    # eps_t = 0.7 sqrt(1 / (1 - 0.9)), std = eps_t sqrt(0.1) = 0.7.
    _, std = step_moments("flow", x, x, 1.0, 0.9, 0.7)
    assert std.item() == pytest.approx(0.7 * math.sqrt(1.0 / 0.1) * math.sqrt(0.1))
    assert flow_scale(torch.tensor(1.0), torch.tensor(0.9), 0.7).item() == pytest.approx(0.7 * math.sqrt(10.0))
    # ddim at s = 1: r = 0, std = eta s' (all of x_{k+1}'s noise is fresh); at s' = 0: std 0.
    _, std = step_moments("ddim", x, x, 1.0, 0.9, 0.5)
    assert std.item() == pytest.approx(0.45)
    _, std = step_moments("ddim", x, x, 0.3, 0.0, 1.0)
    assert std.item() == 0.0


@pytest.mark.parametrize("s,s_next", [(0.9, 0.7), (0.5, 0.25), (0.2, 0.05)])
def test_ddim_is_ddim(s, s_next):
    # DDIM's eq. 16 in its own variance-preserving terms: the state x / sqrt(a^2 + b^2) has
    # abar = a^2 / (a^2 + b^2); sigma_VP = sqrt((1 - abar') / (1 - abar)) sqrt(1 - abar / abar'),
    # and back in flow units the std is sigma_VP sqrt(a'^2 + b'^2).
    def abar(t):
        return (1 - t) ** 2 / ((1 - t) ** 2 + t**2)

    vp = math.sqrt((1 - abar(s_next)) / (1 - abar(s))) * math.sqrt(1 - abar(s) / abar(s_next))
    expected = vp * math.sqrt((1 - s_next) ** 2 + s_next**2)
    x = torch.zeros(1, 1, 1, 1)
    _, std = step_moments("ddim", x, x, s, s_next, 1.0)
    assert std.item() == pytest.approx(expected, rel=1e-5)


def test_mean_formulas():
    # flow mean written out at s = 0.5, s' = 0.25, a = 0.7, x = 1, v = 2:
    # x + v dt + (a^2 s/(1-s)) / (2 s) * (x + (1 - s) v) * dt = 1 - 0.5 + 0.49 * 2 * (-0.25) = 0.255
    one = torch.ones(1, 1, 1, 1)
    mean, _ = step_moments("flow", one, 2 * one, 0.5, 0.25, 0.7)
    assert mean.item() == pytest.approx(1 - 0.5 + 0.49 / 1.0 * 2.0 * -0.25)
    # cps: x0_hat = 1 - 0.5*2 = 0, x1_hat = 1 + 0.5*2 = 2, std = 0.25 sin(0.35 pi)
    std = 0.25 * math.sin(0.7 * math.pi / 2)
    mean, _ = step_moments("cps", one, 2 * one, 0.5, 0.25, 0.7)
    assert mean.item() == pytest.approx(0.75 * 0 + math.sqrt(0.25**2 - std**2) * 2)


@SETTINGS
@given(st.integers(0, 2**16), st.floats(0.05, 3.0))
def test_log_prob_is_normal_density(seed, scale):
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(3, 2, 4, 4, generator=g)
    std = (torch.rand(3, 1, 1, 1, generator=g) + 0.05) * scale
    x = mean + std * torch.randn(3, 2, 4, 4, generator=g) * 2
    expected = torch.distributions.Normal(mean, std.expand_as(mean)).log_prob(x).mean(dim=(1, 2, 3))
    out = log_prob(x, mean, std)
    assert out.shape == (3,) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_log_prob_is_fp32_and_rejects_zero_std():
    mean = torch.zeros(2, 1, 2, 2, dtype=torch.bfloat16)
    x = torch.full_like(mean, 0.5)
    assert log_prob(x, mean, torch.ones(2, 1, 1, 1, dtype=torch.bfloat16)).dtype == torch.float32
    with pytest.raises(ValueError, match="std > 0"):
        log_prob(x, mean, torch.zeros(2, 1, 1, 1))


def test_math_in_fp32():
    x = torch.randn(2, 1, 2, 2).to(torch.bfloat16)
    mean, std = step_moments("flow", x, x, 0.5, 0.4, 0.7)
    assert mean.dtype == torch.float32 and std.dtype == torch.float32


@pytest.mark.parametrize(
    "kind,noise,sigma,sigma_next,match",
    [
        ("cps", 1.5, 0.5, 0.4, r"noise \(its a\) must lie in \[0.0, 1.0\]"),
        ("ddim", -0.1, 0.5, 0.4, "its eta"),
        ("flow", None, 0.5, 0.4, "needs `noise`"),
        ("flow", 0.7, 0.4, 0.5, "sigma_next <= sigma"),
        ("flow", 0.7, 0.0, 0.0, "sigma > 0"),
    ],
)
def test_invalid_inputs(kind, noise, sigma, sigma_next, match):
    x = torch.zeros(1, 1, 2, 2)
    with pytest.raises(ValueError, match=match):
        step_moments(kind, x, x, sigma, sigma_next, noise)


def test_bad_shapes():
    with pytest.raises(ValueError, match=r"\[B, C, H, W\]"):
        step_moments("ode", torch.zeros(2, 3), torch.zeros(2, 3), 0.5, 0.4)
    with pytest.raises(ValueError, match="sigma must be"):
        step_moments("ode", torch.zeros(2, 1, 1, 1), torch.zeros(2, 1, 1, 1), torch.ones(3) * 0.5, 0.4)


# --- marginals under the exact point-mass field: x_s ~ N((1 - s) mu, s^2 I) -----------------

MU = torch.tensor([0.8, -0.5]).reshape(2, 1, 1)


def _standardized(states, sigmas):
    """(x_k - (1 - s_k) mu) / s_k per level k < T: ~ N(0, 1) iid if the marginal is kept."""
    return [(states[:, k] - (1 - sigmas[k]) * MU) / sigmas[k] for k in range(len(sigmas) - 1)]


@pytest.mark.parametrize("kind,noise", [("ddim", 1.0), ("ddim", 0.5), ("cps", 0.7), ("cps", 1.0)])
def test_preserving_kernels_keep_marginals_monte_carlo(kind, noise):
    # 2048 rows x 2 x 4 x 4 = 65536 iid N(0, 1) values per level when the marginal is kept.
    # Tolerance 5 standard errors: mean +- 5/sqrt(n) = 0.02, variance +- 5 sqrt(2/n) = 0.028.
    g = torch.Generator().manual_seed(0)
    field = PointMassFlow(MU)
    sigmas = torch.tensor([1.0, 0.9, 0.7, 0.5, 0.3, 0.15, 0.05, 0.0])
    x0 = torch.randn(2048, 2, 4, 4, generator=g)
    out = rollout(field, x0, sigmas, None, kernel=kind, noise=noise, generator=g)
    n = x0.numel()
    for k, z in enumerate(_standardized(out.states, sigmas)):
        assert abs(z.mean().item()) < 5 / math.sqrt(n), (k, z.mean())
        assert abs(z.var().item() - 1) < 5 * math.sqrt(2 / n), (k, z.var())
    # and the last state is the data point exactly (s' = 0 has std 0 for both kernels)
    torch.testing.assert_close(out.states[:, -1], MU.expand_as(x0), atol=1e-5, rtol=0)


def _exact_moments(kind, noise, sigmas):
    """Exact per-level mean and std of the state, by propagating moments through the kernel.

    The point-mass field is affine and elementwise, so each step is x' = alpha x + beta + std eps:
    alpha = mean(x + 1) - mean(x), and var' = alpha^2 var + std^2. x_0 ~ N(0, 1), first coordinate.
    """
    field = PointMassFlow(MU)
    m, var = torch.zeros(1, 2, 1, 1), torch.ones(1, 2, 1, 1)
    out = []
    for k in range(len(sigmas) - 1):
        s, s_next = float(sigmas[k]), float(sigmas[k + 1])

        def step(x):
            return step_moments(kind, x, field(x, torch.tensor([s])), s, s_next, noise)

        m1, std = step(m)
        alpha = step(m + 1)[0] - m1
        m, var = m1, alpha**2 * var + std**2
        out.append((s_next, m, var.sqrt()))
    return out


@pytest.mark.parametrize("kind,noise", [("ddim", 1.0), ("cps", 0.7)])
def test_preserving_kernels_keep_marginals_exactly(kind, noise):
    for s_next, m, sd in _exact_moments(kind, noise, torch.linspace(1, 0, 9)):
        torch.testing.assert_close(m, (1 - s_next) * MU.reshape(1, 2, 1, 1), atol=1e-5, rtol=0)
        torch.testing.assert_close(sd, torch.full_like(sd, s_next), atol=1e-5, rtol=0)


def test_flow_sde_approaches_marginals_as_steps_shrink():
    # Euler-Maruyama of Flow-GRPO's marginal-preserving SDE: the error at s = 0.5 on a uniform
    # grid shrinks as T grows (exact moments, no sampling noise). Measured: 0.17 (T=4), 0.038
    # (T=16), 0.0125 (T=64), 0.0077 (T=128). The first step keeps an O(a^2) error that does not
    # vanish (s = 1 is replaced by sigmas[1], so the injected variance there stays ~a^2); the drift
    # pulls it back towards the marginal by s = 0.5.
    def error_at_half(num_steps):
        moments = _exact_moments("flow", 0.7, torch.linspace(1, 0, num_steps + 1))
        s_next, m, sd = moments[num_steps // 2 - 1]
        assert s_next == pytest.approx(0.5)
        return max((m - 0.5 * MU.reshape(1, 2, 1, 1)).abs().max().item(), (sd - 0.5).abs().max().item())

    errors = [error_at_half(t) for t in (4, 16, 64, 128)]
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 0.01 and errors[0] > 0.1, errors
    # The exact `ode` step keeps the marginals with any grid (the point-mass flow is straight).
    for s_next, _m, sd in _exact_moments("ode", None, torch.linspace(1, 0, 5)):
        torch.testing.assert_close(sd, torch.full_like(sd, s_next), atol=1e-6, rtol=0)


def test_flow_sde_monte_carlo_agrees_with_exact_moments():
    # The moment recursion above is what sampling does: T = 16, 2048 x 32 samples, 5 s.e.
    g = torch.Generator().manual_seed(1)
    sigmas = torch.linspace(1, 0, 17)
    x0 = torch.randn(2048, 2, 4, 4, generator=g)
    out = rollout(PointMassFlow(MU), x0, sigmas, None, kernel="flow", noise=0.7, generator=g)
    n = x0.shape[0] * 16  # per channel
    for k, (_, m, sd) in enumerate(_exact_moments("flow", 0.7, sigmas)):
        x = out.states[:, k + 1].transpose(0, 1).reshape(2, -1)
        assert ((x.mean(1) - m.reshape(2)).abs() < 5 * sd.reshape(2) / math.sqrt(n) + 1e-6).all(), k
        assert ((x.std(1) - sd.reshape(2)).abs() < 5 * sd.reshape(2) / math.sqrt(2 * n) + 1e-6).all(), k


def _flow_grpo_sde_step(x, v, sigmas, k, a, x_next):
    """Flow-GRPO's `sde_step_with_logprob` (their `sde` type), transcribed with the grid indexed by k:
    `std_dev_t = sqrt(sigma / (1 - where(sigma == 1, sigmas[1], sigma))) * a`."""
    sigma, sigma_prev, sigma_max = sigmas[k], sigmas[k + 1], sigmas[1]
    dt = sigma_prev - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * a
    mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    std = std_dev_t * torch.sqrt(-dt)
    logp = -((x_next - mean) ** 2) / (2 * std**2) - torch.log(std) - math.log(math.sqrt(2 * math.pi))
    return mean, std, std_dev_t, logp.mean(dim=(1, 2, 3))


def test_flow_kernel_is_flow_grpo_sde_step_at_every_step():
    from stepgrpo_core.kernels import diffusion_coefficient, log_prob

    # SD3's shifted 10-step grid (shift 3), step 0 (s = 1) included.
    t = torch.linspace(1.0, 0.0, 11)
    sigmas = 3 * t / (1 + 2 * t)
    g = torch.Generator().manual_seed(0)
    for k in range(10):
        x, v, x_next = (torch.randn(2, 4, 8, 8, generator=g, dtype=torch.float64) for _ in range(3))
        mean, std = step_moments("flow", x, v, float(sigmas[k]), float(sigmas[k + 1]), 0.7)
        ref_mean, ref_std, ref_eps, ref_logp = _flow_grpo_sde_step(x, v, sigmas.double(), k, 0.7, x_next)
        torch.testing.assert_close(std[0].reshape(()).double(), ref_std, rtol=1e-6, atol=0)
        torch.testing.assert_close(mean.double(), ref_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(log_prob(x_next.float(), mean, std).double(), ref_logp, rtol=1e-5, atol=1e-5)
        eps = diffusion_coefficient("flow", std, float(sigmas[k]), float(sigmas[k + 1]))
        torch.testing.assert_close(eps[0].reshape(()).double(), ref_eps, rtol=1e-6, atol=0)


def test_diffusion_coefficient_is_the_std_for_kernels_without_sqrt_dt():
    from stepgrpo_core.kernels import diffusion_coefficient

    x = torch.zeros(1, 1, 1, 1)
    _, std = step_moments("cps", x, x, 0.5, 0.25, 0.7)
    assert diffusion_coefficient("cps", std, 0.5, 0.25).item() == std.item()
    _, std = step_moments("psi", x, x, 0.5, 0.25, 0.3)
    assert diffusion_coefficient("psi", std, 0.5, 0.25).item() == pytest.approx(0.3)
