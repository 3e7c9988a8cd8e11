"""Name -> implementation registries for kernels, completions, credit schemes and rewards.

Every variant family is a registry of same-signature functions. Names are validated when a
config is built, with an error that lists the known names, so a typo never reaches a run.

An entry may declare facts about itself when it registers (`KERNELS.register("psi",
calibrated=True)`): what the pipeline must do for that variant is read from `facts(name)`, so no
flow or stage tests a variant's name.

Plug-ins (docs/EXTENDING.md): a registry made with an entry-point group also finds entries
outside stepgrpo, by name, the first time they are asked for:

- a reference `package.module:attribute` names an object in the user's own code;
- a name in the entry-point group (`[project.entry-points."stepgrpo.rewards"]`) names one in an
  installed package.

Either object must have been marked for this registry with `registry.plugin(**facts)` (the
`stepgrpo.plugins` decorators), so a name can only ever reach code that declared itself a
plug-in of this family; the family's `check` then validates it (its signature). It is then
registered under the name it was asked by, so every process that meets the name (a Ray worker,
an update process) resolves it the same way.

A stored config is data (docs/RELIABILITY.md, "What is guaranteed"): a reference is imported only
when the user's own input
named it, this command's arguments or their own config file (`allow`), never because a run's
`manifest.json` names it. The allowed references live in the `STEPGRPO_PLUGINS` environment
variable, so the processes a command starts (update ranks, local Ray workers) inherit them. A
`__main__` module (it runs a program when imported) is never imported, and an object's mark is
read without running any of its code (`inspect.getattr_static`) before anything else of it is used.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
from collections.abc import Callable, Iterator, Mapping
from importlib import metadata
from types import MappingProxyType
from typing import Any, Generic, TypeVar

F = TypeVar("F", bound=Callable)


class UnknownNameError(KeyError, ValueError):
    """A registry lookup with a name that is not registered."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


class PluginError(ValueError):
    """A plug-in that cannot be used: its module does not import, it is not marked, or it is malformed."""


PLUGIN_MARK = "__stepgrpo_plugin__"  # set by `Registry.plugin`: {"family": ..., "facts": {...}}
PLUGINS_ENV = "STEPGRPO_PLUGINS"  # the references this process may import, comma-separated (`allow`)
_MISSING = object()


def is_reference(name: str) -> bool:
    """Whether `name` is a `module:attribute` reference (registered names have no colon)."""
    if not isinstance(name, str):
        return False
    module, sep, attr = name.partition(":")
    return bool(sep and module and attr) and all(p.isidentifier() for p in (*module.split("."), *attr.split(".")))


def references_in(value: Any) -> set[str]:
    """Every plug-in reference a config value names: a string (`mypkg.r:Redness`, or a part of a
    weighted spec `mypkg.r:Redness:0.5,shapes:1`), and the strings inside lists and mappings."""
    if isinstance(value, str):
        found = set()
        for item in value.split(","):
            item = item.strip()
            found |= {c for c in (item, item.rpartition(":")[0]) if is_reference(c)}
        return found
    if isinstance(value, Mapping):
        return set().union(*(references_in(v) for v in value.values())) if value else set()
    if isinstance(value, list | tuple):
        return set().union(*(references_in(v) for v in value)) if value else set()
    return set()


def allowed() -> frozenset[str]:
    """The references this process may import: those the user's own input named (`allow`)."""
    return frozenset(r for r in os.environ.get(PLUGINS_ENV, "").split(",") if r)


def allow(*references: str) -> None:
    """Let `references` be imported: call it only with names from the user's own input (command-line
    arguments, their config file, a run form), never with names read from a run directory."""
    new = {r for r in references if is_reference(r)} - allowed()
    for reference in new:
        _refuse_main(reference, "plug-in")
    if new:
        os.environ[PLUGINS_ENV] = ",".join(sorted(allowed() | new))


def _refuse_main(reference: str, family: str) -> None:
    if "__main__" in reference.partition(":")[0].split("."):
        raise PluginError(
            f"{family} {reference!r}: a __main__ module runs a program when it is imported; name the module that "
            "defines the plug-in"
        )


def import_reference(reference: str, family: str) -> object:
    """The object `package.module:attribute` names, with an error that says what is missing. Only a
    reference the user named (`allow`); the attribute is found without running its code."""
    _refuse_main(reference, family)
    if reference not in allowed():
        raise PluginError(
            f"{family} {reference!r} is a plug-in reference that this command was not given: stepgrpo imports no "
            "code because a stored run names it. Name it yourself (--reward / --scheme / --set, your --config, or "
            f"{PLUGINS_ENV}={reference} in the environment), or install it as an entry point (docs/EXTENDING.md)"
        )
    module_name, _, attr = reference.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise PluginError(
            f"{family} {reference!r}: module {module_name!r} cannot be imported ({err}); install the package that "
            "holds it (pip install -e ./mypkg) or put its folder on PYTHONPATH"
        ) from None
    obj: object = module
    for part in attr.split("."):
        obj = inspect.getattr_static(obj, part, _MISSING)
        if obj is _MISSING:
            raise PluginError(f"{family} {reference!r}: module {module_name!r} has no attribute {attr!r}")
    return obj


def takes_positional(name: str, family: str, fn: Any, n: int, expected: str) -> None:
    """A plug-in check: `fn` accepts `n` positional arguments (`expected` says which)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return  # no signature to read (a builtin): it is checked when called
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < n and not any(p.kind is p.VAR_POSITIONAL for p in params):
        raise PluginError(
            f"{family} {name!r}: {getattr(fn, '__qualname__', fn)} takes {len(positional)} positional "
            f"argument(s); expected {expected}"
        )


class Registry(Generic[F]):
    """A named family of same-signature callables.

    >>> KERNELS = Registry("kernel")
    >>> @KERNELS.register("ode")
    ... def ode(...): ...
    >>> KERNELS.get("ode")
    """

    def __init__(
        self,
        family: str,
        entry_points: str | None = None,
        check: Callable[[str, Any], None] | None = None,
        required: tuple[str, ...] = (),
        options: Callable[[str], Mapping[str, Any]] | None = None,
        **defaults: Any,
    ) -> None:
        self.family = family
        self._options = options  # an entry's options and their defaults (for its description)
        # the facts of an entry that declares none; every family's entries may say where they come
        # from (`paper`: an arXiv id with its equation or the paper's own name of the component, or
        # "ours: ..." / "standard: ...") and how a config names them (`pattern`, default: the name)
        self.defaults = {"paper": None, "pattern": None, **defaults}
        self.entry_points = entry_points  # the entry-point group of plug-ins, None: built-ins only
        self._check = check  # validates a plug-in's object (raises PluginError)
        self.required = required  # facts a plug-in must declare itself
        self._items: dict[str, F] = {}
        self._facts: dict[str, Mapping[str, Any]] = {}

    def plugin(self, **facts: Any) -> Callable[[F], F]:
        """Mark `fn` as a plug-in of this registry with its `facts`, without registering it: it is
        registered when a config names it (`module:attr` or its entry point)."""
        unknown = sorted(set(facts) - set(self.defaults))
        if unknown:
            raise PluginError(
                f"{self.family} plug-in: unknown facts {unknown}; this registry knows {sorted(self.defaults)}"
            )
        missing = [f for f in self.required if facts.get(f) in (None, "")]
        if missing:
            raise PluginError(
                f'a {self.family} plug-in must declare {", ".join(missing)} (e.g. version="1"), bumped whenever a '
                "change can change its numbers: it is the plug-in's identity in every cache key and stored row"
            )

        def decorator(fn: F) -> F:
            setattr(fn, PLUGIN_MARK, {"family": self.family, "facts": dict(facts)})
            return fn

        return decorator

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
        if name not in self._items and not self._load(name):
            raise UnknownNameError(
                f"unknown {self.family} {name!r}; known {self.family}s: {', '.join(self.names())}"
                + (
                    f"; or a plug-in: package.module:attribute, or an entry point in {self.entry_points!r}"
                    if self.entry_points
                    else ""
                )
            )
        return self._items[name]

    def _load(self, name: str) -> bool:
        """Register the plug-in `name` names (module:attr, or an entry point); False if it names none."""
        if self.entry_points is None:
            return False
        if is_reference(name):
            obj = import_reference(name, self.family)
        else:
            found = [ep for ep in metadata.entry_points(group=self.entry_points) if ep.name == name]
            if not found:
                return False
            try:
                obj = found[0].load()
            except Exception as err:  # the installed package is broken: say which
                raise PluginError(
                    f"{self.family} {name!r}: entry point {found[0].value!r} ({self.entry_points}) does not load: "
                    f"{type(err).__name__}: {err}"
                ) from None
        mark = inspect.getattr_static(obj, PLUGIN_MARK, None)  # read without running the object's code
        if not isinstance(mark, dict) or mark.get("family") != self.family:
            raise PluginError(
                f"{name!r} is not a stepgrpo {self.family}: mark it with the decorator of stepgrpo.plugins "
                f"(docs/EXTENDING.md)" + (f"; it is marked as a {mark.get('family')}" if isinstance(mark, dict) else "")
            )
        if self._check is not None:
            self._check(name, obj)
        self.register(name, **mark["facts"])(obj)
        return True

    def validate(self, name: str) -> str:
        """Return `name` if registered, else raise the error that lists the known names."""
        self.get(name)
        return name

    def describe(self, name: str) -> dict[str, Any]:
        """An entry as the docs and `stepgrpo config variants` show it: its name, how a config names it,
        its paper and the first sentence of its docstring."""
        fn, facts = self.get(name), self.facts(name)
        doc = " ".join((inspect.getdoc(fn) or "").split("\n\n")[0].split())
        doc = doc.replace(" (module doc)", "")
        first = re.split(r"(?<!\beq)(?<!\be\.g)(?<!\bal)\.\s", doc)[0].rstrip(".") + "." if doc else ""
        options = dict(self._options(name)) if self._options is not None else {}
        return {
            "name": name,
            "pattern": facts["pattern"] or name,
            "options": options,
            "paper": facts["paper"],
            "summary": first,
        }

    def names(self) -> list[str]:
        """The registered names and the installed plug-ins' entry points (not loaded)."""
        plugins = {ep.name for ep in metadata.entry_points(group=self.entry_points)} if self.entry_points else set()
        return sorted(set(self._items) | plugins)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
