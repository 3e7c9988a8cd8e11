"""The reward contract: one signature for every scorer, named and versioned.

A reward is built once from a factory in `REWARDS` (models load there) and then called as
`reward(images, prompts, metadata) -> RewardOutput` with

- `images`: float tensor `[N, 3, H, W]` in [0, 1] (convert with `stepgrpo.images`);
- `prompts`: `N` strings;
- `metadata`: `N` dicts (structured prompt facts, e.g. the shapes task's objects), may be empty.

`name` and `version` go into every stored reward row: bump `version` whenever a change to a
scorer can change its numbers, so old and new scores are never mixed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from stepgrpo_core.registry import PluginError, Registry, takes_positional


@dataclass(frozen=True)
class RewardOutput:
    """Scores of `N` images."""

    scores: torch.Tensor  # [N] float32, the reward that training maximises
    strict: torch.Tensor | None = None  # [N] float32 in {0, 1} where the scorer has it (GenEval-style)
    sub: Mapping[str, torch.Tensor] = field(default_factory=dict)  # name -> [N], NaN where not applicable


def checked(out: Any, n: int, name: str) -> RewardOutput:
    """`out`, what reward `name` returned for `n` images, if it keeps the contract: a
    `RewardOutput` whose `scores`, `strict` and every `sub` hold `n` numbers each (as float tensors).
    Else a ValueError naming the reward and what is wrong: an extra or a missing score would shift
    every stored row silently."""

    def vector(value: Any, what: str) -> torch.Tensor:
        try:
            t = torch.as_tensor(value, dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(
                f"reward {name!r} returned {what} of type {type(value).__name__}, not {n} numbers"
            ) from None
        if t.dim() != 1 or len(t) != n:
            raise ValueError(
                f"reward {name!r} returned {what} of shape {tuple(t.shape)} for {n} images; it must return one "
                "number per image, in the order given"
            )
        return t

    if not isinstance(out, RewardOutput):
        raise ValueError(f"reward {name!r} returned a {type(out).__name__}, not a RewardOutput(scores, strict, sub)")
    if not isinstance(out.sub, Mapping) or not all(isinstance(k, str) for k in out.sub):
        raise ValueError(f"reward {name!r} returned sub-scores that are not a mapping of names to scores")
    return RewardOutput(
        scores=vector(out.scores, "scores"),
        strict=None if out.strict is None else vector(out.strict, "strict"),
        sub={k: vector(v, f"sub-score {k!r}") for k, v in out.sub.items()},
    )


class Reward(Protocol):
    name: str
    version: str

    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardOutput: ...


# name -> factory(**options) -> Reward. Fact `identity(**options) -> (name, version)`: the name and
# version the built reward would carry, computed from the options alone (no model is loaded), so
# a stage's cache key can name the reward without building it (`stepgrpo.rewards.reward_identity`).
def check_reward(name: str, factory: Any) -> None:
    """A reward plug-in is a callable factory; a class's instances take `(images, prompts, metadata)`."""
    if not callable(factory):
        raise PluginError(f"reward {name!r}: {factory!r} is not callable (mark a class or a factory function)")
    if isinstance(factory, type):
        call = next((c.__dict__["__call__"] for c in factory.__mro__ if "__call__" in c.__dict__), None)
        if call is None:
            raise PluginError(f"reward {name!r}: class {factory.__name__} has no __call__(images, prompts, metadata)")
        takes_positional(name, "reward", call, 4, "__call__(self, images, prompts, metadata)")


# Plug-ins (`stepgrpo.plugins.reward`): `module:attr` references and the `stepgrpo.rewards` entry points.
# Facts: `identity` (options -> (name, version)); `hub`, the options whose values are hub ids of weights
# the reward loads (checked before a run starts: `stepgrpo.checks.check_reward_weights`).
REWARDS: Registry = Registry(
    "reward", entry_points="stepgrpo.rewards", check=check_reward, required=("identity",), identity=None, hub=()
)
