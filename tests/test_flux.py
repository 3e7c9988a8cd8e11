"""The Flux-shaped policy on a tiny random-weight `FluxPipeline` built from configs: the rollout
equals the pipeline's sampling, LoRA on / off, the saved LoRA loads into a stock pipeline, and one
training iteration of every credit scheme runs through the stages unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stepgrpo.policy import policy_class
from stepgrpo.policy.flux import FLUX_LORA_TARGETS, FluxPolicy, pack, unpack
from stepgrpo.policy.lora import LoraSpec
from stepgrpo.policy.sd3 import SD3Policy
from stepgrpo.shapes.model import tiny_flux_pipeline
from stepgrpo_core.rollout import rollout

RESOLUTION = 32  # pixels; the tiny VAE halves it: 16 x 16 latents, 8 x 8 = 64 packed tokens


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("flux") / "tiny-flux"
    tiny_flux_pipeline().save_pretrained(str(path))
    return path


TINY_LORA = LoraSpec(4, 8, FLUX_LORA_TARGETS)


def policy(path, lora: LoraSpec | None = TINY_LORA) -> FluxPolicy:
    torch.manual_seed(0)
    return FluxPolicy.from_pretrained(path, "float32", "cpu", guidance_scale=3.5, lora=lora, resolution=RESOLUTION)


def test_the_policy_class_comes_from_model_index(flux_dir, tmp_path):
    import json

    from stepgrpo.paths import REPO_ROOT, SHIPPED_MODEL

    assert policy_class(str(flux_dir)) is FluxPolicy
    assert policy_class(str(REPO_ROOT / SHIPPED_MODEL)) is SD3Policy
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "KandinskyPipeline"}))
    with pytest.raises(
        ValueError, match="is a KandinskyPipeline; stepgrpo trains FluxPipeline, StableDiffusion3Pipeline"
    ):
        policy_class(str(tmp_path))


def test_pack_and_unpack_are_inverse():
    x = torch.randn(2, 4, 6, 8)
    assert pack(x).shape == (2, 12, 16)
    assert torch.equal(unpack(pack(x), 6, 8), x)


def test_an_ode_rollout_equals_flux_pipelines_sampling(flux_dir):
    from diffusers import FluxPipeline

    pol = policy(flux_dir, lora=None)
    assert pol.latent_shape == (4, 16, 16) and not pol.do_cfg
    prompts = ["two red circles", "a blue square"]
    x0 = pol.initial_noise(2, torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = rollout(pol.velocity, x0, pol.sigmas(4), pol.encode(prompts), kernel="ode").states[:, -1]
    pipe = FluxPipeline.from_pretrained(str(flux_dir))
    theirs = pipe(
        prompt=prompts, latents=pack(x0), num_inference_steps=4, guidance_scale=3.5, height=RESOLUTION,
        width=RESOLUTION, output_type="latent", max_sequence_length=pol.max_sequence_length,
    ).images  # fmt: skip
    torch.testing.assert_close(ours, unpack(theirs, 16, 16), rtol=1e-4, atol=1e-5)
    assert pol.nfe == 2 * 4  # one transformer row per velocity row: no CFG pass
    images = pol.decode_uint8(ours)
    assert images.shape == (2, 3, RESOLUTION, RESOLUTION) and images.dtype == torch.uint8


def test_lora_on_off_and_its_export_loads_into_a_stock_flux_pipeline(flux_dir, tmp_path):
    from diffusers import FluxPipeline

    pol = policy(flux_dir)
    with torch.no_grad():
        for p in pol.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.2)
    x = pol.initial_noise(2, torch.Generator().manual_seed(1))
    sigma = torch.full((2,), 0.6)
    cond = pol.encode(["two red circles", "a blue square"])
    with torch.no_grad():
        v = pol.velocity(x, sigma, cond)
        with pol.reference():
            v_base = pol.velocity(x, sigma, cond)
    assert not torch.allclose(v, v_base)
    torch.testing.assert_close(v_base, policy(flux_dir, lora=None).velocity(x, sigma, cond).detach())

    pol.save_lora(tmp_path / "lora")
    pipe = FluxPipeline.from_pretrained(str(flux_dir))
    pipe.load_lora_weights(str(tmp_path / "lora"))
    stock = FluxPolicy.from_pipeline(pipe, "float32", "cpu", guidance_scale=3.5, resolution=RESOLUTION)
    with torch.no_grad():
        torch.testing.assert_close(stock.velocity(x, sigma, cond), v, rtol=1e-4, atol=1e-5)
    again = policy(flux_dir)
    again.load_lora(tmp_path / "lora")  # the round trip into a policy
    with torch.no_grad():
        torch.testing.assert_close(again.velocity(x, sigma, cond), v)


@pytest.mark.slow  # a Prefect test server
@pytest.mark.parametrize(
    ("scheme", "completion"),
    [("outcome", "null"), ("stepwise", "remaining"), ("dense", "remaining"), ("turning_point", "substeps:2")],
)
def test_one_training_iteration_of_every_scheme_on_flux(harness, flux_dir, tmp_path, scheme, completion):
    from stepgrpo.flows.train import train
    from stepgrpo.storage.run import Run

    over = [
        f"model.path={flux_dir}", f"model.resolution={RESOLUTION}", "model.guidance_scale=3.5", "model.lora_rank=4",
        "model.lora_alpha=8", f"model.lora_targets={list(FLUX_LORA_TARGETS)}", "sampler.steps=3",
        "sampler.eval_steps=3", f"completion.method={completion}", f"credit.scheme={scheme}",
        "reward.name=jpeg_compressibility", "run.iterations=1", "run.prompts_per_iteration=2", "run.group_size=2",
        "run.eval_prompts=2", "optim.kl_beta=0.01", "optim.micro_batch=2",
    ]  # fmt: skip
    out = train(overrides=over, run_dir=str(tmp_path / scheme))
    run = Run.open(out["run_dir"])
    assert run.stages.read_array(0, "rollout", "states").shape == (4, 4, 4, 16, 16)  # unpacked latents, T + 1 states
    assert run.stage_manifest(0, "checkpoint") is not None
    assert (Path(out["run_dir"]) / "lora" / "pytorch_lora_weights.safetensors").is_file()
    assert [e["label"] for e in out["evaluations"]] == ["base", "iter_0"]
