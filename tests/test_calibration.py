"""DenseGRPO psi calibration (METHODS.md, "DenseGRPO exploration calibration")."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stepgrpo_core.calibration import initial_psi, update_psi
from stepgrpo_core.kernels import step_moments

SIGMAS = torch.tensor([1.0, 0.9, 0.6, 0.3, 0.0])


def test_initial_psi_is_the_flow_scale():
    psi = initial_psi(SIGMAS, a=0.7)
    # a sqrt(s / (1 - s)) per step; at s = 1 (step 0) sigmas[1] = 0.9 stands in for s in the
    # denominator only (Flow-GRPO): a sqrt(1 / 0.1)
    expected = [0.7 * math.sqrt(1 / 0.1)] + [0.7 * math.sqrt(s / (1 - s)) for s in (0.9, 0.6, 0.3)]
    assert psi.shape == (4,)
    torch.testing.assert_close(psi, torch.tensor(expected))


def test_psi_kernel_with_initial_table_equals_flow_kernel():
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(2, 1, 3, 3, generator=g), torch.randn(2, 1, 3, 3, generator=g)
    psi = initial_psi(SIGMAS, a=0.7)
    for k in range(4):
        flow = step_moments("flow", x, v, SIGMAS[k], SIGMAS[k + 1], 0.7)
        table = step_moments("psi", x, v, SIGMAS[k], SIGMAS[k + 1], psi[k])
        torch.testing.assert_close(table, flow)


def test_update_worked_example():
    # eps1 = 2, eps2 = 0.01; N = 4 trajectories, T = 4 steps
    gains = torch.tensor(
        [
            [1.0, 1.0, 1.0, 0.0],
            [-1.0, 1.0, 1.0, 0.0],
            [1.0, 1.0, 1.0, 0.0],
            [-1.0, -1.0, 1.0, 0.0],
        ]
    )
    # |#pos - #neg| per step: |2-2| = 0 (<2: +), |3-1| = 2 (not <2: -), |4-0| = 4 (-),
    # |0-0| = 0 (+; zeros count as neither)
    psi = torch.tensor([0.5, 0.5, 0.005, 0.5])
    new = update_psi(psi, gains, eps1=2, eps2=0.01)
    torch.testing.assert_close(new, torch.tensor([0.51, 0.49, 0.0, 0.51]))  # 0.005 - 0.01 clamps to 0


@settings(max_examples=30, deadline=None, derandomize=True)
@given(st.integers(1, 8), st.integers(1, 5), st.integers(0, 2**16), st.integers(1, 4))
def test_update_equals_loop(n, t, seed, eps1):
    g = torch.Generator().manual_seed(seed)
    gains = torch.randint(-1, 2, (n, t), generator=g).float()
    psi = torch.rand(t, generator=g) * 0.05
    new = update_psi(psi, gains, eps1=eps1, eps2=0.01)
    for k in range(t):  # plain loop
        pos = sum(1 for i in range(n) if gains[i, k] > 0)
        neg = sum(1 for i in range(n) if gains[i, k] < 0)
        expected = psi[k].item() + (0.01 if abs(pos - neg) < eps1 else -0.01)
        assert new[k].item() == pytest.approx(max(expected, 0.0), abs=1e-7)


def test_invalid_inputs():
    with pytest.raises(ValueError, match=r"psi must be \[T\] and gains \[N, T\]"):
        update_psi(torch.zeros(3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="eps2"):
        update_psi(torch.zeros(3), torch.zeros(2, 3), eps2=-1)
    with pytest.raises(ValueError, match="a must be >= 0"):
        initial_psi(SIGMAS, a=-0.1)
