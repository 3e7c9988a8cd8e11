"""The update's memory formula (`stepgrpo.runtime.memory`): its counts are the model's, its terms
shrink with the shards as the sharded update's do, and a configuration that cannot fit on its GPU
is refused with the terms and the fixes. bench/scale/sharded.py reads it against what the ranks of
a sharded run hold."""

from __future__ import annotations

import pytest
import torch

from stepgrpo.config import load_config
from stepgrpo.paths import SHIPPED_MODEL, SHIPPED_ROOT
from stepgrpo.runtime import memory


def test_the_counts_are_the_shipped_models():
    from diffusers import SD3Transformer2DModel
    from safetensors.torch import load_file

    root = SHIPPED_ROOT / SHIPPED_MODEL
    counts = memory.model_counts(root, 32, ("to_q", "to_k"))
    transformer = SD3Transformer2DModel.from_pretrained(root / "transformer")
    assert counts.transformer == sum(p.numel() for p in transformer.parameters())
    blocks = transformer.transformer_blocks
    assert counts.block == max(sum(p.numel() for p in b.parameters()) for b in blocks)
    linears = [m for n, m in transformer.named_modules() if n.endswith((".to_q", ".to_k"))]
    assert counts.lora == sum(32 * (m.in_features + m.out_features) for m in linears)
    stored = sum(
        t.numel()
        for d in root.iterdir()
        if d.is_dir() and d.name != "transformer"
        for f in d.glob("*.safetensors")
        for t in load_file(str(f)).values()
    )
    assert counts.encoders == stored


def test_sharding_divides_the_sharded_terms_and_not_the_encoders():
    counts = memory.ModelCounts(transformer=8_000, block=1_000, lora=100, encoders=5_000)
    one = memory.update_states(counts, dtype="bfloat16", full=True, shards=1, ema=True, companion=True)["device"]
    four = memory.update_states(counts, dtype="bfloat16", full=True, shards=4, ema=True, companion=True)["device"]
    for term in ("weights", "gradients", "AdamW", "reference", "EMA", "companion", "initial"):
        assert four[term] == one[term] // 4
    assert one["weights"] == 16_000 and one["AdamW"] == 32_000 and one["reference"] == 16_000
    assert four["encoders"] == one["encoders"] == 10_000 and one["gathered"] == 0 and four["gathered"] == 4_000
    off = memory.update_states(counts, dtype="bfloat16", full=True, shards=4, offload=True)
    assert set(off["device"]) == {"gathered", "encoders"} and off["host"]["weights"] == 4_000


def test_a_configuration_that_cannot_fit_its_gpu_is_refused_with_the_fixes():
    cfg = load_config(None, ["model.finetune=full", "model.device=cuda"])
    counts = memory.ModelCounts(transformer=2_000_000_000, block=100_000_000, lora=0, encoders=0)
    with pytest.raises(
        ValueError, match=r"need .* GiB a rank .* the GPU has 16.0 GiB: set scale.update_sharding: fsdp"
    ):
        memory.check_fits(cfg, counts, 16 << 30)
    memory.check_fits(cfg, counts, 120 << 30)  # fits: nothing said


def test_the_train_check_reads_the_models_counts(monkeypatch):
    from stepgrpo.checks import check_memory
    from stepgrpo.errors import StageError

    cfg = load_config(None, ["model.finetune=full", "model.device=cuda"])
    with pytest.raises(StageError, match="the update's states need"):
        check_memory(cfg, capacity=1 << 20)
    check_memory(cfg, capacity=1 << 40)
    check_memory(load_config(None, ["model.finetune=full"]), capacity=1)  # a CPU run: nothing to check


def test_held_bytes_counts_each_storage_once():
    before = memory.held_bytes()
    a = torch.zeros(1 << 20)  # 4 MiB
    view = a[: 1 << 10]  # the same storage
    after = memory.held_bytes()
    assert 4 << 20 <= after - before < (4 << 20) + (1 << 16)
    del a, view
