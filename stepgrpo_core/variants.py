"""The core's variant families in one table: every built-in kernel, completion method, credit scheme
and objective, as its registry describes it (`Registry.describe`). docs/METHODS.md's variants table
and `stepgrpo config variants` are this module's output; the registries are the only list."""

from __future__ import annotations

from collections.abc import Mapping

from .completions import COMPLETIONS
from .credit import SCHEMES
from .kernels import KERNELS
from .objectives import OBJECTIVES
from .registry import Registry


def core_registries() -> dict[str, Registry]:
    """The core's variant families, by the heading the docs give them."""
    return {"kernel": KERNELS, "completion": COMPLETIONS, "credit scheme": SCHEMES, "objective": OBJECTIVES}


def markdown_table(registries: Mapping[str, Registry]) -> str:
    """The variants of `registries` (a heading -> registry) as one Markdown table, built-ins only:
    what docs/METHODS.md holds between its `variants` markers and `stepgrpo config variants
    --markdown` prints."""
    rows = ["| family | a config names it | options | paper | what it does |", "|---|---|---|---|---|"]
    for heading, registry in registries.items():
        for name in sorted(registry._items):
            d = registry.describe(name)
            options = ", ".join(f"`{k}`: {v if isinstance(v, str) else repr(v)}" for k, v in d["options"].items())
            options = options or "-"
            cell = d["summary"].replace("|", "\\|")
            rows.append(f"| {heading} | `{d['pattern']}` | {options} | {d['paper'] or '-'} | {cell} |")
    return "\n".join(rows) + "\n"
