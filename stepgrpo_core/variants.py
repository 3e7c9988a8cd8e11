"""The core's variant families in one table: every built-in kernel, completion method, credit scheme
and objective, as its registry describes it (`Registry.describe`). docs/METHODS.md's variants table
and `stepgrpo config variants` are this module's output; the registries are the only list."""

from __future__ import annotations

import re
from collections.abc import Mapping

from .completions import COMPLETIONS
from .credit import SCHEMES
from .kernels import KERNELS
from .objectives import OBJECTIVES
from .papers import PAPERS
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


ARXIV = re.compile(r"arXiv (\d{4}\.\d{4,5})")


def papers_table(registries: Mapping[str, Registry]) -> str:
    """Every paper of `stepgrpo_core.papers` beside the built-in entries of `registries` whose
    `paper` fact cites it (a heading -> registry), as the Markdown table between docs/METHODS.md's
    `papers` markers (`stepgrpo config variants --papers`). A fact citing a paper missing from the
    bibliography is refused."""
    cited: dict[str, list[str]] = {}
    for heading, registry in registries.items():
        for name in sorted(registry._items):
            for arxiv in ARXIV.findall(registry.facts(name)["paper"] or ""):
                cited.setdefault(arxiv, []).append(f"{heading} `{registry.describe(name)['pattern']}`")
    missing = sorted(set(cited) - set(PAPERS))
    if missing:
        raise ValueError(f"registry entries cite arXiv {', '.join(missing)}: add each to stepgrpo_core.papers.PAPERS")
    rows = ["| arXiv | paper | what a config names of it |", "|---|---|---|"]
    for arxiv in sorted(PAPERS):
        what = ", ".join(dict.fromkeys(cited.get(arxiv, []))) or "- (cited where its piece is implemented)"
        rows.append(f"| {arxiv} | {PAPERS[arxiv]} | {what} |")
    return "\n".join(rows) + "\n"
