"""Training options beyond a fresh LoRA: LR schedules, gradient checkpointing, starting from a
LoRA (`model.init_lora`), full fine-tuning with a frozen or EMA reference."""

from __future__ import annotations

import pytest
import torch

from stepgrpo.config import ConfigError, load_config
from stepgrpo.loops import training, workspace
from stepgrpo.policy.lora import LoraSpec
from stepgrpo.policy.sd3 import SD3Policy
from stepgrpo.shapes.model import build_pipeline, tiny_spec
from stepgrpo_core.rollout import rollout, step_log_prob


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny-sd3"
    build_pipeline(tiny_spec(), seed=0).save_pretrained(str(path))
    return path


def test_learning_rate_schedules():
    def rates(*over, n=12):
        cfg = load_config(None, ["optim.lr=1.0", *over]).optim
        return [cfg.lr_at(i) for i in range(n)]

    assert rates() == [1.0] * 12
    assert rates("optim.lr_schedule=warmup", "optim.warmup_iterations=4", n=6) == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cosine = rates("optim.lr_schedule=cosine", "optim.warmup_iterations=2", "optim.lr_horizon=10", "optim.lr_final=0.1")
    assert cosine[:3] == pytest.approx([0.5, 1.0, 1.0])
    assert cosine[6] == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the decay
    assert cosine[10:] == pytest.approx([0.1, 0.1])  # held at the end
    assert all(a >= b for a, b in zip(cosine[2:], cosine[3:]))
    with pytest.raises(ConfigError, match="lr_horizon"):
        load_config(None, ["optim.lr_schedule=cosine"])
    with pytest.raises(ConfigError, match="warmup_iterations >= 1"):
        load_config(None, ["optim.lr_schedule=warmup"])
    cfg = load_config(None, ["optim.lr=1.0", "optim.lr_schedule=warmup", "optim.warmup_iterations=4"])
    opt = training.make_optimizer([torch.nn.Parameter(torch.zeros(1))], cfg, iteration=1)
    assert opt.param_groups[0]["lr"] == 0.5  # the update's optimizer runs at its iteration's rate


def _grads(pol: SD3Policy) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    cond = pol.encode(["two red circles", "a blue square"])
    x0 = pol.initial_noise(2, g)
    out = rollout(pol.velocity, x0, pol.sigmas(3), cond, kernel="flow", noise=0.7, generator=g)
    step_log_prob(pol.velocity, out.states, pol.sigmas(3), cond, 1, "flow", 0.7).log_prob.sum().backward()
    return [p.grad.clone() for p in pol.trainable_parameters()]


def test_gradient_checkpointing_gives_the_same_gradients(tiny_model):
    def policy(checkpointing):
        torch.manual_seed(0)
        return SD3Policy.from_pretrained(
            tiny_model, "float32", "cpu", lora=LoraSpec(4, 8), gradient_checkpointing=checkpointing
        )

    plain, checkpointed = policy(False), policy(True)
    assert checkpointed.transformer.is_gradient_checkpointing and not plain.transformer.is_gradient_checkpointing
    for a, b in zip(_grads(plain), _grads(checkpointed), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def _cfg(tiny_model, *over):
    return load_config(
        None, [f"model.path={tiny_model}", "model.lora_rank=4", "model.lora_alpha=8", "model.guidance_scale=1", *over]
    )


def test_a_run_starts_from_another_runs_lora(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(workspace, "_policies", {})
    base = _cfg(tiny_model)
    pol = workspace.policy(base)
    with torch.no_grad():
        for p in pol.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.1)
    trained = workspace.lora_state(pol)
    pol.save_lora(tmp_path / "other-run" / "lora")  # what a finished run exports
    fresh = workspace.initial_lora(base)
    workspace.set_lora(pol, fresh)

    started = _cfg(tiny_model, f"model.init_lora={tmp_path / 'other-run'}")
    initial = workspace.initial_lora(started)
    assert all(torch.equal(initial[n], trained[n]) for n in trained)
    assert not all(torch.equal(fresh[n], trained[n]) for n in trained)
    # the file itself, too; its contents are the identity, not its path
    file = tmp_path / "other-run" / "lora" / "pytorch_lora_weights.safetensors"
    same = workspace.policy_identity(_cfg(tiny_model, f"model.init_lora={file}").model)
    assert same == workspace.policy_identity(started.model) != workspace.policy_identity(base.model)

    with pytest.raises(ValueError, match="r=4, the policy 8: set model.lora_rank: 4"):
        workspace.policy(_cfg(tiny_model, "model.lora_rank=8", "model.lora_alpha=8", f"model.init_lora={file}"))
    with pytest.raises(ValueError, match="lora_alpha=8.0, the policy 16.0: set model.lora_alpha: 8.0"):
        workspace.policy(_cfg(tiny_model, "model.lora_alpha=16", f"model.init_lora={file}"))
    with pytest.raises(FileNotFoundError, match="no LoRA at"):
        workspace.policy(_cfg(tiny_model, f"model.init_lora={tmp_path / 'nothing'}"))
    with pytest.raises(ConfigError, match="with model.finetune: full there is none"):
        _cfg(tiny_model, "model.finetune=full", f"model.init_lora={file}")


def test_full_fine_tuning_trains_every_weight_against_a_frozen_reference(tiny_model, monkeypatch):
    monkeypatch.setattr(workspace, "_policies", {})
    cfg = _cfg(tiny_model, "model.finetune=full", "optim.kl_beta=0.1", "sampler.steps=3")
    pol = workspace.policy(cfg)
    assert pol.lora is None and len(pol.trainable_parameters()) == len(list(pol.transformer.parameters()))
    before = workspace.lora_state(pol)
    opt = training.make_optimizer(pol.trainable_parameters(), cfg)
    g = torch.Generator().manual_seed(0)
    cond = pol.encode(["two red circles"] * 4)
    with torch.no_grad():
        out = rollout(pol.velocity, pol.initial_noise(4, g), pol.sigmas(3), cond, kernel="flow", noise=0.7, generator=g)
    adv = torch.tensor([[1.0] * 3, [-1.0] * 3, [0.5] * 3, [-0.5] * 3])
    batch = training.Batch(
        out.states, out.log_probs, adv, torch.zeros(4, dtype=torch.long), cond, pol.sigmas(3), "flow", 0.7
    )
    summary = training.update(pol, opt, cfg, batch, torch.Generator().manual_seed(1))
    after = workspace.lora_state(pol)
    assert sum(float((after[n] - before[n]).abs().sum()) > 0 for n in before) > len(before) // 2  # most weights moved
    reference = dict(pol._reference.named_parameters())
    assert all(torch.equal(reference[n], before[n]) for n in before)  # the reference stayed the base model
    x = out.states[:, 1]
    sigma = pol.sigmas(3)[1].expand(4)
    with torch.no_grad(), pol.reference():
        v_ref = pol.velocity(x, sigma, cond)
    with torch.no_grad():
        v = pol.velocity(x, sigma, cond)
    assert not torch.allclose(v, v_ref)
    assert summary["optimizer_steps"] >= 1
    # an EMA reference is loaded into the reference transformer
    pol.set_reference(after)
    with torch.no_grad(), pol.reference():
        torch.testing.assert_close(pol.velocity(x, sigma, cond), v)
    with pytest.raises(ConfigError, match="kl_reference ema"):
        _cfg(tiny_model, "optim.kl_reference=ema")
