"""An exact velocity field, so the kernels, rollouts and completions can be tested without a model.

Data that is a single point `mu` under the rectified flow `x_s = (1 - s) mu + s x1`,
`x1 ~ N(0, I)`: given `x_s`, the noise is `x1 = (x_s - (1 - s) mu) / s`, so the exact velocity
`v = x1 - x0` is

    v(x, s) = (x - (1 - s) mu) / s - mu = (x - mu) / s,

and the marginal at level `s` is `N((1 - s) mu, s^2 I)`. Every Tweedie estimate is exact here:
`x0_hat = x - s v = mu` and `x1_hat = x + (1 - s) v = x1`. The field is affine in `x`, so a
Gaussian state stays Gaussian under every kernel, and it is elementwise, so results do not depend
on how rows are batched.
"""

from __future__ import annotations

from typing import Any

import torch


class PointMassFlow:
    """The exact flow towards the single data point `mu` (`[C, H, W]` or broadcastable).

    Call it as `velocity(x [B,C,H,W], sigma [B], cond) -> v`; `cond` is ignored. `nfe` counts the
    velocity rows evaluated and `calls` the batch size of each call (for NFE and batching tests).
    """

    def __init__(self, mu: torch.Tensor) -> None:
        self.mu = mu
        self.nfe = 0
        self.calls: list[int] = []

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, cond: Any = None) -> torch.Tensor:
        self.nfe += x.shape[0]
        self.calls.append(x.shape[0])
        s = sigma.reshape(-1, *([1] * (x.dim() - 1))).to(x.dtype)
        return ((x - self.mu.to(x)) / s).to(x.dtype)

    def marginal(self, sigma: float) -> tuple[torch.Tensor, float]:
        """Mean `(1 - s) mu` and std `s` of the flow's marginal at level `sigma`."""
        return (1.0 - sigma) * self.mu, sigma
