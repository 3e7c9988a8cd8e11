"""ODE completion of every stored state: values against plain loops, batching, NFE counts."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stepgrpo_core.analytic import PointMassFlow
from stepgrpo_core.completions import COMPLETIONS, complete, validate_method
from stepgrpo_core.rollout import rollout

SIGMAS = torch.tensor([1.0, 0.9, 0.75, 0.55, 0.3, 0.0])  # T = 5
T = 5


class Counting:
    """A nonlinear, conditioning-dependent field that records every call's batch size."""

    def __init__(self):
        self.calls = []

    def __call__(self, x, sigma, cond):
        self.calls.append(x.shape[0])
        return torch.tanh(x) * cond["scale"].reshape(-1, 1, 1, 1) + sigma.reshape(-1, 1, 1, 1) * x


def make(batch=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(batch, 2, 3, 3, generator=g)
    cond = {"scale": torch.linspace(0.5, 1.5, batch)}
    states = rollout(Counting(), x0, SIGMAS, cond, kernel="flow", noise=0.7, generator=g).states
    return states, cond


def euler(velocity, x, grid, cond):
    """Plain reference: Euler over `grid`, one row at a time through the whole grid."""
    for j in range(len(grid) - 1):
        x = x + velocity(x, grid[j].reshape(1).expand(x.shape[0]), cond) * (grid[j + 1] - grid[j])
    return x


def row(cond, b):
    return {"scale": cond["scale"][b : b + 1]}


def test_remaining_of_x0_is_the_ode_sample():
    states, cond = make()
    out = complete("remaining", Counting(), states, SIGMAS, cond, max_batch=4)
    ode = rollout(Counting(), states[:, 0], SIGMAS, cond, kernel="ode").states[:, -1]
    torch.testing.assert_close(out.latents[:, 0], ode, rtol=0, atol=1e-6)


def test_remaining_equals_per_state_loop():
    states, cond = make()
    field = Counting()
    out = complete("remaining", field, states, SIGMAS, cond, max_batch=5)
    for b in range(3):
        for k in range(T + 1):
            ref = euler(Counting(), states[b : b + 1, k], SIGMAS[k:], row(cond, b))
            torch.testing.assert_close(out.latents[b : b + 1, k], ref, rtol=0, atol=1e-6)
    # x_T is its own completion, untouched
    assert torch.equal(out.latents[:, T], states[:, T])
    # NFE: exactly T (T + 1) / 2 = 15 per trajectory, in calls of at most max_batch rows
    assert out.nfe == 3 * T * (T + 1) // 2 == sum(field.calls)
    assert max(field.calls) <= 5


def test_substeps_equals_per_state_loop_and_counts():
    states, cond = make()
    for n in (1, 3):
        field = Counting()
        out = complete(f"substeps:{n}", field, states, SIGMAS, cond, max_batch=4)
        for b in range(3):
            for k in range(T):
                grid = SIGMAS[k] * (1 - torch.arange(n + 1) / n)  # fresh uniform grid to 0
                ref = euler(Counting(), states[b : b + 1, k], grid, row(cond, b))
                torch.testing.assert_close(out.latents[b : b + 1, k], ref, rtol=1e-6, atol=1e-6)
        assert torch.equal(out.latents[:, T], states[:, T])
        assert out.nfe == 3 * T * n == sum(field.calls) and max(field.calls) <= 4


def test_tweedie_is_x_minus_sigma_v():
    states, cond = make()
    field = Counting()
    out = complete("tweedie", field, states, SIGMAS, cond, max_batch=100)
    for k in range(T):
        v = Counting()(states[:, k], SIGMAS[k].expand(3), cond)
        torch.testing.assert_close(out.latents[:, k], states[:, k] - SIGMAS[k] * v, rtol=0, atol=1e-6)
    assert torch.equal(out.latents[:, T], states[:, T])
    assert out.nfe == 3 * T == sum(field.calls) and field.calls == [15]  # 1 per non-final state
    # one Euler step to 0 is the Tweedie estimate
    torch.testing.assert_close(complete("substeps:1", Counting(), states, SIGMAS, cond, 100).latents, out.latents)


@pytest.mark.parametrize("method", ["remaining", "substeps:2", "tweedie"])
def test_point_mass_completes_to_the_data_point(method):
    mu = torch.tensor([0.5, -0.25]).reshape(2, 1, 1)
    states, _ = make()
    out = complete(method, PointMassFlow(mu), states, SIGMAS, None, max_batch=7)
    torch.testing.assert_close(out.latents[:, :T], mu.expand(3, T, 2, 3, 3), rtol=0, atol=1e-5)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(st.sampled_from(["remaining", "substeps:2", "tweedie"]), st.integers(1, 40))
def test_chunking_does_not_change_results(method, max_batch):
    states, cond = make(batch=2)
    ref = complete(method, Counting(), states, SIGMAS, cond, max_batch=1000)
    field = Counting()
    out = complete(method, field, states, SIGMAS, cond, max_batch=max_batch)
    torch.testing.assert_close(out.latents, ref.latents, rtol=0, atol=1e-6)
    assert out.nfe == ref.nfe and max(field.calls) <= max_batch


@pytest.mark.parametrize(
    "method,match",
    [
        ("ode", f"known completions: {', '.join(COMPLETIONS.names())}"),
        ("substeps", "positive step count"),
        ("substeps:0", "positive step count"),
        ("substeps:x", "positive step count"),
        ("remaining:3", "takes no ':' argument"),
    ],
)
def test_invalid_methods(method, match):
    states, cond = make(batch=1)
    with pytest.raises((ValueError, KeyError), match=match):
        validate_method(method)
    with pytest.raises((ValueError, KeyError), match=match):
        complete(method, Counting(), states, SIGMAS, cond, max_batch=4)


def test_invalid_inputs():
    states, cond = make(batch=1)
    with pytest.raises(ValueError, match="max_batch"):
        complete("tweedie", Counting(), states, SIGMAS, cond, max_batch=0)
    with pytest.raises(ValueError, match="levels"):
        complete("tweedie", Counting(), states[:, :3], SIGMAS, cond, max_batch=4)
    assert validate_method("substeps:5") == "substeps:5"


@pytest.mark.parametrize("method, nfe_per_traj", [("remaining", 5 + 4), ("substeps:3", 3 * 2), ("tweedie", 2)])
def test_states_after_the_sde_window_are_the_sample_and_cost_nothing(method, nfe_per_traj):
    # Window (0, 2): steps 2..4 are ODE, so x_2..x_5 lead to x_T on the rollout's own grid.
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(3, 2, 3, 3, generator=g)
    cond = {"scale": torch.linspace(0.5, 1.5, 3)}
    states = rollout(Counting(), x0, SIGMAS, cond, kernel="flow", noise=0.7, window=(0, 2), generator=g).states
    full = complete(method, Counting(), states, SIGMAS, cond, max_batch=4)
    short = complete(method, Counting(), states, SIGMAS, cond, max_batch=4, through=2)
    assert short.nfe == 3 * nfe_per_traj  # remaining: (T - 0) + (T - 1) per trajectory
    torch.testing.assert_close(short.latents[:, :2], full.latents[:, :2], rtol=0, atol=1e-6)
    for k in range(2, T + 1):
        torch.testing.assert_close(short.latents[:, k], states[:, -1], rtol=0, atol=0)
    if method == "remaining":  # exactly what recomputing gives: the same Euler steps as the rollout
        torch.testing.assert_close(short.latents, full.latents, rtol=0, atol=1e-5)


def test_through_is_checked():
    states, cond = make()
    with pytest.raises(ValueError, match="through must be an int in"):
        complete("tweedie", Counting(), states, SIGMAS, cond, max_batch=4, through=T + 1)


@pytest.mark.parametrize("method", ["remaining", "substeps:2", "tweedie"])
def test_equal_states_get_equal_completions_whatever_their_batch_position(method):
    """A group's members share x_0; a model whose last bits depend on a row's position in the batch
    (a GEMM's tail handling on some CPUs) must still give them one completion, bit for bit."""

    def position_dependent(x, sigma, cond):
        wobble = 1e-6 * torch.arange(x.shape[0], dtype=x.dtype).reshape(-1, 1, 1, 1)
        return torch.tanh(x) * cond["scale"].reshape(-1, 1, 1, 1) + wobble

    states, _ = make(batch=4)
    states[1, 0] = states[0, 0]  # members 0, 1 share x_0 and their prompt; 2 shares x_0 with another prompt
    states[2, 0] = states[0, 0]
    cond = {"scale": torch.tensor([1.0, 1.0, 1.5, 0.5])}
    latents = complete(method, position_dependent, states, SIGMAS, cond, max_batch=3).latents
    assert torch.equal(latents[0, 0], latents[1, 0])  # equal state, equal conditioning
    assert not torch.equal(latents[0, 0], latents[2, 0])  # equal state, other conditioning
    assert not torch.equal(latents[0, 1], latents[1, 1])  # other states keep their own


def test_the_window_s_last_state_is_completed_by_a_method_that_is_not_the_rollouts_own_ode():
    from stepgrpo_core.completions import completed_through

    # window [0, 3) of 10 steps: remaining's completion of x_3 is x_T itself (copied); substeps and
    # tweedie complete x_3 too, so the last trained gain R_3 - R_2 compares two alike completions
    assert completed_through("remaining", 3, 10) == 3
    assert completed_through("substeps:5", 3, 10) == 4
    assert completed_through("tweedie", 3, 10) == 4
    assert completed_through("substeps:5", 10, 10) == 10  # no window: every state but x_T, as before


def test_rollout_completion_is_the_tweedie_estimate_of_the_sampled_velocities():
    """`rollout` reads the velocities the rollout sampled with: `x_k - sigmas[k] v_k` for every
    state before `through`, 0 NFEs, no model call; bitwise `tweedie` of the same field."""
    g = torch.Generator().manual_seed(3)
    cond = {"scale": torch.linspace(0.5, 1.5, 3)}
    field = Counting()
    traj = rollout(field, torch.randn(3, 2, 3, 3, generator=g), SIGMAS, cond, kernel="flow", noise=0.7, generator=g)
    assert traj.velocities.shape == (3, T, 2, 3, 3)
    # the stored velocity of step k is the field at the stored state x_k
    for k in range(T):
        assert torch.equal(traj.velocities[:, k], field(traj.states[:, k], SIGMAS[k].repeat(3), cond))

    def no_model(*args):
        raise AssertionError("rollout completion called the model")

    out = complete("rollout", no_model, traj.states, SIGMAS, cond, max_batch=4, through=4, velocities=traj.velocities)
    assert out.nfe == 0
    for k in range(4):  # by hand
        assert torch.equal(out.latents[:, k], traj.states[:, k] - SIGMAS[k] * traj.velocities[:, k])
    assert torch.equal(out.latents[:, 4], traj.states[:, -1])  # from `through` on: the sample
    tweedie = complete("tweedie", Counting(), traj.states, SIGMAS, cond, max_batch=4, through=4)
    assert torch.equal(out.latents, tweedie.latents) and tweedie.nfe == 3 * 4
    # without stored velocities (a rollout made before they were kept) it recomputes them
    again = complete("rollout", Counting(), traj.states, SIGMAS, cond, max_batch=4, through=4)
    assert torch.equal(again.latents, out.latents) and again.nfe == 3 * 4
    with pytest.raises(ValueError, match="velocities must be"):
        complete("rollout", no_model, traj.states, SIGMAS, cond, 4, 4, velocities=traj.velocities[:, :2])
