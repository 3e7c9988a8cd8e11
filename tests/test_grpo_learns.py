"""End to end on an exact toy flow: GRPO with every credit scheme moves the policy towards reward.

The policy is the exact velocity field of Gaussian data `N(mu, tau^2 I)` under the rectified flow,
with `mu` the only trainable parameter; the reward is `-||x - target||^2`. Rollouts, completions,
credit and the update are the production code (`stepgrpo_core` and `stepgrpo.loops.training.update`),
so a sign error anywhere in log-probs, advantages or the loss makes the reward fall instead.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from stepgrpo.config import load_config
from stepgrpo.loops import training
from stepgrpo_core.completions import complete
from stepgrpo_core.credit import assign
from stepgrpo_core.rollout import rollout

TAU = 0.5
T, GROUPS, G = 6, 4, 8
TARGET = torch.tensor([1.5, -1.0]).reshape(2, 1, 1)


class GaussianFlow(torch.nn.Module):
    """Exact velocity `E[x1 - x0 | x_s]` for data `x0 ~ N(mu, tau^2)`, noise `x1 ~ N(0, 1)`."""

    def __init__(self) -> None:
        super().__init__()
        self.mu = torch.nn.Parameter(torch.zeros(2, 1, 1))

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond=None) -> torch.Tensor:
        s = sigma.reshape(-1, 1, 1, 1).to(x.dtype)
        a = 1 - s
        var = a**2 * TAU**2 + s**2
        d = x - a * self.mu
        return s / var * d - (self.mu + a * TAU**2 / var * d)


class ToyPolicy:
    """What `training.update` uses of a policy: velocity, trainable parameters, the module."""

    def __init__(self) -> None:
        self.transformer = GaussianFlow()
        self.velocity = self.transformer

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [self.transformer.mu]

    @contextlib.contextmanager
    def reference(self):
        raise AssertionError("no KL term in this test")
        yield


def reward(x: torch.Tensor) -> torch.Tensor:
    return -((x - TARGET) ** 2).flatten(-3).mean(-1)


@pytest.mark.parametrize("scheme", ["outcome", "stepwise", "dense", "turning_point"])
def test_grpo_moves_the_policy_towards_the_reward(scheme):
    torch.manual_seed(0)
    cfg = load_config(
        None,
        [
            f"credit.scheme={scheme}",
            f"sampler.steps={T}",
            "optim.lr=0.05",
            "optim.clip_range=0.2",
            "optim.kl_beta=0",
            "optim.weight_decay=0",
            "optim.micro_batch=8",
            "optim.max_grad_norm=100",
        ],
    )
    pol = ToyPolicy()
    opt = training.make_optimizer(pol.trainable_parameters(), cfg)
    sigmas = torch.linspace(1, 0, T + 1)
    group_ids = torch.arange(GROUPS).repeat_interleave(G)
    gen = torch.Generator().manual_seed(0)
    means = []
    for it in range(25):
        x0 = torch.randn(GROUPS, 2, 1, 1, generator=gen).repeat_interleave(G, 0)
        with torch.no_grad():
            out = rollout(pol.velocity, x0, sigmas, None, kernel="flow", noise=0.7, generator=gen)
            if scheme == "outcome":
                rewards = reward(out.states[:, -1]).unsqueeze(1).expand(-1, T + 1).contiguous()
            else:
                rewards = reward(complete("remaining", pol.velocity, out.states, sigmas, None, 64).latents)
        means.append(float(rewards[:, -1].mean()))
        credit = assign(scheme, rewards, group_ids)
        training.update(
            pol,
            opt,
            cfg,
            training.Batch(out.states, out.log_probs, credit.advantages, group_ids, None, sigmas, "flow", 0.7),
            torch.Generator().manual_seed(it),
        )
    start = float(((torch.zeros(2, 1, 1) - TARGET) ** 2).sum().sqrt())
    end = float(((pol.transformer.mu.detach() - TARGET) ** 2).sum().sqrt())
    assert end < 0.5 * start, (scheme, start, end)
    assert sum(means[-5:]) / 5 > sum(means[:5]) / 5 + 0.5, means
