"""Rewards and credit schemes from outside stepgrpo (docs/EXTENDING.md).

Mark the factory of a reward, or a scheme function, in your own package or file; then name it in
a config or on the command line by reference or by entry point:

    # mypkg/rewards.py
    from stepgrpo.plugins import reward

    @reward(version="1")
    class Redness:
        name = "redness"
        def __init__(self, target: float = 1.0): ...
        def __call__(self, images, prompts, metadata) -> RewardOutput: ...

    reward.name: mypkg.rewards:Redness                 # a config (or --reward on the command line)
    [project.entry-points."stepgrpo.rewards"]          # or, in mypkg's pyproject.toml,
    redness = "mypkg.rewards:Redness"                  # then reward.name: redness

The name and the version are the plug-in's identity: every stored reward row and every cache key
names them, so bump the version whenever a change can change the numbers. A plug-in is validated
when a config names it, like the built-ins: a module that does not import, an object that is not
marked, a wrong signature or a missing version is a config error that says so.

A reference is imported only when the user's own input names it: a command's `--reward` /
`--scheme` / `--set`, their `--config` file, the Prefect run form, `STEPGRPO_PLUGINS` in the
environment, or `allow("mypkg.rewards:Redness")` in their own Python code. A reference that only a
stored run's manifest names is never imported (an installed entry point is: it is installed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from stepgrpo.rewards.base import REWARDS
from stepgrpo_core.credit import SCHEMES
from stepgrpo_core.registry import PluginError, allow

T = TypeVar("T", bound=Callable[..., Any])

__all__ = ["PluginError", "allow", "reward", "scheme"]


def reward(
    *, version: str | None = None, name: str | None = None, identity: Callable[..., tuple[str, str]] | None = None
) -> Callable[[T], T]:
    """Mark a reward factory (a class, or a function that returns the reward) as a plug-in.

    Args:
        version: Required; bump it whenever a change can change the scores.
        name: The name stored with its rows; default the class's `name` attribute, else its `__name__`.
        identity: `identity(**options) -> (name, version)` when options change what it computes
            in a way its options alone do not show (default: `(name, version)`; the options are
            part of every cache key in any case).
    """
    _require_version(version, "reward")

    def decorate(factory: T) -> T:
        declared = name or (factory.name if isinstance(getattr(factory, "name", None), str) else factory.__name__)

        def constant(**options: Any) -> tuple[str, str]:
            return declared, str(version)

        return REWARDS.plugin(identity=identity or constant)(factory)

    return decorate


def scheme(*, version: str | None = None, step_rewards: bool = True) -> Callable[[T], T]:
    """Mark a credit scheme `fn(rewards [B, T+1], gains [B, T], groups, **options) -> advantages
    [B, T]` (or `(advantages, turning mask)`) as a plug-in; options are keyword arguments with
    defaults. `step_rewards=False`: it reads only `R_T` (works on runs scored on final samples)."""
    _require_version(version, "credit scheme")
    return SCHEMES.plugin(version=str(version), step_rewards=bool(step_rewards))


def _require_version(version: str | None, family: str) -> None:
    if version is None or str(version).strip() == "":
        raise PluginError(
            f'a {family} plug-in needs a version: @{family.split()[-1]}(version="1"); bump it whenever a change '
            "can change its numbers (stored rows and cache keys name it)"
        )
