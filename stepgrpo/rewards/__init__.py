"""The reward registry with every scorer registered, and `build_reward(spec)`.

Importing this package imports each scorer module so that its factory is in `REWARDS`; the heavy
libraries (transformers, rapidocr) load only when a factory runs.

The registered names: `REWARDS.names()` (`stepgrpo config variants` lists them with what each
scores); `http` is a reward served by `stepgrpo reward-server`, `weighted` a weighted sum of others.

Spec forms accepted by `build_reward`:

    "pickscore"                                      # a registered name, default options
    "mypkg.rewards:Redness"                          # a plug-in (`stepgrpo.plugins`, docs/EXTENDING.md)
    "shapes:1.0,jpeg_compressibility:0.1"            # a weighted sum, `name:weight` pairs
    {"name": "pickscore", "options": {"model": "/models/pickscore"}}   # factory options
    {"name": "weighted", "options": {"parts": [     # a weighted sum of parts with options
        {"name": "shapes", "weight": 1.0},
        {"name": "aesthetic", "weight": 0.1, "options": {"head": "/models/head.pth"}}]}}
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stepgrpo.rewards import clip_models, geneval, jpeg, ocr, preference, remote, shapes  # noqa: F401  (they register)
from stepgrpo.rewards.base import REWARDS, Reward, RewardOutput
from stepgrpo.rewards.combine import WeightedSum
from stepgrpo_core.registry import PluginError, is_reference

__all__ = [
    "REWARDS",
    "Reward",
    "RewardOutput",
    "WeightedSum",
    "build_reward",
    "parse_spec",
    "parse_weights",
    "reward_identity",
]

Spec = str | Mapping[str, Any]


def parse_weights(spec: str) -> list[tuple[str, float]]:
    """`"shapes:1.0,jpeg_compressibility:0.1"` -> `[("shapes", 1.0), ("jpeg_compressibility", 0.1)]`.

    A part without `:weight` gets weight 1 (a plug-in reference `mypkg.rewards:Redness` is a name;
    `mypkg.rewards:Redness:0.5` weighs it). Names are checked against `REWARDS`.
    """
    parts = []
    for item in spec.split(","):
        item = item.strip()
        name, sep, weight = item.rpartition(":")
        if not sep or _plugin_reference(item):
            name, value = item, 1.0
        else:
            try:
                value = float(weight)
            except ValueError:
                raise ValueError(f"reward spec {spec!r}: weight {weight!r} of {name!r} is not a number") from None
        parts.append((REWARDS.validate(name.strip()), value))
    return parts


def weighted_spec(spec: str) -> bool:
    """Whether a spec string is a weighted sum (`a:1,b:0.1`), not one name or plug-in reference."""
    return "," in spec or (":" in spec and not _plugin_reference(spec))


def _plugin_reference(item: str) -> bool:
    """`mypkg.rewards:Redness` (not `shapes:heavy`, a registered name with a bad weight)."""
    return is_reference(item) and item.partition(":")[0] not in REWARDS


@dataclass(frozen=True)
class Part:
    """One reward of a spec: its registered name (or plug-in reference), factory options, weight."""

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)
    weight: float = 1.0


def parse_spec(spec: Spec) -> Part | list[Part]:
    """The one reading of a reward spec (module doc): one reward, or the parts of a weighted sum."""
    if isinstance(spec, str):
        if weighted_spec(spec):
            return [Part(name, {}, w) for name, w in parse_weights(spec)]
        return Part(spec)
    if isinstance(spec, Mapping):
        unknown = set(spec) - {"name", "options"}
        if unknown or "name" not in spec:
            raise ValueError(f"a reward spec mapping has keys 'name' and optional 'options', got {sorted(spec)}")
        return Part(spec["name"], dict(spec.get("options") or {}))
    raise TypeError(f"a reward spec is a string or a mapping, got {type(spec).__name__}")


def weighted_parts(parts: str | Mapping[str, float] | Sequence[Mapping[str, Any]]) -> list[tuple[Spec, float]]:
    """The `weighted` reward's parts, in any of its forms, as `(spec, weight)` pairs."""
    if isinstance(parts, str):
        return [(name, w) for name, w in parse_weights(parts)]
    if isinstance(parts, Mapping):
        return [(name, float(w)) for name, w in parts.items()]
    out: list[tuple[Spec, float]] = []
    for part in parts:
        unknown = set(part) - {"name", "weight", "options"}
        if unknown:
            raise ValueError(f"a weighted part has keys name, weight, options; got unknown {sorted(unknown)}")
        out.append(({"name": part["name"], "options": part.get("options") or {}}, float(part.get("weight", 1.0))))
    return out


def build_reward(spec: Spec) -> Reward:
    """Build a reward from a name, a `name:weight,...` string or a `{"name", "options"}` mapping."""
    parsed = parse_spec(spec)
    if isinstance(parsed, list):
        return WeightedSum([(_built(p.name, p.options), p.weight) for p in parsed])
    return _built(parsed.name, parsed.options)


def _built(name: str, options: Mapping[str, Any]) -> Reward:
    """`REWARDS[name](**options)`, given the name and version its identity declares where it
    carries none (a plug-in's factory function may return a bare callable). That a reward's own
    name and version are its declared ones is checked where rewards are built for a run
    (`stepgrpo.loops.workspace.reward`)."""
    reward = REWARDS.get(name)(**options)
    if not callable(reward):
        raise PluginError(f"reward {name!r}: its factory returned {type(reward).__name__}, not a callable reward")
    for attr, value in zip(("name", "version"), _identity(name, options)):
        if getattr(reward, attr, None) is None:
            setattr(reward, attr, value)
    return reward


def reward_identity(spec: Spec) -> tuple[str, str]:
    """`(name, version)` of the reward `build_reward(spec)` would build, from the registry's
    declared identities: no model is loaded. Bad options fail as the factory would fail."""
    parsed = parse_spec(spec)
    if isinstance(parsed, list):
        return _weighted_identity([(_identity(p.name, p.options), p.weight) for p in parsed])
    return _identity(parsed.name, parsed.options)


def _identity(name: str, options: Mapping[str, Any]) -> tuple[str, str]:
    factory = REWARDS.get(name)
    try:
        bound = inspect.signature(factory).bind(**options)
    except TypeError as err:
        raise TypeError(f"reward {name!r}: {err}") from None
    bound.apply_defaults()
    identity = REWARDS.facts(name)["identity"]
    if identity is None:
        raise TypeError(f"reward {name!r} declares no identity: register it with identity=... (stepgrpo.rewards.base)")
    return identity(**bound.arguments)


def _weighted_identity(parts: Sequence[tuple[tuple[str, str], float]]) -> tuple[str, str]:
    """What `WeightedSum` names itself from its parts' identities and weights."""
    return ",".join(f"{n}:{float(w):g}" for (n, _), w in parts), ",".join(f"{n}={v}" for (n, v), _ in parts)


def _weighted_parts_identity(parts: str | Mapping[str, float] | Sequence[Mapping[str, Any]]) -> tuple[str, str]:
    return _weighted_identity([(reward_identity(spec), w) for spec, w in weighted_parts(parts)])


@REWARDS.register("weighted", identity=_weighted_parts_identity)
def weighted(parts: str | Mapping[str, float] | Sequence[Mapping[str, Any]]) -> WeightedSum:
    """A weighted sum. parts: `"a:1,b:0.1"`, `{"a": 1, "b": 0.1}`, or a list of
    `{"name", "weight" (default 1), "options" (default none)}` mappings."""
    return WeightedSum([(build_reward(spec), w) for spec, w in weighted_parts(parts)])
