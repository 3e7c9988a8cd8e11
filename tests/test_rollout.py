"""Rollouts over a grid with an optional SDE window, and re-scoring stored transitions."""

import math

import pytest
import torch

from stepgrpo_core.analytic import PointMassFlow
from stepgrpo_core.calibration import initial_psi
from stepgrpo_core.rollout import rollout, step_log_prob

SIGMAS = torch.tensor([1.0, 0.95, 0.85, 0.7, 0.5, 0.3, 0.0])  # T = 6, a shifted-looking grid
NOISE = {"flow": 0.7, "cps": 0.7, "ddim": 1.0, "psi": initial_psi(SIGMAS)}


def nonlinear_velocity(x, sigma, cond):
    """A model-like field that uses its conditioning rows (so a row mix-up would show)."""
    return torch.tanh(x) * cond["scale"].reshape(-1, 1, 1, 1) + sigma.reshape(-1, 1, 1, 1) * x


def make(batch=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(batch, 2, 3, 3, generator=g)
    cond = {"scale": torch.linspace(0.5, 1.5, batch)}
    return x0, cond


def test_ode_rollout_is_euler_loop():
    x0, cond = make()
    out = rollout(nonlinear_velocity, x0, SIGMAS, cond, kernel="ode")
    x = x0.clone()
    for k in range(len(SIGMAS) - 1):  # plain Euler
        x = x + nonlinear_velocity(x, SIGMAS[k].expand(3), cond) * (SIGMAS[k + 1] - SIGMAS[k])
        torch.testing.assert_close(out.states[:, k + 1], x)
    assert out.log_probs.isnan().all() and (out.stds == 0).all() and out.nfe == 3 * 6


@pytest.mark.parametrize("kind", ["flow", "cps", "ddim", "psi"])
def test_shapes_window_and_nfe(kind):
    x0, cond = make()
    out = rollout(
        nonlinear_velocity,
        x0,
        SIGMAS,
        cond,
        kernel=kind,
        noise=NOISE[kind],
        window=(1, 3),
        generator=torch.Generator().manual_seed(1),
    )
    assert out.states.shape == (3, 7, 2, 3, 3) and out.log_probs.shape == (3, 6) and out.stds.shape == (3, 6)
    assert out.nfe == 18 and torch.equal(out.states[:, 0], x0)
    inside = torch.tensor([False, True, True, True, False, False])
    assert out.log_probs[:, ~inside].isnan().all() and (out.stds[:, ~inside] == 0).all()
    assert out.log_probs[:, inside].isfinite().all() and (out.stds[:, inside] > 0).all()
    # the steps outside the window are plain Euler steps
    for k in (0, 4, 5):
        v = nonlinear_velocity(out.states[:, k], SIGMAS[k].expand(3), cond)
        torch.testing.assert_close(out.states[:, k + 1], out.states[:, k] + v * (SIGMAS[k + 1] - SIGMAS[k]))


def test_deterministic_steps_inside_window_get_nan():
    # ddim and cps have std 0 at sigma' = 0 (std proportional to s'), and ddim with eta 0 everywhere:
    # no density, so NaN like the ode steps.
    x0, cond = make()
    ddim = rollout(nonlinear_velocity, x0, SIGMAS, cond, kernel="ddim", noise=1.0)
    assert ddim.log_probs[:, -1].isnan().all() and ddim.log_probs[:, :-1].isfinite().all()
    assert rollout(nonlinear_velocity, x0, SIGMAS, cond, kernel="ddim", noise=0.0).log_probs.isnan().all()
    cps = rollout(nonlinear_velocity, x0, SIGMAS, cond, kernel="cps", noise=0.7)
    assert cps.log_probs[:, -1].isnan().all() and cps.log_probs[:, :-1].isfinite().all()


def test_seeded_rollouts_repeat():
    x0, cond = make()
    a = rollout(nonlinear_velocity, x0, SIGMAS, cond, generator=torch.Generator().manual_seed(7))
    b = rollout(nonlinear_velocity, x0, SIGMAS, cond, generator=torch.Generator().manual_seed(7))
    c = rollout(nonlinear_velocity, x0, SIGMAS, cond, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a.states, b.states) and torch.equal(a.log_probs, b.log_probs)
    assert not torch.equal(a.states, c.states)


def test_psi_with_initial_table_equals_flow():
    x0, cond = make()
    flow = rollout(
        nonlinear_velocity, x0, SIGMAS, cond, kernel="flow", noise=0.7, generator=torch.Generator().manual_seed(3)
    )
    psi = rollout(
        nonlinear_velocity,
        x0,
        SIGMAS,
        cond,
        kernel="psi",
        noise=initial_psi(SIGMAS, 0.7),
        generator=torch.Generator().manual_seed(3),
    )
    torch.testing.assert_close(psi.states, flow.states)
    torch.testing.assert_close(psi.log_probs, flow.log_probs)


@pytest.mark.parametrize("kind", ["flow", "cps", "ddim", "psi"])
def test_step_log_prob_reproduces_rollout_exactly(kind):
    x0, cond = make()
    out = rollout(
        nonlinear_velocity, x0, SIGMAS, cond, kernel=kind, noise=NOISE[kind], generator=torch.Generator().manual_seed(2)
    )
    for k in range(6):
        if out.log_probs[:, k].isnan().any():
            continue
        rec = step_log_prob(nonlinear_velocity, out.states, SIGMAS, cond, k, kind, NOISE[kind])
        assert torch.equal(rec.log_prob, out.log_probs[:, k]), k  # ratio exactly 1 on-policy
        torch.testing.assert_close(rec.std.reshape(-1), out.stds[:, k], rtol=0, atol=0)
    # one step per row gives the same values as one step for all rows
    steps = torch.tensor([1, 3, 2])
    rec = step_log_prob(nonlinear_velocity, out.states, SIGMAS, cond, steps, kind, NOISE[kind])
    torch.testing.assert_close(rec.log_prob, out.log_probs[torch.arange(3), steps], rtol=0, atol=0)
    assert rec.mean.shape == (3, 2, 3, 3) and rec.std.shape == (3, 1, 1, 1)


def test_step_log_prob_has_gradient():
    x0, _ = make()
    weight = torch.nn.Parameter(torch.tensor(1.0))

    def velocity(x, sigma, cond):
        return weight * torch.tanh(x)

    with torch.no_grad():
        out = rollout(velocity, x0, SIGMAS, None, kernel="flow", generator=torch.Generator().manual_seed(0))
    rec = step_log_prob(velocity, out.states, SIGMAS, None, 2, "flow", 0.7)
    rec.log_prob.sum().backward()
    assert weight.grad is not None and weight.grad.abs() > 0


def test_rollout_keeps_dtype():
    x0, cond = make()
    out = rollout(nonlinear_velocity, x0.double(), SIGMAS, {"scale": cond["scale"].double()})
    assert out.states.dtype == torch.float64 and out.log_probs.dtype == torch.float32


def test_point_mass_ode_reaches_the_data_point():
    mu = torch.tensor([0.3, -1.0]).reshape(2, 1, 1)
    x0, _ = make()
    out = rollout(PointMassFlow(mu), x0, SIGMAS, None, kernel="ode")
    torch.testing.assert_close(out.states[:, -1], mu.expand(3, 2, 3, 3), atol=1e-5, rtol=0)
    for k in range(7):  # straight lines: x_k = (1 - s_k) mu + s_k x_0
        torch.testing.assert_close(out.states[:, k], (1 - SIGMAS[k]) * mu + SIGMAS[k] * x0, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(window=(4, 3)), "start \\+ size <= T = 6"),
        (dict(window=(0, 0)), "1 <= size"),
        (dict(kernel="psi", noise=0.7), r"per-step table noise: \[T=6\]"),
        (dict(kernel="langevin"), "known kernels"),
        (dict(sigmas=torch.tensor([1.0, 0.5, 0.6, 0.0])), "decrease strictly"),
    ],
)
def test_invalid_rollouts(kwargs, match):
    x0, cond = make()
    sigmas = kwargs.pop("sigmas", SIGMAS)
    with pytest.raises((ValueError, KeyError), match=match):
        rollout(nonlinear_velocity, x0, sigmas, cond, **kwargs)


def test_invalid_step_log_prob():
    x0, cond = make()
    out = rollout(nonlinear_velocity, x0, SIGMAS, cond)
    with pytest.raises(ValueError, match=r"steps must lie in \[0, T-1\]"):
        step_log_prob(nonlinear_velocity, out.states, SIGMAS, cond, 6, "flow", 0.7)
    with pytest.raises(ValueError, match="std > 0"):
        step_log_prob(nonlinear_velocity, out.states, SIGMAS, cond, 0, "ode", None)
    with pytest.raises(ValueError, match="T \\+ 1"):
        step_log_prob(nonlinear_velocity, out.states[:, :5], SIGMAS, cond, 0, "flow", 0.7)
    assert math.isfinite(
        step_log_prob(nonlinear_velocity, out.states, SIGMAS, cond, 5, "flow", 0.7).log_prob.sum().item()
    )


def test_dpm2_is_dpm_solver_pp_2m_on_the_rollout_grid():
    """`sampler.ode_solver: dpm2` (diffusers' DPMSolverMultistepScheduler on the rollout's grid)
    against DPM-Solver++ 2M written from its formulas in data prediction (`x0 = x - s v`, `lambda =
    log((1 - s) / s)`): first order at the first and the last step, second order between."""
    from stepgrpo.loops.sampling import DPMSolver
    from stepgrpo_core.rollout import rollout

    sigmas = torch.tensor([1.0, 0.92, 0.8, 0.62, 0.4, 0.18, 0.0])
    g = torch.Generator().manual_seed(0)
    A = torch.randn(4, 4, generator=g, dtype=torch.float64) * 0.5

    def velocity(x, s, cond):  # a smooth field that depends on x and s
        return torch.tanh(torch.einsum("bchw,cd->bdhw", x.double(), A)).float() + s.reshape(-1, 1, 1, 1)

    x0 = torch.randn(3, 4, 2, 2, generator=g)
    got = rollout(velocity, x0, sigmas, None, kernel="ode", ode_step=DPMSolver(sigmas).step)

    lam = lambda s: torch.log((1 - s) / s)  # noqa: E731
    x, preds = x0.double(), []
    T = len(sigmas) - 1
    for k in range(T):
        s, s1 = sigmas[k].double(), sigmas[k + 1].double()
        pred = x - s * velocity(x.float(), s.float().repeat(3), None).double()
        h = lam(s1) - lam(s)
        phi = (1 - s1) * (torch.exp(-h) - 1)
        if k == 0 or k == T - 1:
            x = (s1 / s) * x - phi * pred
        else:
            r0 = (lam(s) - lam(sigmas[k - 1].double())) / h
            x = (s1 / s) * x - phi * pred - 0.5 * phi * (pred - preds[-1]) / r0
        x = x.float().double()  # the rollout keeps states in the dtype of x0
        preds.append(pred)
    torch.testing.assert_close(got.states[:, -1].double(), x, rtol=1e-5, atol=1e-5)
    euler = rollout(velocity, x0, sigmas, None, kernel="ode")
    assert (euler.states[:, -1] - got.states[:, -1]).abs().max() > 1e-3  # a different solver
    assert got.nfe == 3 * T and bool(got.log_probs.isnan().all())


def test_dpm2_needs_a_deterministic_kernel():
    from stepgrpo.config import ConfigError, load_config

    nft = "update.objective=nft"
    with pytest.raises(ConfigError, match="ode_solver 'dpm2' is a multistep ODE solver"):
        load_config(None, [nft, "sampler.ode_solver=dpm2"])
    with pytest.raises(ConfigError, match="set sampler.shared_x0=false"):
        load_config(None, [nft, "sampler.kernel=ode"])
    with pytest.raises(ConfigError, match="no density for update.objective grpo"):
        load_config(None, ["sampler.kernel=ode", "sampler.shared_x0=false"])
    load_config(None, [nft, "sampler.ode_solver=dpm2", "sampler.kernel=ode", "sampler.shared_x0=false"])


def test_sa_solver_samples_the_flows_marginals():
    """`sampler.sde_solver: sa_solver` (diffusers' SASolverScheduler on the rollout's grid, AWM's
    tau band) is a sampler of the flow: with the exact velocity of Gaussian data (std c) its
    states have the marginal std sqrt((1 - s)^2 c^2 + s^2) at every sigma and the data's at the end,
    with tau 0 (deterministic) and tau 1 (noise inside 0.3 <= sigma <= 0.9); the noise comes from
    the rollout's generator."""
    from stepgrpo.loops.sampling import SASolver
    from stepgrpo_core.rollout import rollout

    c = 0.5

    def velocity(x, s, cond):  # E[eps - x0 | x_s] for x0 ~ N(0, c^2)
        s = s.reshape(-1, 1, 1, 1).double()
        return ((s - (1 - s) * c**2) / ((1 - s) ** 2 * c**2 + s**2) * x.double()).float()

    sigmas = torch.linspace(1, 0, 51)
    x0 = torch.randn(20000, 1, 1, 1, generator=torch.Generator().manual_seed(0))
    x0 = x0 / x0.std()
    finals = {}
    for tau in (0.0, 1.0):
        for seed in (1, 2):
            g = torch.Generator().manual_seed(seed)
            out = rollout(velocity, x0, sigmas, None, kernel="ode", ode_step=SASolver(sigmas, tau, g).step)
            assert bool(out.states.isfinite().all()) and bool(out.log_probs.isnan().all())
            for k in (10, 25, 40):  # sigma 0.8, 0.5, 0.2
                s = float(sigmas[k])
                assert abs(out.states[:, k].std().item() / ((1 - s) ** 2 * c**2 + s**2) ** 0.5 - 1) < 0.03, (tau, k)
            assert abs(out.states[:, -1].std().item() / c - 1) < 0.03, tau
            finals[tau, seed] = out.states[:, -1]
    assert torch.equal(finals[0.0, 1], finals[0.0, 2])  # tau 0: no noise drawn into the states
    assert not torch.equal(finals[1.0, 1], finals[1.0, 2])
    again = rollout(
        velocity, x0, sigmas, None, kernel="ode", ode_step=SASolver(sigmas, 1.0, torch.Generator().manual_seed(1)).step
    )
    assert torch.equal(again.states[:, -1], finals[1.0, 1])


def test_sa_solver_is_for_the_flow_matching_objectives():
    from stepgrpo.config import ConfigError, load_config

    awm, sa = "update.objective=awm", "sampler.sde_solver=sa_solver"
    with pytest.raises(ConfigError, match="no density of their own"):
        load_config(None, [sa])
    with pytest.raises(ConfigError, match="unset sampler.sde_window_start"):
        load_config(None, [awm, sa, "sampler.sde_window_size=3"])
    with pytest.raises(ConfigError, match="leave ode_solver at euler"):
        load_config(None, [awm, sa, "sampler.ode_solver=dpm2", "sampler.kernel=ode"])
    with pytest.raises(ConfigError, match="leave sampler.kernel at flow"):
        load_config(None, [awm, sa, "sampler.kernel=psi"])
    cfg = load_config(None, [awm, sa])
    assert cfg.sampler.sde_solver == "sa_solver"
