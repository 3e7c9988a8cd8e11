"""The core registries (one per variant family) and the conditioning pytree helpers."""

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
    assert KERNELS.names() == ["cps", "ddim", "flow", "ode", "psi"]
    assert COMPLETIONS.names() == ["remaining", "rollout", "substeps", "tweedie"]
    assert SCHEMES.names() == ["dense", "outcome", "stepwise", "turning_point"]
    for reg in (KERNELS, COMPLETIONS, SCHEMES):
        with pytest.raises(KeyError, match="known"):
            reg.validate("nope")


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
    assert [s for s in SCHEMES if not SCHEMES.facts(s)["step_rewards"]] == ["outcome"]
