"""The policy update loop: optimizer steps per iteration, trained steps, micro-batches, diagnostics."""

from __future__ import annotations

import contextlib

import pytest
import torch

from stepgrpo.config import load_config
from stepgrpo.loops import training
from stepgrpo_core.rollout import rollout

T, GROUPS, G = 4, 4, 4
SIGMAS = torch.linspace(1, 0, T + 1)
# the config of every update here: the batch's shape, no KL, a wide clip
SMALL = [f"sampler.steps={T}", f"run.prompts_per_iteration={GROUPS}", f"run.group_size={G}", "optim.kl_beta=0"]
SMALL += ["optim.clip_range=0.2"]


class LinearField(torch.nn.Module):
    """`v = W x + b(sigma)`: a tiny trainable velocity with gradients for every step."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.eye(2) * 0.1)
        self.b = torch.nn.Parameter(torch.zeros(2))
        self.reference = False  # True: the initial weights (the KL reference)

    def forward(self, x, sigma, cond=None):
        w, b = (torch.eye(2) * 0.1, torch.zeros(2)) if self.reference else (self.w, self.b)
        return torch.einsum("ij,bjhw->bihw", w, x) + (b * sigma.reshape(-1, 1)).reshape(-1, 2, 1, 1)


class Policy:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.transformer = LinearField()
        self.velocity = self.transformer
        self.steps_seen: list[int] = []

    def trainable_parameters(self):
        return list(self.transformer.parameters())

    @contextlib.contextmanager
    def reference(self):
        """The weights the field started with (as a LoRA adapter switched off)."""
        self.transformer.reference = True
        try:
            yield
        finally:
            self.transformer.reference = False


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(GROUPS, 2, 1, 1, generator=g).repeat_interleave(G, 0)
    pol = Policy()
    with torch.no_grad():
        out = rollout(pol.velocity, x0, SIGMAS, None, kernel="flow", noise=0.7, generator=g)
    advantages = torch.randn(GROUPS * G, T, generator=g)
    return out, advantages, torch.arange(GROUPS).repeat_interleave(G)


def run_update(overrides, seed=0, adv_scale=None, parallel=None):
    cfg = load_config(None, [*SMALL, *overrides])
    out, adv, groups = batch(seed)
    if adv_scale is not None:
        adv = adv * adv_scale
    pol = Policy()
    opt = training.make_optimizer(pol.trainable_parameters(), cfg)
    start = {n: p.detach().clone() for n, p in pol.transformer.named_parameters()}
    summary = training.update(
        pol,
        opt,
        cfg,
        training.Batch(out.states, out.log_probs, adv, groups, None, SIGMAS, "flow", 0.7),
        torch.Generator().manual_seed(1),
        initial=start,
        parallel=parallel,
    )
    return pol, opt, summary


class ThreadRanks:
    """`world` ranks of a data-parallel update as threads of this process: each rank's `sum`
    waits for every rank's tensor and adds them in rank order (what gloo's all-reduce computes)."""

    def __init__(self, world: int) -> None:
        import threading

        self.world, self.barrier, self.slots = world, threading.Barrier(world, timeout=20), [None] * world

    def rank(self, r: int) -> training.DataParallel:
        ranks = self

        class Rank(training.DataParallel):
            def _all(self, t):
                ranks.slots[self.rank] = t.detach().clone()
                ranks.barrier.wait()
                out = torch.stack(ranks.slots)
                ranks.barrier.wait()  # every rank has read the slots before any writes again
                return out

            def sum(self, t):
                return self._all(t).sum(0)

            def extreme(self, value, which):
                every = self._all(torch.tensor([value], dtype=torch.float64))
                return float(every.min() if which == "min" else every.max())

        return Rank(r, self.world)

    def update(self, overrides):
        """Every rank's (policy, summary) after one update over the ranks."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(self.world) as pool:
            futures = [pool.submit(run_update, overrides, parallel=self.rank(r)) for r in range(self.world)]
            return [(f.result()[0], f.result()[2]) for f in futures]


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_optimizer_steps_per_iteration_is_its_own_option(steps):
    _, opt, summary = run_update([f"optim.optimizer_steps={steps}", "optim.micro_batch=2"])
    assert summary["optimizer_steps"] == steps
    assert len(summary["update_norms"]) == steps
    assert all(int(s["step"]) == steps for s in opt.state.values())


def test_micro_batch_only_bounds_memory():
    a, _, sa = run_update(["optim.optimizer_steps=2", "optim.micro_batch=1", "optim.diagnostics=false"])
    b, _, sb = run_update(["optim.optimizer_steps=2", "optim.micro_batch=16", "optim.diagnostics=false"])
    for pa, pb in zip(a.trainable_parameters(), b.trainable_parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-7)
    assert sa["optimizer_steps"] == sb["optimizer_steps"] == 2


def test_the_final_step_is_trained_only_when_asked():
    _, _, default = run_update([])
    assert default["trained_step_ids"] == [0, 1, 2]
    _, _, final = run_update(["optim.train_final_step=true"])
    assert final["trained_step_ids"] == [0, 1, 2, 3]


def test_diagnostics_of_an_on_policy_first_step():
    _, _, s = run_update(["optim.optimizer_steps=2", "optim.micro_batch=3"])
    # first optimizer step: on-policy, the ratio is exactly 1 and nothing is clipped
    assert s["clip_frac_first"] == 0.0 and s["zero_grad_frac_first"] == 0.0
    assert s["clip_frac_first_by_step"] == [0.0, 0.0, 0.0]
    assert len(s["clip_frac_later_by_step"]) == 3
    shares = s["grad_energy_share"]
    assert len(shares) == 3 and sum(shares) == pytest.approx(1.0) and all(v > 0 for v in shares)
    assert -1.0 <= s["signal_cosine"] <= 1.0
    assert s["lora_distance"] == pytest.approx(s["update_norm"])  # started from `initial`
    assert s["update_norm"] > 0 and s["ratio_std"] >= 0


def test_one_optimizer_step_never_clips_and_its_bytes_ignore_the_clip():
    """One step on fresh trajectories: every ratio is 1, so the clip range changes nothing."""
    a, _, sa = run_update(["optim.optimizer_steps=1", "optim.clip_range=1e-4"])
    b, _, sb = run_update(["optim.optimizer_steps=1", "optim.clip_range=0.5"])
    for s in (sa, sb):
        assert s["clip_frac"] == 0.0 and s["clip_frac_by_part"] == [0.0] and s["zero_grad_frac_by_part"] == [0.0]
    for pa, pb in zip(a.trainable_parameters(), b.trainable_parameters()):
        assert torch.equal(pa, pb)


def test_a_tight_clip_binds_from_the_second_optimizer_step():
    _, _, s = run_update(["optim.optimizer_steps=4", "optim.clip_range=1e-4", "optim.micro_batch=4"])
    parts, zero = s["clip_frac_by_part"], s["zero_grad_frac_by_part"]
    assert len(parts) == len(zero) == 4
    assert parts[0] == 0.0 and min(parts[1:]) > 0  # on-policy first, then rows leave the range
    assert all(0.0 <= z <= c for z, c in zip(zero, parts))
    # parts of equal size: the iteration's fractions are their means
    assert s["clip_frac"] == pytest.approx(sum(parts) / 4)
    assert s["zero_grad_frac"] == pytest.approx(sum(zero) / 4)
    assert s["clip_frac_later"] == pytest.approx(sum(parts[1:]) / 3)


def _first_gradient(old_shift: torch.Tensor, adv: torch.Tensor) -> tuple[list[torch.Tensor], dict]:
    """The gradient the update's one optimizer step takes (clip 0.2), with the stored log-probs
    shifted by `old_shift [rows]` and the advantages `adv`."""
    cfg = load_config(None, [*SMALL, "optim.optimizer_steps=1", "optim.max_grad_norm=1e9"])
    out, _, groups = batch(0)
    pol = Policy()
    opt = training.make_optimizer(pol.trainable_parameters(), cfg)
    grads: list[torch.Tensor] = []
    step = opt.step
    opt.step = lambda *a, **k: (grads.extend(p.grad.clone() for p in pol.trainable_parameters()), step(*a, **k))[1]
    old = out.log_probs + old_shift[:, None]
    summary = training.update(
        pol,
        opt,
        cfg,
        training.Batch(out.states, old, adv, groups, None, SIGMAS, "flow", 0.7),
        torch.Generator().manual_seed(1),
    )
    return grads, summary


def test_rows_the_clip_holds_contribute_no_gradient():
    """Hand-checked: rows whose stored log-prob makes the ratio e^1 (past 1 + 0.2) with a positive
    advantage are held by the clip; the step's gradient is the one in which those rows carry a
    negligible advantage (same rows, same mean), and the update reports them as its no-gradient share."""
    _, adv, _ = batch(0)
    adv = adv.abs()  # every row pushes its ratio up
    held = torch.zeros(GROUPS * G, dtype=torch.bool)
    held[::3] = True  # 6 of 16 rows
    clipped, s = _first_gradient(held.float() * -1.0, adv)
    free, s_free = _first_gradient(torch.zeros(GROUPS * G), torch.where(held[:, None], adv * 1e-30, adv))
    for a, b in zip(clipped, free):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-12)
    assert s["zero_grad_frac"] == pytest.approx(6 / 16) and s["clip_frac"] == pytest.approx(6 / 16)
    assert s_free["zero_grad_frac"] == 0.0 and s["zero_grad_frac_by_part"] == [pytest.approx(6 / 16)]


def test_signal_cosine_is_the_cosine_of_the_two_halves_gradients():
    # One optimizer step, diagnostics on: recompute the two halves' gradients by hand.
    cfg_over = ["optim.optimizer_steps=1", "optim.micro_batch=16"]
    _, _, s = run_update(cfg_over)
    cfg = load_config(None, [*SMALL, *cfg_over])
    out, adv, groups = batch(0)
    order = torch.arange(GROUPS * G)[torch.randperm(GROUPS * G, generator=torch.Generator().manual_seed(1))]
    seen = list(dict.fromkeys(groups[order].tolist()))
    halves = [
        order[torch.isin(groups[order], torch.tensor(seen[:2]))],
        order[torch.isin(groups[order], torch.tensor(seen[2:]))],
    ]
    grads = []
    from stepgrpo_core.loss import grpo_loss
    from stepgrpo_core.rollout import step_log_prob

    for half in halves:
        pol = Policy()
        loss = sum(
            grpo_loss(
                step_log_prob(pol.velocity, out.states[half], SIGMAS, None, k, "flow", 0.7).log_prob,
                out.log_probs[half, k],
                adv[half, k],
                clip_range=0.2,
            ).loss
            for k in cfg.trained_steps()
        )
        loss.backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in pol.trainable_parameters()]))
    expected = float(torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0))
    assert s["signal_cosine"] == pytest.approx(expected, abs=1e-5)


def test_whole_micro_batches_go_to_ranks_only_where_they_share_out_evenly():
    from stepgrpo.loops.batching import _balanced_owners as owners

    assert owners([4, 2, 4, 2], 2) == [0, 0, 1, 1]  # the 4s first, then each 2 to the lighter rank
    assert owners([4, 4, 4], 2) is None  # 8 rows against 4: every other row of each instead
    assert owners([8], 2) is None  # fewer micro-batches than ranks
    # largest first finds no even share-out here (3+3 against 2+2+2 exists): every other row instead;
    # the micro-batches of a step are all full but each half's last, where largest first suffices
    assert owners([3, 3, 2, 2, 2], 2) is None
    halves = [torch.arange(0, 6), torch.arange(6, 12)]
    for world in (1, 2, 3, 4, 5):
        shares = [training.DataParallel(r, world).micro_batches(halves, 4) for r in range(world)]
        for h, half in enumerate(halves):  # every row of every half once, over the ranks
            rows = torch.cat([idx for share in shares for idx in share[h]])
            assert sorted(rows.tolist()) == half.tolist()
        loads = [sum(len(idx) for share_h in share for idx in share_h) for share in shares]
        assert max(loads) - min(loads) <= len(halves)  # no rank has more than a row a half over another


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("micro_batch", [1, 3, 16])
def test_a_data_parallel_update_is_the_one_process_update(world, micro_batch):
    """The ranks (threads here, processes in tests/test_scale.py) compute the one-process update's
    weights and diagnostics, whichever way the micro-batches share out."""
    over = ["optim.optimizer_steps=2", f"optim.micro_batch={micro_batch}"]
    one, _, expected = run_update(over)
    for pol, summary in ThreadRanks(world).update(over):
        for a, b in zip(one.trainable_parameters(), pol.trainable_parameters()):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-8)
        for name in ("signal_cosine", "grad_norm", "loss", "clip_frac_later", "trained_trajectories"):
            assert summary[name] == pytest.approx(expected[name], rel=1e-5, abs=1e-7), name
        assert summary["grad_energy_share"] == pytest.approx(expected["grad_energy_share"], rel=1e-5)


def test_checkpoint_state_keeps_lists_and_drops_nan():
    state = training.checkpoint_state(3, {"a": 1.0, "b": float("nan"), "c": [0.5, float("nan")], "d": "x"})
    assert state == {"iteration": 3, "update": {"a": 1.0, "c": [0.5, None]}}


def test_the_signal_watch_speaks_once_when_the_summed_cosine_reads_noise():
    from stepgrpo.reporting.report import NOISE_COSINE, NOISE_WINDOW, SignalWatch
    from stepgrpo.results import UpdateStats

    watch = SignalWatch()
    assert watch.see(3, UpdateStats(signal_cosine_window=0.0, signal_iterations=3)) is None  # too few iterations yet
    assert watch.see(30, UpdateStats(signal_cosine_window=NOISE_COSINE + 0.1, signal_iterations=30)) is None
    line = watch.see(31, UpdateStats(signal_cosine_window=NOISE_COSINE / 2, signal_iterations=NOISE_WINDOW))
    assert line is not None and "reads noise" in line and line.count("\n") == 0
    assert watch.see(32, UpdateStats(signal_cosine_window=0.0, signal_iterations=32)) is None  # said once


def test_summed_halves_show_a_weak_shared_direction_that_one_iteration_hides():
    g = torch.Generator().manual_seed(0)
    shared = torch.randn(5000, generator=g)
    signal: dict = {}
    first = None
    for _ in range(60):  # per half: a shared direction 10x weaker than its noise (|s|^2 / |noise|^2 = 0.01)
        a, b = (0.1 * shared + torch.randn(5000, generator=g) for _ in range(2))
        out = training.accumulate_signal(signal, a, b)
        first = first if first is not None else float(torch.nn.functional.cosine_similarity(a, b, dim=0))
    assert abs(first) < 0.05 and out["signal_cosine_window"] > 0.15 and out["signal_iterations"] == 60
    noise: dict = {}
    for _ in range(60):
        out = training.accumulate_signal(noise, torch.randn(5000, generator=g), torch.randn(5000, generator=g))
    assert abs(out["signal_cosine_window"]) < 0.05


def test_flow_grpo_kl_form_is_the_exact_kl_over_dt():
    # Two optimizer steps: the first is at the reference (KL 0 either way, same step), the second
    # sees KL > 0. Flow-GRPO's form divides by eps_t^2, the exact KL by the step's variance
    # eps_t^2 |dt|; on this uniform grid |dt| = 1/4 at every step, so it reads a quarter of the exact.
    over = ["optim.optimizer_steps=2", "optim.kl_beta=0.04", "optim.diagnostics=false"]
    _, _, fg = run_update([*over, "optim.kl_form=flow_grpo"])
    _, _, exact = run_update([*over, "optim.kl_form=exact"])
    assert exact["kl"] > 0
    assert fg["kl"] == pytest.approx(exact["kl"] / 4, rel=1e-4)


def test_noise_step_weighting_weighs_each_steps_loss_by_its_std():
    # On-policy (ratio 1) the weighted loss's gradient is the gradient with the advantages of step
    # k scaled by w_k: the summed gradient's norm says so. w = std_k / mean over trained steps.
    from stepgrpo_core.loss import step_weights

    w = step_weights("noise", "flow", SIGMAS, 0.7, [0, 1, 2])
    assert w.mean().item() == pytest.approx(1.0) and not torch.allclose(w, torch.ones(3))
    scale = torch.cat([w, torch.ones(1)])  # step 3 is not trained
    common = ["optim.optimizer_steps=1", "optim.diagnostics=false", "optim.max_grad_norm=1e6"]
    _, _, weighted = run_update([*common, "optim.step_weighting=noise"])
    _, _, scaled = run_update(common, adv_scale=scale)
    _, _, uniform = run_update(common)
    assert weighted["grad_norm"] == pytest.approx(scaled["grad_norm"], rel=1e-5)
    assert abs(weighted["grad_norm"] - uniform["grad_norm"]) > 1e-3 * uniform["grad_norm"]
