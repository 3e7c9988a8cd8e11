"""The core registries (one per variant family) and the conditioning pytree helpers."""

import re
from typing import NamedTuple

import pytest
import torch

from stepgrpo_core import COMPLETIONS, KERNELS, SCHEMES, Registry, UnknownNameError
from stepgrpo_core.conditioning import batch_size, repeat_interleave, take


def test_register_get_validate():
    reg = Registry("widget")

    @reg.register("b")
    def b():
        return "b"

    @reg.register("a")
    def a():
        return "a"

    assert reg.get("a")() == "a" and reg.validate("b") == "b"
    assert reg.names() == ["a", "b"] and list(reg) == ["a", "b"] and "a" in reg and "c" not in reg
    with pytest.raises(UnknownNameError, match=r"unknown widget 'c'; known widgets: a, b"):
        reg.get("c")
    with pytest.raises(ValueError, match="registered twice"):
        reg.register("a")(a)


def test_core_families():
    # facts of the built-ins, not a list of them: the defaults a config uses are registered, and an
    # unknown name is refused with the registry's own list
    assert {"ode", "flow"} <= set(KERNELS) and "remaining" in COMPLETIONS and "outcome" in SCHEMES
    for reg in (KERNELS, COMPLETIONS, SCHEMES):
        with pytest.raises(KeyError, match=f"known {reg.family}s: {', '.join(reg.names())}"):
            reg.validate("nope")


# an arXiv id with an equation or the paper's own quoted name for the component, or ours / standard
PAPER = re.compile(r'arXiv \d{4}\.\d{4,5}, (eq\. \d+|"[^"]+")|^(ours|standard): \S')


@pytest.mark.parametrize("family", ["kernel", "completion", "credit scheme", "objective"])
def test_every_core_entry_says_where_it_comes_from_and_what_it_does(family):
    from stepgrpo_core.variants import core_registries

    registry = core_registries()[family]
    for name in registry:
        d = registry.describe(name)
        assert d["paper"] and PAPER.search(d["paper"]), (name, d["paper"])
        assert len(d["summary"]) > 20 and d["summary"].endswith("."), (name, d["summary"])
        assert d["pattern"].split(":")[0] == name
        if registry.facts(name).get("argument") is not None:  # a method with an argument names it
            assert ":" in d["pattern"], name


def test_the_methods_doc_holds_the_registries_table():
    """docs/METHODS.md's variants table is the registries' (regenerate: `stepgrpo config variants
    --markdown`), so a new built-in shows there or this test names it."""
    from pathlib import Path

    from stepgrpo_core.variants import core_registries, markdown_table

    text = (Path(__file__).resolve().parents[1] / "docs" / "METHODS.md").read_text()
    start = text.index("-->\n", text.index("<!-- variants:")) + 4
    assert text[start : text.index("<!-- /variants -->")] == markdown_table(core_registries())


def test_the_papers_table_is_generated_and_the_bibliography_is_what_the_code_cites():
    """docs/METHODS.md's papers table is `stepgrpo config variants --papers` (the bibliography beside
    the registries' `paper` facts); every arXiv id the code cites is in the bibliography, and every
    paper in it is cited by the code."""
    import re
    from pathlib import Path

    from stepgrpo.families import families
    from stepgrpo_core.papers import PAPERS
    from stepgrpo_core.variants import papers_table

    root = Path(__file__).resolve().parents[1]
    text = (root / "docs" / "METHODS.md").read_text()
    start = text.index("-->\n", text.index("<!-- papers:")) + 4
    assert text[start : text.index("<!-- /papers -->")] == papers_table(families())
    folders = ("stepgrpo", "stepgrpo_cli", "stepgrpo_core", "flows", "tasks", "storage")
    code = {p.resolve() for d in folders for p in (root / d).rglob("*.py")} - {(root / "stepgrpo_core" / "papers.py")}
    cited = {m for p in code for m in re.findall(r"arXiv (\d{4}\.\d{4,5})", p.read_text())}
    assert cited == set(PAPERS), (sorted(cited - set(PAPERS)), sorted(set(PAPERS) - cited))


class Pair(NamedTuple):
    emb: torch.Tensor
    mask: torch.Tensor


def test_take_selects_rows_of_every_leaf():
    cond = {
        "emb": torch.arange(4.0).reshape(4, 1),
        "pooled": (torch.arange(4), [torch.arange(8).reshape(4, 2)]),
        "neg": None,
        "scale": 4.5,
        "pair": Pair(torch.arange(4), torch.ones(4, 3)),
    }
    idx = torch.tensor([2, 0, 2])
    out = take(cond, idx)
    assert out["emb"].reshape(-1).tolist() == [2.0, 0.0, 2.0]
    assert out["pooled"][0].tolist() == [2, 0, 2] and isinstance(out["pooled"], tuple)
    assert out["pooled"][1][0].tolist() == [[4, 5], [0, 1], [4, 5]] and isinstance(out["pooled"][1], list)
    assert out["neg"] is None and out["scale"] == 4.5
    assert isinstance(out["pair"], Pair) and out["pair"].emb.tolist() == [2, 0, 2]
    assert take(None, idx) is None
    assert take(torch.arange(4), idx).tolist() == [2, 0, 2]


def test_take_rejects_bad_input():
    with pytest.raises(TypeError, match="LongTensor"):
        take({"e": torch.zeros(3)}, torch.tensor([0.0]))
    with pytest.raises(TypeError, match="pytree"):
        take({"e": object()}, torch.tensor([0]))
    with pytest.raises(ValueError, match="leading batch dim"):
        take({"e": torch.tensor(1.0)}, torch.tensor([0]))


def test_repeat_interleave_and_batch_size():
    cond = {"e": torch.tensor([[1.0], [2.0]]), "s": 3}
    out = repeat_interleave(cond, 3)
    assert out["e"].reshape(-1).tolist() == [1, 1, 1, 2, 2, 2] and out["s"] == 3
    assert batch_size(out) == 6 and batch_size(None) is None
    with pytest.raises(ValueError, match="disagree"):
        batch_size({"a": torch.zeros(2), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match="positive int"):
        repeat_interleave(cond, 0)


def test_entries_declare_facts_over_the_registry_defaults():
    reg = Registry("thing", fast=False)

    @reg.register("a", fast=True)
    def a():
        return 1

    @reg.register("b")
    def b():
        return 2

    assert reg.facts("a")["fast"] is True and reg.facts("b")["fast"] is False
    with pytest.raises(ValueError, match="unknown facts"):
        reg.register("c", slow=True)
    with pytest.raises(UnknownNameError):
        reg.facts("missing")
    with pytest.raises(TypeError):
        reg.facts("a")["fast"] = False  # read-only


def test_the_variants_carry_the_facts_the_pipeline_reads():
    from stepgrpo_core.credit import SCHEMES
    from stepgrpo_core.kernels import KERNELS

    assert [k for k in KERNELS if KERNELS.facts(k)["calibrated"]] == ["psi"]
    assert KERNELS.facts("psi")["calibrate_with"] in SCHEMES
    final_only = [s for s in SCHEMES if not SCHEMES.facts(s)["step_rewards"]]
    assert "outcome" in final_only and not {"stepwise", "dense", "turning_point"} & set(final_only)
