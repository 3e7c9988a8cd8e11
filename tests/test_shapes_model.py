"""The shapes model: the random-weight SD3 builder, the pretraining loop, and the shipped weights."""

import json
import time
from pathlib import Path

import pytest
import torch

from stepgrpo.shapes import data
from stepgrpo.shapes.model import ModelSpec, build_pipeline, build_tokenizer, load_pipeline, tiny_spec

SHIPPED = Path(__file__).resolve().parents[1] / "models" / "shapes"


def _sample(pipe, prompts, seed=0, steps=2, cfg=3.0):
    lat = torch.randn(len(prompts), 4, 8, 8, generator=torch.Generator().manual_seed(seed)).to(pipe.transformer.dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe(
        prompts,
        latents=lat,
        num_inference_steps=steps,
        guidance_scale=cfg,
        height=32,
        width=32,
        max_sequence_length=0,
        output_type="pt",
    ).images


def test_tokenizer_makes_each_word_one_token_deterministically():
    words = data.vocabulary()
    a, b = build_tokenizer(words), build_tokenizer(list(reversed(words)))
    assert a.get_vocab() == b.get_vocab()
    for w in words:
        assert len(a(w, add_special_tokens=False).input_ids) == 1
    ids = a("a blue square left of a green triangle").input_ids
    assert len(ids) == 8 + 2 and ids[0] == a.bos_token_id and ids[-1] == a.eos_token_id


def test_tiny_pipeline_builds_fast_and_samples(tmp_path):
    build_pipeline(tiny_spec())  # first call pays the imports
    t = time.perf_counter()
    pipe = build_pipeline(tiny_spec(), seed=3)
    assert time.perf_counter() - t < 2.0
    images = _sample(pipe, ["two red circles", "a blue square left of a green triangle"])
    assert images.shape == (2, 3, 32, 32) and 0 <= images.min() and images.max() <= 1
    # same seed, same weights; saved and reloaded through diffusers, same images
    again = build_pipeline(tiny_spec(), seed=3)
    assert all(torch.equal(p, q) for p, q in zip(pipe.transformer.parameters(), again.transformer.parameters()))
    pipe.save_pretrained(tmp_path / "p")
    assert torch.allclose(_sample(load_pipeline(tmp_path / "p"), ["two red circles"]), images[:1], atol=1e-5)


def test_default_spec_matches_the_latent_layout():
    spec = ModelSpec()
    assert spec.image_size == data.SIZE and spec.sample_size // spec.patch_size == 4


def test_pretrain_runs_resumes_and_exports(tmp_path):
    from stepgrpo.pretraining.pretrain import PretrainConfig, pretrain

    cfg = PretrainConfig(
        workdir=str(tmp_path / "w"),
        out=str(tmp_path / "out"),
        spec=tiny_spec(),
        vae_minutes=0.01,
        minutes=0.01,
        vae_batch=4,
        batch=4,
        stats_images=256,
        eval_minutes=0,
        threads=1,
    )
    first = pretrain(cfg)
    state = json.loads((tmp_path / "w" / "ckpt" / "state.json").read_text())
    assert state["stage"] == "flow" and state["step"] == first["flow_steps"] >= 1
    # the exported model is not replaced unless asked
    with pytest.raises(ValueError, match="already holds a model.*--overwrite"):
        PretrainConfig(**{**cfg.__dict__, "minutes": 0.02})
    # a second call with a larger budget continues from the checkpoint instead of starting over: a
    # budget above what the first spent (its checkpoint's elapsed time, however slow this CPU was)
    # buys at least one more step
    more = state["elapsed_s"] / 60 + 0.005
    second = pretrain(PretrainConfig(**{**cfg.__dict__, "minutes": more, "overwrite": True}))
    assert second["flow_steps"] > first["flow_steps"] and second["vae_steps"] == first["vae_steps"]
    from safetensors import safe_open

    with safe_open(next((tmp_path / "out" / "transformer").glob("*.safetensors")), "pt") as f:
        assert all(f.get_tensor(k).dtype == torch.float16 for k in f.keys())  # exported in fp16
    pipe = load_pipeline(tmp_path / "out")
    assert pipe.vae.config.scaling_factor == pytest.approx(first["vae_factors"]["scaling_factor"])


@pytest.mark.skipif(not (SHIPPED / "model_index.json").exists(), reason="models/shapes not exported yet")
def test_shipped_model_loads_and_samples():
    size = sum(f.stat().st_size for f in SHIPPED.rglob("*") if f.is_file())
    assert size <= 25 * 2**20
    pipe = load_pipeline(SHIPPED)
    prompts = ["two red circles", "a blue square left of a green triangle", "three yellow triangles", "a purple square"]
    images = _sample(pipe.to(torch.float32), prompts, steps=10, cfg=4.0)
    assert images.shape == (4, 3, 32, 32) and torch.isfinite(images).all()
