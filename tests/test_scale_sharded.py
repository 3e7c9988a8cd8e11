"""The update sharded with FSDP2 over two CPU ranks (`scale.update_sharding: fsdp`, gloo): on the
same inputs it computes what the all-reduce and the one-process update compute, for LoRA and full
fine-tuning, GRPO (with its KL reference) and a matching objective; ranks with unequal shares run
filler passes; a rank killed mid-update fails the stage and the rerun gives the same bytes; the
checkpoints are whole tensors, as an unsharded run writes them.

The tolerance: FSDP sums each backward's gradient across ranks as it goes (reduce-scatter), where
the unsharded update sums each rank's accumulated gradient once a step, and the gradient norm is
summed from the ranks' shards: the same terms added in another order, which fp32 rounds differently
(a few units in the 8th digit after two AdamW steps)."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from scale_fixtures import _train, reference, tiny  # noqa: F401  (fixtures)

from stepgrpo.storage.run import Run

pytestmark = pytest.mark.slow

SHARDED = ("scale.update_processes=2", "scale.update_sharding=fsdp")
ATOL = 1e-6  # absolute, on weights and AdamW moments of order 1e-3 .. 1 (module doc)


def checkpoint(run_dir: Path, iteration: int) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted((run_dir / "checkpoints" / f"iter_{iteration}").glob("*.safetensors")):
        out.update({f"{f.stem}/{n}": t for n, t in load_file(str(f)).items()})
    return out


def resumed(clean: Path, where: Path, *overrides: str) -> Path:
    """`clean` with its last update removed, computed again with `overrides`."""
    shutil.copytree(clean, where)
    shutil.rmtree(where / "checkpoints" / "iter_1")
    return where


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name, x in a.items():
        assert x.dtype == b[name].dtype and x.shape == b[name].shape, name
        if x.is_floating_point():
            torch.testing.assert_close(b[name], x, rtol=0, atol=ATOL, msg=name)
        else:
            assert torch.equal(x, b[name]), name


def test_the_sharded_lora_update_matches_and_a_killed_rank_reruns_to_the_same_bytes(
    harness, tiny, reference, tmp_path, monkeypatch
):
    """GRPO with LoRA (the scale tests' reference run): the sharded update of iteration 1 equals the
    one-process update's; killed in one rank and rerun, it equals itself uninterrupted, bit for bit."""
    clean = resumed(reference, tmp_path / "sharded")
    _train(tiny, clean, *SHARDED)
    inputs = Run.open(clean).stage_manifest(1, "checkpoint")["inputs"]
    assert inputs["sharding"] == "fsdp" and inputs["processes"] == 2
    assert_close(checkpoint(reference, 1), checkpoint(clean, 1))
    assert not torch.equal(checkpoint(reference, 1)["lora/" + LORA_A], checkpoint(reference, 0)["lora/" + LORA_A])

    killed = resumed(reference, tmp_path / "killed")
    monkeypatch.setenv("STEPGRPO_FAULT", f"kill:update:1:{tmp_path / 'fired'}")  # the last rank dies, once
    with pytest.raises(Exception, match=rf"update over 2 processes failed \(rank 1 on {socket.gethostname()}"):
        _train(tiny, killed, *SHARDED)
    assert Run.open(killed).stage_manifest(1, "checkpoint") is None  # nothing half-published
    monkeypatch.delenv("STEPGRPO_FAULT")
    _train(tiny, killed, *SHARDED)
    a, b = checkpoint(clean, 1), checkpoint(killed, 1)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


LORA_A = "transformer_blocks.0.attn.to_q.lora_A.default.weight"

# unequal shares: 12 trajectories in 4 parts of 3, a micro-batch a trajectory, so one rank has a cell
# more than the other at every step and the other runs a filler pass
UNEVEN = ("run.prompts_per_iteration=4", "optim.optimizer_steps=4", "optim.micro_batch=1")
LIGHT = ("completion.method=null", "credit.scheme=outcome", "run.eval_prompts=2", "run.eval_seeds=1")
CASES = {
    # every weight trained; the KL reference is the frozen copy, sharded the same way
    "full_grpo_kl": ("model.finetune=full", "optim.lr=1e-5", "optim.kl_beta=0.01", *UNEVEN, *LIGHT),
    # a matching objective: its companion adapter swapped in and out of the sharded weights
    "lora_nft": (
        "update.objective=nft",
        "sampler.kernel=ode",
        "sampler.shared_x0=false",
        *UNEVEN,
        *LIGHT,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_sharded_update_matches_the_unsharded_one(harness, tiny, case, tmp_path):
    clean = tmp_path / "clean"
    _train(tiny, clean, *CASES[case])
    sharded = resumed(clean, tmp_path / "sharded")
    _train(tiny, sharded, *CASES[case], *SHARDED)
    assert Run.open(sharded).stage_manifest(1, "checkpoint")["inputs"]["sharding"] == "fsdp"
    assert_close(checkpoint(clean, 1), checkpoint(sharded, 1))


def test_sharding_settings_that_cannot_work_are_refused_before_anything_runs():
    from stepgrpo.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="update_processes to 2 or more"):
        load_config(None, ["scale.update_sharding=fsdp"])
    with pytest.raises(ConfigError, match="set scale.update_sharding: fsdp"):
        load_config(None, ["scale.update_offload=true", "scale.update_processes=2"])
    with pytest.raises(ConfigError, match="in host memory already"):
        load_config(None, ["scale.update_offload=true", "scale.update_processes=2", "scale.update_sharding=fsdp"])
