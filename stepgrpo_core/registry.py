"""Name -> implementation registries for kernels, completions, credit schemes and rewards.

Every variant family is a registry of same-signature functions. Names are validated when a
config is built, with an error that lists the known names, so a typo never reaches a run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

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

    def __init__(self, family: str) -> None:
        self.family = family
        self._items: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def decorator(fn: F) -> F:
            if name in self._items:
                raise ValueError(f"{self.family} {name!r} is registered twice")
            self._items[name] = fn
            return fn

        return decorator

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
