"""The SD3 policy adapter on a tiny random-weight SD3 pipeline saved to a temporary directory.

The oracle throughout is diffusers itself: a direct transformer call, and `StableDiffusion3Pipeline`
sampling the same latents over the same grid.
"""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from diffusers import StableDiffusion3Pipeline  # noqa: E402

from stepgrpo.policy import base  # noqa: E402
from stepgrpo.policy.lora import TARGETS, LoraSpec  # noqa: E402
from stepgrpo.policy.sd3 import SD3Policy  # noqa: E402
from stepgrpo.shapes.model import build_pipeline, tiny_spec  # noqa: E402
from stepgrpo_core.rollout import rollout  # noqa: E402

PROMPTS = ["a red circle", "two blue squares", "a green triangle"]
STEPS = 4
LORA = LoraSpec(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A random-weight pipeline (no adapter) saved once; every test loads its own copy."""
    path = tmp_path_factory.mktemp("tiny_sd3")
    build_pipeline(tiny_spec(), seed=0).save_pretrained(path)
    return path


def fresh_pipe(base_dir):
    """A stock pipeline loaded straight from disk (no T5 in the tiny model)."""
    return StableDiffusion3Pipeline.from_pretrained(base_dir, text_encoder_3=None, tokenizer_3=None)


def noise(policy, batch, seed=0):
    return policy.initial_noise(batch, torch.Generator().manual_seed(seed))


def perturb_lora(policy, seed=1):
    """LoRA B starts at zero (the adapter is a no-op); give it random weights."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))


def pipeline_latents(pipe, x0, guidance_scale):
    """The final latents of the stock pipeline sampling from `x0` over `STEPS` steps."""
    out = pipe(
        PROMPTS,
        latents=x0,
        num_inference_steps=STEPS,
        guidance_scale=guidance_scale,
        max_sequence_length=0,  # no T5: zero T5 tokens, as the policy encodes
        output_type="latent",
    )
    return out.images


@pytest.mark.parametrize("guidance_scale", [1.0, 3.0])
def test_encode_shapes(base_dir, guidance_scale):
    policy = SD3Policy.from_pretrained(base_dir, guidance_scale=guidance_scale)
    cond = policy.encode(PROMPTS)
    spec = tiny_spec()
    keys = {"prompt_embeds", "pooled_prompt_embeds"}
    if guidance_scale > 1:
        keys |= {"negative_prompt_embeds", "negative_pooled_prompt_embeds"}
    assert set(cond) == keys
    for name, leaf in cond.items():
        assert leaf.shape[0] == len(PROMPTS) and leaf.dtype == torch.float32, name
    # both CLIPs' hidden states side by side; no T5 tokens appended
    assert cond["prompt_embeds"].shape[1:] == (16, 2 * spec.text_dim)
    assert cond["pooled_prompt_embeds"].shape[1:] == (2 * spec.projection_dim,)
    assert policy.latent_shape == (spec.latent_channels, spec.sample_size, spec.sample_size)


def test_velocity_matches_a_direct_transformer_call(base_dir):
    policy = SD3Policy.from_pretrained(base_dir, guidance_scale=3.0, max_batch=4)
    cond = policy.encode(PROMPTS)
    x = noise(policy, 3)
    sigma = torch.tensor([1.0, 0.5, 0.1])
    with torch.no_grad():
        v = policy.velocity(x, sigma, cond)
        direct = policy.transformer(
            hidden_states=torch.cat([x, x]),
            timestep=torch.cat([sigma, sigma]) * 1000,
            encoder_hidden_states=torch.cat([cond["negative_prompt_embeds"], cond["prompt_embeds"]]),
            pooled_projections=torch.cat([cond["negative_pooled_prompt_embeds"], cond["pooled_prompt_embeds"]]),
            return_dict=False,
        )[0]
    uncond, conditional = direct.chunk(2)
    assert torch.allclose(v, uncond + 3.0 * (conditional - uncond), atol=1e-5)
    # max_batch=4 transformer rows = 2 guided rows per chunk: 3 rows ran as chunks of 2 and 1
    assert policy.nfe == 3  # guided rows count once
    whole = SD3Policy.from_pretrained(base_dir, guidance_scale=3.0, max_batch=64)
    with torch.no_grad():
        assert torch.allclose(whole.velocity(x, sigma, whole.encode(PROMPTS)), v, atol=1e-5)


def test_sigmas_are_the_schedulers_grid(base_dir):
    policy = SD3Policy.from_pretrained(base_dir)
    scheduler = fresh_pipe(base_dir).scheduler
    scheduler.set_timesteps(10)
    sigmas = policy.sigmas(10)
    assert sigmas.shape == (11,) and sigmas.dtype == torch.float32
    assert torch.equal(sigmas, scheduler.sigmas.float())
    assert sigmas[0] == 1.0 and sigmas[-1] == 0.0 and (sigmas.diff() < 0).all()


@pytest.mark.parametrize("guidance_scale", [1.0, 3.0])
def test_ode_rollout_reproduces_the_pipeline(base_dir, guidance_scale):
    policy = SD3Policy.from_pretrained(base_dir, guidance_scale=guidance_scale)
    x0 = noise(policy, len(PROMPTS))
    with torch.no_grad():
        ours = rollout(policy.velocity, x0, policy.sigmas(STEPS), policy.encode(PROMPTS), kernel="ode")
    theirs = pipeline_latents(fresh_pipe(base_dir), x0, guidance_scale)
    assert ours.states.shape == (3, STEPS + 1, *policy.latent_shape)
    assert torch.allclose(ours.states[:, -1], theirs, atol=1e-5)
    assert policy.nfe == 3 * STEPS
    # decoding matches the pipeline's own VAE decode + postprocess
    images = policy.decode(ours.states[:, -1])
    pipe = fresh_pipe(base_dir)
    expected = pipe(
        PROMPTS,
        latents=x0,
        num_inference_steps=STEPS,
        guidance_scale=guidance_scale,
        max_sequence_length=0,
        output_type="pt",
    ).images
    assert images.shape == (3, 3, 32, 32) and 0 <= images.min() and images.max() <= 1
    assert torch.allclose(images, expected, atol=1e-5)


def test_decode_respects_vae_scale_and_shift(base_dir):
    pipe = fresh_pipe(base_dir)
    pipe.vae.register_to_config(scaling_factor=1.5, shift_factor=0.25)
    policy = SD3Policy.from_pipeline(pipe)
    z = noise(policy, 2)
    with torch.no_grad():
        expected = (pipe.vae.decode(z / 1.5 + 0.25).sample / 2 + 0.5).clamp(0, 1)
    assert torch.allclose(policy.decode(z), expected, atol=1e-6)


def test_lora_changes_the_output_and_reference_restores_the_base(base_dir):
    base = SD3Policy.from_pretrained(base_dir, guidance_scale=3.0)
    policy = SD3Policy.from_pretrained(base_dir, guidance_scale=3.0, lora=LORA)
    cond, x, sigma = policy.encode(PROMPTS), noise(policy, 3), torch.tensor([0.9, 0.5, 0.2])
    with torch.no_grad():
        v_base = base.velocity(x, sigma, cond)
        # a fresh adapter (B = 0) is a no-op
        assert torch.allclose(policy.velocity(x, sigma, cond), v_base, atol=1e-6)
        perturb_lora(policy)
        assert not torch.allclose(policy.velocity(x, sigma, cond), v_base, atol=1e-3)
        with policy.reference():
            assert torch.allclose(policy.velocity(x, sigma, cond), v_base, atol=1e-6)
        assert not torch.allclose(policy.velocity(x, sigma, cond), v_base, atol=1e-3)
    # only the adapter trains: A and B of every targeted projection in every block
    trainable = policy.trainable_parameters()
    assert all(".lora_" in n for n, p in policy.transformer.named_parameters() if p.requires_grad)
    # A and B per target per block, less `to_add_out` of the last block (context_pre_only: no text output)
    assert len(trainable) == 2 * len(TARGETS) * tiny_spec().layers - 2
    loss = policy.velocity(x, sigma, cond).square().mean()
    loss.backward()
    assert all(p.grad is not None for p in trainable)


def test_lora_round_trip_through_load_lora_weights(base_dir, tmp_path):
    policy = SD3Policy.from_pretrained(base_dir, guidance_scale=3.0, lora=LORA)
    perturb_lora(policy)
    policy.save_lora(tmp_path / "lora")
    x0 = noise(policy, 3)
    with torch.no_grad():
        ours = rollout(policy.velocity, x0, policy.sigmas(STEPS), policy.encode(PROMPTS), kernel="ode")
    # a fresh stock pipeline reads the file with its own loader and samples identically
    pipe = fresh_pipe(base_dir)
    pipe.load_lora_weights(tmp_path / "lora")
    assert torch.allclose(pipeline_latents(pipe, x0, 3.0), ours.states[:, -1], atol=1e-5)
    # and a fresh policy's load_lora gives the same velocity
    other = SD3Policy.from_pretrained(base_dir, guidance_scale=3.0, lora=LORA)
    other.load_lora(tmp_path / "lora")
    sigma, cond = torch.full((3,), 0.7), policy.encode(PROMPTS)
    with torch.no_grad():
        assert torch.equal(other.velocity(x0, sigma, cond), policy.velocity(x0, sigma, cond))
    wrong = SD3Policy.from_pretrained(base_dir, lora=LoraSpec(rank=2, alpha=4.0))
    with pytest.raises(ValueError, match="rank"):
        wrong.load_lora(tmp_path / "lora")


def test_errors_name_the_fix(base_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(base, "DEFAULT_MODEL", tmp_path / "models" / "shapes")
    with pytest.raises(FileNotFoundError, match="stepgrpo pretrain"):
        SD3Policy.from_pretrained()
    with pytest.raises(FileNotFoundError, match="no SD3 pipeline directory"):
        SD3Policy.from_pretrained(tmp_path / "nowhere")
    policy = SD3Policy.from_pretrained(base_dir)
    with pytest.raises(ValueError, match="no LoRA adapter"):
        policy.save_lora(tmp_path / "x")
    with pytest.raises(ValueError, match="x must be"):
        policy.velocity(torch.zeros(2, 4, 4, 4), torch.ones(2), policy.encode(PROMPTS[:2]))
    with pytest.raises(ValueError, match="targets"):
        SD3Policy.from_pretrained(base_dir, lora=LoraSpec(targets=("no_such_module",)))


@pytest.mark.skipif(not base.DEFAULT_MODEL.is_dir(), reason="the shipped model is built by `stepgrpo pretrain`")
def test_shipped_model_loads_and_samples():
    policy = SD3Policy.from_pretrained(guidance_scale=2.5)
    x0 = noise(policy, 2)
    with torch.no_grad():
        final = rollout(policy.velocity, x0, policy.sigmas(4), policy.encode(PROMPTS[:2]), kernel="ode").states[:, -1]
    images = policy.decode(final)
    assert images.shape[:2] == (2, 3) and torch.isfinite(images).all()


def test_detached_uncond_trains_through_the_conditional_branch_only(base_dir):
    cfg_policy = SD3Policy.from_pretrained(base_dir, guidance_scale=3.0, lora=LORA)
    cond_policy = SD3Policy.from_pretrained(base_dir, guidance_scale=1.0, lora=LORA)
    perturb_lora(cfg_policy)
    perturb_lora(cond_policy)
    cond, x, sigma = cfg_policy.encode(PROMPTS), noise(cfg_policy, 3), torch.tensor([0.9, 0.5, 0.2])
    with torch.no_grad():
        plain = cfg_policy.velocity(x, sigma, cond)
    with cfg_policy.detached_uncond():
        v = cfg_policy.velocity(x, sigma, cond)
    torch.testing.assert_close(v.detach(), plain)  # the same values
    v.sum().backward()
    # v = v_u + s (v_c - v_u) with v_u detached: the gradient is s times that of v_c alone
    cond_policy.velocity(x, sigma, cond_policy.encode(PROMPTS)).sum().backward()
    for a, b in zip(cfg_policy.trainable_parameters(), cond_policy.trainable_parameters()):
        torch.testing.assert_close(a.grad, 3.0 * b.grad, rtol=1e-4, atol=1e-6)
    assert not cfg_policy._detach_uncond  # restored after the block


def test_loading_a_policy_prints_no_loading_bars(base_dir, capfd, monkeypatch):
    """transformers' and diffusers' per-component "Loading weights" bars stay off the user's terminal."""
    from stepgrpo.config import load_config
    from stepgrpo.loops import workspace

    monkeypatch.setattr(workspace, "_policies", {})
    workspace.policy(load_config(None, [f"model.path={base_dir}", "model.lora_rank=4", "model.lora_alpha=8"]))
    assert "Loading weights" not in capfd.readouterr().err
