"""Name -> implementation registries for kernels, completions, credit schemes and rewards.

Every variant family is a registry of same-signature functions. Names are validated when a
config is built, with an error that lists the known names, so a typo never reaches a run.

An entry may declare facts about itself when it registers (`KERNELS.register("psi",
calibrated=True)`): what the pipeline must do for that variant is read from `facts(name)`, so no
flow or stage tests a variant's name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, Generic, TypeVar

F = TypeVar("F", bound=Callable)


class UnknownNameError(KeyError, ValueError):
    """A registry lookup with a name that is not registered."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


class Registry(Generic[F]):
    """A named family of same-signature callables.

    >>> KERNELS = Registry("kernel")
    >>> @KERNELS.register("ode")
    ... def ode(...): ...
    >>> KERNELS.get("ode")
    """

    def __init__(self, family: str, **defaults: Any) -> None:
        self.family = family
        self.defaults = dict(defaults)  # the facts of an entry that declares none
        self._items: dict[str, F] = {}
        self._facts: dict[str, Mapping[str, Any]] = {}

    def register(self, name: str, **facts: Any) -> Callable[[F], F]:
        """Register `fn` under `name`; `facts` override the registry's defaults for this entry."""
        unknown = sorted(set(facts) - set(self.defaults))
        if unknown:
            raise ValueError(
                f"{self.family} {name!r}: unknown facts {unknown}; this registry knows {sorted(self.defaults)}"
            )

        def decorator(fn: F) -> F:
            if name in self._items:
                raise ValueError(f"{self.family} {name!r} is registered twice")
            self._items[name] = fn
            self._facts[name] = MappingProxyType({**self.defaults, **facts})
            return fn

        return decorator

    def facts(self, name: str) -> Mapping[str, Any]:
        """What the entry declared about itself (read-only), with the registry's defaults."""
        self.get(name)
        return self._facts[name]

    def get(self, name: str) -> F:
        try:
            return self._items[name]
        except KeyError:
            raise UnknownNameError(
                f"unknown {self.family} {name!r}; known {self.family}s: {', '.join(self.names())}"
            ) from None

    def validate(self, name: str) -> str:
        """Return `name` if registered, else raise the error that lists the known names."""
        self.get(name)
        return name

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
