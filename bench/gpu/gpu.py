"""GPU checks of the policy: CUDA correctness on the shipped model, and throughput at SD3-medium scale.

One self-contained script for a machine with one CUDA GPU. It needs torch, diffusers, transformers,
peft and the repository (run from its root as a module; no `pip install -e .`, no Prefect / MLflow / Zarr / pydantic):
it imports only `stepgrpo_core`, `stepgrpo.policy` and diffusers.

Section 1, correctness (the shipped `models/shapes`, in float32 and in bfloat16, LoRA r8 attached,
CFG 2.5, `flow` SDE kernel with a = 0.7, T = 10), the GPU counterparts of tests/test_rollout.py,
tests/test_completions.py and tests/test_policy.py:

- the rollout: NFE count, finite states and log-probs, a repeat with the same seed is identical;
- on-policy log-probs: `step_log_prob` on the stored transitions under the same policy gives the
  stored log-probs, (a) in the rollout's batch without gradient, (b) in the rollout's batch with
  gradient, (c) in shuffled micro-batches with gradient, as `training.update` calls it. It passes
  when max |ratio - 1| stays under `RATIO_TOL` (Flow-GRPO's clip range: a larger on-policy
  deviation would already be clipped);
- completions `remaining`, `substeps:2`, `tweedie`: NFE = B T (T+1) / 2, 2 B T, B T, by the
  returned count and by the policy's counter; `remaining` of x_0 is the ODE sample; chunking with
  another `max_batch` does not change the latents;
- one GRPO update: `grpo_loss` (PPO clip + KL to the adapter-free reference), backward, AdamW
  step: finite loss and gradients, the LoRA weights move, the base weights do not;
- CPU versus the device in float32 from the same initial noise: the ODE rollout's final latents,
  and the device's SDE transitions scored on the CPU (log-prob difference).

Section 2, throughput at real scale: a random-weight `SD3Transformer2DModel` of SD3-medium's shape
(diffusers' published config: 24 blocks, 24 heads x 64, patch 2, 16 latent channels), bf16,
latents 16 x 64 x 64 (512 px), 333 context tokens x 4096 (SD3: 77 CLIP + 256 T5), random inputs:

- raw transformer rows per second (NFE/s without CFG) at batch 8, 16, 32, 64;
- a `flow` rollout of B = 16 trajectories x T = 10 through the policy adapter;
- the completions of its states at `max_batch` 32 and 64, as NFE/s and as a ratio to raw;
- one update micro-step of the GPU recipe (LoRA r32, CFG 4.5, micro-batch 8, KL to the reference):
  forward + backward, measured against a LoRA forward of the same rows;
- derived (not measured) seconds per GRPO iteration of B = 64 trajectories x T = 10 with CFG, per
  completion method; peak GPU memory.

Results go to `--out` as they come: `results.json` (rewritten after every record) and
`report.txt` (appended line by line), so a run cut short keeps what it measured. A failing check
is recorded with its error and the script goes on. `--small --device cpu` runs every code path at
toy sizes on a CPU (T = 5, section 2 on a small transformer) to prove the script before it travels.

    python -m bench.gpu.gpu [--out bench/out/gpu] [--device cuda] [--small] [--skip-scale]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

# No network on the target machine, and no progress bars or library chatter in the report.
for _name, _value in {
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "DIFFUSERS_VERBOSITY": "error",
    "TRANSFORMERS_VERBOSITY": "error",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402

from bench._lib.gpu import SD3_MEDIUM  # noqa: E402
from stepgrpo.policy.base import DEFAULT_MODEL  # noqa: E402
from stepgrpo.policy.lora import LoraSpec  # noqa: E402
from stepgrpo.policy.sd3 import SD3Policy  # noqa: E402
from stepgrpo_core.completions import complete  # noqa: E402
from stepgrpo_core.conditioning import take  # noqa: E402
from stepgrpo_core.loss import grpo_loss  # noqa: E402
from stepgrpo_core.rollout import Rollout, rollout, step_log_prob  # noqa: E402

# ----------------------------------------------------------------------------- constants

PROMPTS = ("a red circle", "two blue squares", "a green triangle left of a yellow square", "three purple circles")
KERNEL, NOISE = "flow", 0.7  # Flow-GRPO's SDE and its a
STEPS = 10  # T, Flow-GRPO's training grid
# `--small`: T = 5 (no check depends on T; the completions' NFEs grow as T^2, the CPU's bf16 is slow)
SMALL_STEPS = 5
COMPLETIONS = ("remaining", "substeps:2", "tweedie")
RATIO_TOL = 1e-4  # on-policy |ratio - 1| bound: Flow-GRPO's clip range (configs/flow_grpo_pickscore.yaml)
# On a CPU, bf16 matmuls of another batch size round differently (oneDNN picks its blocking by
# shape): micro-batches of 2 against the rollout's batch gave |ratio - 1| = 1.7e-4 there, while the
# H200 stayed under 1e-4. The CPU run (`--device cpu`, the test suite's) checks bf16 against this.
RATIO_TOL_CPU_BF16 = 1e-3
# Bounds on max|a - b| / max(1, max|b|) between computations of the same latents: fp32 differs only
# by summation order; bf16 keeps 8 mantissa bits, rounded again at every one of the T stored states.
# Relative to the latents' scale, since an early state's tweedie x_0 reaches |x| ~ 10, where one bf16
# ulp is 0.0625 and another max_batch's blocking on some CPUs gives a one-ulp difference.
LATENT_TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
CROSS_DEVICE_TOL = 1e-3  # CPU vs device fp32 (TF32 off): kernels differ, so does summation order
CHUNK_MAX_BATCH = 7  # an odd max_batch for the chunking check: partial chunks everywhere
# Section 1: the shipped model with the shapes recipes' adapter (LoRA r8) and CFG on, so that the
# guided path is checked (the shapes recipes themselves run at CFG 1); section 2's update: the GPU
# recipe's (configs/flow_grpo_pickscore.yaml).
DEMO_LORA, DEMO_GUIDANCE = LoraSpec(rank=8, alpha=16.0), 2.5
RECIPE_LORA, RECIPE_GUIDANCE, RECIPE_KL, RECIPE_MICRO = LoraSpec(rank=32, alpha=64.0), 4.5, 0.01, 8

# The same architecture at toy size, for `--small`.
SMALL_TRANSFORMER = dict(
    sample_size=8,
    patch_size=2,
    in_channels=16,
    out_channels=16,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=64,
    caption_projection_dim=32,
    pooled_projection_dim=32,
    pos_embed_max_size=8,
)


@dataclass(frozen=True)
class ScaleSpec:
    """Sizes of section 2."""

    transformer: dict[str, Any]  # SD3Transformer2DModel kwargs
    label: str  # what the report calls the model
    latent_side: int  # H = W of the latents (64: 512 px through SD3's 8x VAE)
    context_tokens: int  # text tokens per row (333 = 77 CLIP + 256 T5)
    batch_sizes: tuple[int, ...]  # raw transformer batches timed
    trajectories: int  # B of the rollout whose states are completed
    max_batches: tuple[int, ...]  # completion max_batch values
    update_micro: int  # trajectories per update micro-step (2 transformer rows each with CFG)
    min_seconds: float  # keep repeating a timed call until this much time has passed ...
    max_calls: int  # ... or this many calls ran


REAL = ScaleSpec(
    SD3_MEDIUM, "SD3-medium shape (2B, random weights)", 64, 333, (8, 16, 32, 64), 16, (32, 64), RECIPE_MICRO, 2.0, 30
)
SMALL = ScaleSpec(SMALL_TRANSFORMER, "small SD3 transformer (random weights)", 8, 24, (2, 4, 8), 4, (4, 8), 2, 0.2, 10)

# The iteration the derived estimates describe: Flow-GRPO's B = 64 trajectories x T = 10, CFG.
EST_TRAJECTORIES, EST_STEPS, CFG_ROWS, UPDATE_FORWARDS = 64, 10, 2, 3.0  # forward + backward ~ 3 forwards


def completion_nfe(method: str, trajectories: int, steps: int) -> int:
    """NFEs of `complete(method)` on `trajectories` x (T + 1) states (stepgrpo_core.completions doc)."""
    per = {"remaining": steps * (steps + 1) // 2, "substeps:2": 2 * steps, "tweedie": steps}
    return trajectories * per[method]


# ----------------------------------------------------------------------------- the report


class Report:
    """Results as they come: `results.json` (rewritten whole after every record) and `report.txt`
    (appended line by line), both flushed, so a run cut short keeps what it measured."""

    def __init__(self, out: Path, meta: dict[str, Any]) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.json_path = out / "results.json"
        self.text = (out / "report.txt").open("w")
        self.data: dict[str, Any] = {"meta": meta, "checks": [], "scale": {}, "estimates": {}, "status": "running"}
        self.save()

    def line(self, text: str = "") -> None:
        print(text, flush=True)
        self.text.write(text + "\n")
        self.text.flush()

    def save(self) -> None:
        tmp = self.json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=_jsonable) + "\n")
        tmp.replace(self.json_path)

    def check(self, record: dict[str, Any]) -> None:
        self.data["checks"].append(record)
        verdict = {True: "PASS", False: "FAIL", None: "info"}[record["passed"]]
        self.line(f"  {record['name']:<44} {record['dtype']:<8} {verdict:<4}  {record['summary']}")
        self.save()

    def scale(self, key: str, value: Any, text: str | None = None) -> None:
        self.data["scale"][key] = value
        if text:
            self.line(text)
        self.save()


def _jsonable(value: Any) -> Any:
    """JSON for what `json` cannot write itself (tensors, dtypes, numpy scalars); never raises."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def error_summary(err: BaseException) -> dict[str, str]:
    """The error and the last frames of its traceback (enough to locate it, short enough to read)."""
    return {
        "error": f"{type(err).__name__}: {err}"[:2000],
        "traceback": "".join(traceback.format_exception(err, limit=-6))[-4000:],
    }


class Deadline:
    """The script's time budget: sections stop starting new measurements once it is spent."""

    def __init__(self, seconds: float) -> None:
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()


# ----------------------------------------------------------------------------- helpers


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float().cpu() - b.float().cpu()).abs().max())


def max_scaled(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| in units of b's scale, max(1, max|b|) (`LATENT_TOL`)."""
    return max_abs(a, b) / max(1.0, float(b.float().abs().max()))


def ratio_deviation(new: torch.Tensor, old: torch.Tensor) -> float:
    """max |exp(new - old) - 1|: the PPO ratio's distance from 1 (fp32, as grpo_loss takes it)."""
    return float((torch.exp(new.float() - old.float()) - 1.0).abs().max())


@contextlib.contextmanager
def strict_fp32() -> Iterator[None]:
    """TF32 off for matmuls and cuDNN convolutions (PyTorch lets cuDNN convolutions, e.g. the
    transformer's patch embedding, use TF32 by default); restored on exit."""
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def time_calls(
    fn: Callable[[], Any], device: torch.device, min_seconds: float, max_calls: int, deadline: Deadline, warmup: int = 1
) -> list[float]:
    """Seconds of each call of `fn` (synchronised), after `warmup` untimed calls; at least one
    timed call, then more until `min_seconds` of calls or `max_calls` (or the deadline)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times: list[float] = []
    start = time.perf_counter()
    while not times or (len(times) < max_calls and time.perf_counter() - start < min_seconds and deadline.left() > 0):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def peak_memory(device: torch.device) -> dict[str, float]:
    """Peak GPU memory since the last `torch.cuda.reset_peak_memory_stats` (empty on a CPU)."""
    if device.type != "cuda":
        return {}
    return {
        "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
    }


def memory_text(device: torch.device) -> str:
    peak = peak_memory(device)
    if not peak:
        return "peak GPU memory n/a on the CPU"
    return (
        f"peak GPU memory {peak['peak_allocated_gib']:.1f} GiB allocated, {peak['peak_reserved_gib']:.1f} GiB reserved"
    )


def tf32_flags() -> dict[str, Any]:
    """Whether fp32 matmuls / cuDNN convolutions may use TF32 (read defensively: torch has a newer API)."""
    try:
        return {"tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "tf32_cudnn": torch.backends.cudnn.allow_tf32}
    except Exception as err:
        return {"tf32_flags": f"unreadable ({type(err).__name__}: {err})"}


def quiet_libraries() -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    for name in ("diffusers", "transformers", "peft"):
        logging.getLogger(name).setLevel(logging.ERROR)
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()


def import_error() -> str | None:
    """Why the diffusers classes this script uses cannot be imported, or None.

    diffusers imports recent huggingface_hub names at module load (0.42 needs huggingface_hub >=
    1.32), so an older hub fails here, before any model is touched: say so with the versions.
    """
    try:
        from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline  # noqa: F401
    except Exception as err:
        try:
            import huggingface_hub

            hub = huggingface_hub.__version__
        except Exception as hub_err:
            hub = f"unavailable ({type(hub_err).__name__})"
        return f"cannot import diffusers: {type(err).__name__}: {err} (huggingface_hub {hub})"
    return None


def machine(device: torch.device) -> dict[str, Any]:
    """What the numbers were measured on."""
    import diffusers
    import huggingface_hub
    import transformers

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "huggingface_hub": huggingface_hub.__version__,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    try:
        import peft

        info["peft"] = peft.__version__
    except Exception as err:  # the LoRA checks will fail and say why; the rest still runs
        info["peft"] = f"unavailable ({type(err).__name__}: {err})"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {
            "gpu": props.name,
            "gpu_memory_gib": props.total_memory / 2**30,
            "capability": f"{props.major}.{props.minor}",
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
            **tf32_flags(),
            "sdp_flash": torch.backends.cuda.flash_sdp_enabled(),
            "sdp_mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
        }
    return info


# ----------------------------------------------------------------------------- section 1: correctness


@dataclass
class Case:
    """What one dtype's checks share: a policy with a LoRA adapter and one stored SDE rollout."""

    policy: SD3Policy
    cond: dict[str, torch.Tensor]  # [B, ...] conditioning of the rollout's rows
    sigmas: torch.Tensor  # [T+1]
    out: Rollout  # states [B, T+1, C, H, W], log_probs [B, T]


@dataclass
class Outcome:
    """A check's verdict (None: information only), its numbers and a one-line summary."""

    passed: bool | None
    numbers: dict[str, Any]
    summary: str


def run_check(report: Report, name: str, dtype: str, fn: Callable[[], Outcome]) -> Outcome | None:
    """Run one check; an exception is recorded as a failure with its traceback, never raised."""
    t0 = time.perf_counter()
    try:
        outcome = fn()
        record = {"passed": outcome.passed, "numbers": outcome.numbers, "summary": outcome.summary}
    except Exception as err:
        outcome = None
        record = {
            "passed": False,
            "numbers": {},
            "summary": f"ERROR {type(err).__name__}: {str(err)[:200]}",
            **error_summary(err),
        }
    report.check({"name": name, "dtype": dtype, **record, "seconds": time.perf_counter() - t0})
    return outcome


def make_case(device: torch.device, dtype: str, trajectories: int) -> tuple[Case, Outcome]:
    """The shipped model with the demo's adapter and CFG, and a `flow` rollout of `trajectories`."""
    policy = SD3Policy.from_pretrained(
        DEFAULT_MODEL, dtype=dtype, device=device, guidance_scale=DEMO_GUIDANCE, lora=DEMO_LORA
    )
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(trajectories)]
    cond = policy.encode(prompts)
    sigmas = policy.sigmas(STEPS)
    x0 = policy.initial_noise(trajectories, torch.Generator().manual_seed(0))
    nfe0 = policy.nfe
    out = rollout(policy.velocity, x0, sigmas, cond, kernel=KERNEL, noise=NOISE, generator=generator(device, 1))
    counted = policy.nfe - nfe0
    again = rollout(policy.velocity, x0, sigmas, cond, kernel=KERNEL, noise=NOISE, generator=generator(device, 1))
    expected = trajectories * STEPS
    finite_states = bool(torch.isfinite(out.states.float()).all())
    finite_lp = int(torch.isfinite(out.log_probs).sum())
    same_lp = torch.isclose(out.log_probs, again.log_probs, rtol=0, atol=0, equal_nan=True)  # NaN: deterministic steps
    repeat = torch.equal(out.states, again.states) and bool(same_lp.all())
    numbers = {
        "nfe": out.nfe,
        "policy_nfe": counted,
        "expected_nfe": expected,
        "finite_states": finite_states,
        "finite_log_probs": finite_lp,
        "expected_log_probs": expected,
        "repeat_identical": repeat,
        "repeat_max_abs": max_abs(out.states, again.states),
        "log_prob_range": [float(out.log_probs.nan_to_num(0).min()), float(out.log_probs.nan_to_num(0).max())],
    }
    passed = out.nfe == counted == expected and finite_states and finite_lp == expected and repeat
    summary = (
        f"B={trajectories} T={STEPS}: nfe {out.nfe} / policy {counted} (expect {expected}); states finite "
        f"{finite_states}; "
        f"finite log-probs {finite_lp}/{expected}; seeded repeat identical {repeat}"
    )
    return Case(policy, cond, sigmas, out), Outcome(passed, numbers, summary)


def recompute(case: Case, micro: int | None, grad: bool) -> torch.Tensor:
    """`[B, T]` log-probs of the stored transitions under the same policy, by `step_log_prob`.

    micro None: every row in one call per step (the rollout's batch). Else shuffled micro-batches
    of `micro` rows, each step in turn, as `training.update` calls it. `grad`: build the graph, as
    the update does (the LoRA weights require grad), else under `no_grad`.
    """
    batch = case.out.states.shape[0]
    device = case.out.states.device
    order = torch.randperm(batch, generator=torch.Generator().manual_seed(0)) if micro else torch.arange(batch)
    new = torch.full_like(case.out.log_probs, float("nan"))
    with torch.enable_grad() if grad else torch.no_grad():
        for idx in order.split(micro or batch):
            idx = idx.to(device)
            sub = take(case.cond, idx)
            for k in range(STEPS):
                lp = step_log_prob(
                    case.policy.velocity, case.out.states[idx], case.sigmas, sub, k, KERNEL, NOISE
                ).log_prob
                new[idx, k] = lp.detach()
    return new


def check_recompute(case: Case, micro: int | None, grad: bool) -> Outcome:
    new = recompute(case, micro, grad)
    old = case.out.log_probs
    diff, dev = max_abs(new, old), ratio_deviation(new, old)
    exact = torch.equal(new, old)
    cpu_bf16 = case.policy.device.type == "cpu" and case.policy.dtype == torch.bfloat16
    tol = RATIO_TOL_CPU_BF16 if cpu_bf16 else RATIO_TOL
    numbers = {"max_abs_log_prob_diff": diff, "max_abs_ratio_minus_1": dev, "bitwise_equal": exact, "tolerance": tol}
    return Outcome(
        dev <= tol, numbers, f"max|dlogp| {diff:.3g}, max|ratio-1| {dev:.3g} (tol {tol:g}); bitwise equal {exact}"
    )


def check_completion_counts(case: Case) -> Outcome:
    batch = case.out.states.shape[0]
    numbers, parts, passed = {}, [], True
    for method in COMPLETIONS:
        nfe0 = case.policy.nfe
        done = complete(
            method, case.policy.velocity, case.out.states, case.sigmas, case.cond, max_batch=case.policy.max_batch
        )
        counted = case.policy.nfe - nfe0
        expected = completion_nfe(method, batch, STEPS)
        finite = bool(torch.isfinite(done.latents.float()).all())
        final_kept = torch.equal(done.latents[:, -1], case.out.states[:, -1])
        numbers[method] = {
            "nfe": done.nfe,
            "policy_nfe": counted,
            "expected": expected,
            "finite": finite,
            "x_T_kept": final_kept,
        }
        passed &= done.nfe == counted == expected and finite and final_kept
        parts.append(f"{method} {done.nfe}/{counted} (expect {expected})")
    return Outcome(passed, numbers, "; ".join(parts) + f"; T={STEPS}, B={batch}")


def check_completion_values(case: Case) -> Outcome:
    """`remaining` of x_0 is the ODE sample from x_0; another max_batch gives the same latents."""
    tol = LATENT_TOL[case.policy.dtype]
    states = case.out.states
    with torch.no_grad():
        ode = rollout(case.policy.velocity, states[:, 0], case.sigmas, case.cond, kernel="ode").states[:, -1]
    numbers: dict[str, Any] = {"tolerance": tol}
    base = {
        m: complete(m, case.policy.velocity, states, case.sigmas, case.cond, max_batch=case.policy.max_batch)
        for m in COMPLETIONS
    }
    pairs = {"remaining_x0_vs_ode": (base["remaining"].latents[:, 0], ode)}
    for m in COMPLETIONS:
        chunked = complete(m, case.policy.velocity, states, case.sigmas, case.cond, max_batch=CHUNK_MAX_BATCH)
        pairs[f"{m}_max_batch_{CHUNK_MAX_BATCH}_vs_{case.policy.max_batch}"] = (chunked.latents, base[m].latents)
    for name, (a, b) in pairs.items():
        numbers[f"{name}_max_abs"] = max_abs(a, b)
        numbers[f"{name}_max_scaled"] = max_scaled(a, b)
    worst = max(v for k, v in numbers.items() if k.endswith("max_scaled"))
    chunk = ", ".join(
        f"{m} {numbers[f'{m}_max_batch_{CHUNK_MAX_BATCH}_vs_{case.policy.max_batch}_max_scaled']:.3g}"
        for m in COMPLETIONS
    )
    return Outcome(
        worst <= tol,
        numbers,
        f"max|diff|/max(1,|x|): remaining(x_0) vs ODE sample {numbers['remaining_x0_vs_ode_max_scaled']:.3g}; "
        f"max_batch {CHUNK_MAX_BATCH} vs {case.policy.max_batch}: {chunk} (tol {tol:g})",
    )


def check_update(case: Case, micro: int) -> Outcome:
    """One GRPO micro-step as `training.update` takes it, then one AdamW step (the recipe's settings)."""
    policy, states, old = case.policy, case.out.states, case.out.log_probs
    device = states.device
    params = policy.trainable_parameters()
    before = [p.detach().clone() for p in params]
    base_name, base_weight = next((n, p) for n, p in policy.transformer.named_parameters() if "base_layer.weight" in n)
    base_before = base_weight.detach().clone()
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.999), weight_decay=1e-4, foreach=False)
    idx = torch.arange(micro, device=device)
    sub = take(case.cond, idx)
    advantages = torch.randn(micro, generator=torch.Generator().manual_seed(2)).to(device)
    losses, clip_fracs = [], []
    opt.zero_grad(set_to_none=True)
    for k in range(STEPS):
        out = step_log_prob(policy.velocity, states[idx], case.sigmas, sub, k, KERNEL, NOISE)
        with torch.no_grad(), policy.reference():
            ref_mean = step_log_prob(policy.velocity, states[idx], case.sigmas, sub, k, KERNEL, NOISE).mean
        loss = grpo_loss(
            out.log_prob,
            old[idx, k],
            advantages,
            clip_range=RATIO_TOL,
            kl_beta=RECIPE_KL,
            mean=out.mean,
            ref_mean=ref_mean,
            kl_std=out.std,
        )
        (loss.loss / STEPS).backward()
        losses.append(float(loss.loss.detach()))
        clip_fracs.append(loss.clip_frac)
    grads = [p.grad for p in params if p.grad is not None]
    grads_finite = all(bool(torch.isfinite(g).all()) for g in grads)
    nonzero = sum(int(bool((g != 0).any())) for g in grads)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
    opt.step()
    moved = max(float((p.detach() - b).abs().max()) for p, b in zip(params, before))
    base_same = torch.equal(base_weight.detach(), base_before) and not base_weight.requires_grad
    with torch.no_grad():
        after = step_log_prob(policy.velocity, states[idx], case.sigmas, sub, 0, KERNEL, NOISE).log_prob
    moved_ratio = ratio_deviation(after, old[idx, 0])
    loss_finite = all(math.isfinite(x) for x in losses)
    numbers = {
        "losses": losses,
        "clip_frac_mean": sum(clip_fracs) / len(clip_fracs),
        "grads": len(grads),
        "grads_nonzero": nonzero,
        "trainable": len(params),
        "grads_finite": grads_finite,
        "grad_norm": grad_norm,
        "lora_max_change": moved,
        "base_weight": base_name,
        "base_unchanged": base_same,
        "ratio_dev_after_step": moved_ratio,
    }
    passed = loss_finite and grads_finite and nonzero > 0 and grad_norm > 0 and moved > 0 and base_same
    summary = (
        f"loss finite {loss_finite}; grads finite {grads_finite}, nonzero {nonzero}/{len(params)}, norm "
        f"{grad_norm:.3g}; "
        f"LoRA max change {moved:.3g}; base unchanged {base_same}; step-0 |ratio-1| after step {moved_ratio:.3g}"
    )
    return Outcome(passed, numbers, summary)


def check_cross_device(device: torch.device, trajectories: int) -> Outcome:
    """CPU and `device` in fp32 from the same x_0: ODE final latents; device SDE steps scored on the CPU.

    The SDE's noise comes from each device's own generator (different streams), so an SDE rollout
    cannot be repeated across devices: the deterministic ODE rollout is compared instead, and the
    device's SDE transitions are re-scored by the CPU policy.
    """
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(trajectories)]
    cpu = SD3Policy.from_pretrained(DEFAULT_MODEL, dtype="float32", device="cpu", guidance_scale=DEMO_GUIDANCE)
    dev = SD3Policy.from_pretrained(DEFAULT_MODEL, dtype="float32", device=device, guidance_scale=DEMO_GUIDANCE)
    x0 = cpu.initial_noise(trajectories, torch.Generator().manual_seed(0))
    cond_cpu, cond_dev = cpu.encode(prompts), dev.encode(prompts)
    sigmas = cpu.sigmas(STEPS)
    ref = rollout(cpu.velocity, x0, sigmas, cond_cpu, kernel="ode").states
    with strict_fp32():
        strict = rollout(dev.velocity, x0.to(device), sigmas.to(device), cond_dev, kernel="ode").states
        sde = rollout(
            dev.velocity,
            x0.to(device),
            sigmas.to(device),
            cond_dev,
            kernel=KERNEL,
            noise=NOISE,
            generator=generator(device, 1),
        )
    default = rollout(dev.velocity, x0.to(device), sigmas.to(device), cond_dev, kernel="ode").states
    with torch.no_grad():
        states = sde.states.cpu()
        scored = torch.stack(
            [step_log_prob(cpu.velocity, states, sigmas, cond_cpu, k, KERNEL, NOISE).log_prob for k in range(STEPS)], 1
        )
    numbers = {
        "encode_max_abs": max(max_abs(cond_cpu[k], cond_dev[k]) for k in cond_cpu),
        "ode_final_max_abs_tf32_off": max_abs(ref[:, -1], strict[:, -1]),
        "ode_final_max_abs_default_flags": max_abs(ref[:, -1], default[:, -1]),
        "ode_final_abs_max": float(ref[:, -1].abs().max()),
        "sde_log_prob_cpu_vs_device_max_abs": max_abs(scored, sde.log_probs),
        "sde_ratio_cpu_vs_device_max_dev": ratio_deviation(scored, sde.log_probs.cpu()),
        "tolerance": CROSS_DEVICE_TOL,
    }
    passed = numbers["ode_final_max_abs_tf32_off"] <= CROSS_DEVICE_TOL
    summary = (
        f"ODE final latents max|diff| {numbers['ode_final_max_abs_tf32_off']:.3g} (TF32 off; tol "
        f"{CROSS_DEVICE_TOL:g}), "
        f"{numbers['ode_final_max_abs_default_flags']:.3g} (default flags); encode {numbers['encode_max_abs']:.3g}; "
        f"device SDE steps scored on CPU: max|ratio-1| {numbers['sde_ratio_cpu_vs_device_max_dev']:.3g}"
    )
    return Outcome(passed, numbers, summary)


def section_correctness(report: Report, device: torch.device, trajectories: int, micro: int) -> None:
    report.line(
        f"== 1. correctness: {DEFAULT_MODEL.parent.name}/{DEFAULT_MODEL.name} on {device}, LoRA r{DEMO_LORA.rank}, "
        f"CFG {DEMO_GUIDANCE}, {KERNEL} a={NOISE}, T={STEPS}, B={trajectories} =="
    )
    report.line(f"  {'check':<44} {'dtype':<8} {'':<4}  numbers")
    for dtype in ("float32", "bfloat16"):
        holder: dict[str, Case] = {}

        def build() -> Outcome:
            case, outcome = make_case(device, dtype, trajectories)
            holder["case"] = case
            return outcome

        run_check(report, "rollout (flow SDE)", dtype, build)
        if "case" not in holder:
            report.line(f"  (the {dtype} checks below need the rollout: skipped)")
            continue
        case = holder["case"]
        run_check(report, "on-policy log-prob: same batch, no grad", dtype, lambda: check_recompute(case, None, False))
        run_check(report, "on-policy log-prob: same batch, grad", dtype, lambda: check_recompute(case, None, True))
        run_check(
            report,
            f"on-policy log-prob: micro-batches of {micro}, grad",
            dtype,
            lambda: check_recompute(case, micro, True),
        )
        run_check(report, "completion NFE counts", dtype, lambda: check_completion_counts(case))
        run_check(report, "completion values", dtype, lambda: check_completion_values(case))
        run_check(
            report, f"GRPO update (loss, backward, AdamW) micro {micro}", dtype, lambda: check_update(case, micro)
        )
        del case, holder
        if device.type == "cuda":
            torch.cuda.empty_cache()
    run_check(report, f"cpu vs {device.type}: same x_0", "float32", lambda: check_cross_device(device, trajectories))


# ----------------------------------------------------------------------------- section 2: throughput


def build_scale_policy(spec: ScaleSpec, device: torch.device, dtype: torch.dtype) -> SD3Policy:
    """A random-weight SD3 transformer of `spec`'s shape behind the policy adapter (no text
    encoders, no VAE: the conditioning is random tensors, the latents are never decoded)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    torch.manual_seed(0)
    with torch.device(device):  # initialise on the device: 2B parameters take minutes on a CPU
        transformer = SD3Transformer2DModel(**spec.transformer)
    transformer.to(dtype)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),  # SD3's scheduler
        vae=None,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        text_encoder_3=None,
        tokenizer_3=None,
    )
    # Without a VAE the adapter's "pixels" are the latents: resolution = latent side.
    return SD3Policy.from_pipeline(
        pipe,
        dtype=dtype,
        device=device,
        guidance_scale=1.0,
        max_batch=max(spec.max_batches),
        resolution=spec.latent_side,
    )


def random_cond(
    spec: ScaleSpec, rows: int, device: torch.device, dtype: torch.dtype, cfg: bool
) -> dict[str, torch.Tensor]:
    """Conditioning of `rows` rows shaped as SD3's encoders give it (joint context, pooled vector)."""
    t = spec.transformer
    gen = generator(device, rows)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    cond = {
        "prompt_embeds": draw(rows, spec.context_tokens, t["joint_attention_dim"]),
        "pooled_prompt_embeds": draw(rows, t["pooled_projection_dim"]),
    }
    if cfg:
        cond |= {
            "negative_prompt_embeds": draw(rows, spec.context_tokens, t["joint_attention_dim"]),
            "negative_pooled_prompt_embeds": draw(rows, t["pooled_projection_dim"]),
        }
    return cond


def section_scale(report: Report, spec: ScaleSpec, device: torch.device, deadline: Deadline) -> None:
    dtype = torch.bfloat16
    report.line("")
    side = spec.latent_side
    report.line(
        f"== 2. throughput: {spec.label}, bfloat16, latents {spec.transformer['in_channels']}x{side}x{side}, "
        f"context {spec.context_tokens} tokens x {spec.transformer['joint_attention_dim']} =="
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    policy = build_scale_policy(spec, device, dtype)
    sync(device)
    params = sum(p.numel() for p in policy.transformer.parameters())
    report.scale(
        "model",
        {
            "label": spec.label,
            "config": spec.transformer,
            "params": params,
            "build_seconds": time.perf_counter() - t0,
            **peak_memory(device),
        },
        f"  built in {time.perf_counter() - t0:.1f} s: {params / 1e6:.1f} M parameters; {memory_text(device)}",
    )

    # -- raw transformer rows per second
    raw: dict[int, float] = {}
    report.line(f"  {'batch':>5} | {'raw NFE/s':>9} | {'s/call':>8} | calls")
    for batch in spec.batch_sizes:
        if deadline.left() < 30:
            report.line(f"  batch {batch}: skipped (time budget)")
            break
        try:
            x = policy.initial_noise(batch, torch.Generator().manual_seed(batch))
            timestep = (
                torch.rand(batch, generator=torch.Generator().manual_seed(batch)).to(device)
                * policy.num_train_timesteps
            )
            cond = random_cond(spec, batch, device, dtype, cfg=False)

            def call() -> torch.Tensor:
                with torch.no_grad():
                    return policy.transformer(
                        hidden_states=x,
                        timestep=timestep,
                        encoder_hidden_states=cond["prompt_embeds"],
                        pooled_projections=cond["pooled_prompt_embeds"],
                        return_dict=False,
                    )[0]

            times = time_calls(
                call,
                device,
                spec.min_seconds,
                spec.max_calls,
                deadline,
                warmup=2 if batch == spec.batch_sizes[0] else 1,
            )
            per_call = statistics.median(times)
            raw[batch] = batch / per_call
            report.scale(
                f"raw_{batch}",
                {"nfe_per_s": raw[batch], "seconds_per_call": per_call, "calls": len(times), **peak_memory(device)},
                f"  {batch:>5} | {raw[batch]:9.1f} | {per_call:8.4f} | {len(times)}",
            )
            del x, timestep, cond
        except Exception as err:
            report.scale(
                f"raw_{batch}", error_summary(err), f"  batch {batch}: ERROR {type(err).__name__}: {str(err)[:200]}"
            )
            break

    def raw_at(rows: int) -> tuple[int, float] | None:
        """The raw rate at the largest measured batch <= rows (else the smallest measured)."""
        if not raw:
            return None
        fits = [b for b in raw if b <= rows] or [min(raw)]
        return max(fits), raw[max(fits)]

    # -- a rollout of B trajectories and the completions of its states
    rollout_eff, completion_eff = None, {}
    if raw and deadline.left() > 30:
        try:
            batch = spec.trajectories
            cond = random_cond(spec, batch, device, dtype, cfg=False)
            sigmas = policy.sigmas(STEPS)
            x0 = policy.initial_noise(batch, torch.Generator().manual_seed(0))
            sync(device)
            t1 = time.perf_counter()
            out = rollout(policy.velocity, x0, sigmas, cond, kernel=KERNEL, noise=NOISE, generator=generator(device, 1))
            sync(device)
            seconds = time.perf_counter() - t1
            b_raw, r_raw = raw_at(batch)
            rollout_eff = out.nfe / seconds / r_raw
            report.scale(
                "rollout",
                {
                    "trajectories": batch,
                    "steps": STEPS,
                    "nfe": out.nfe,
                    "seconds": seconds,
                    "nfe_per_s": out.nfe / seconds,
                    "ratio_to_raw": rollout_eff,
                    "raw_batch": b_raw,
                },
                f"  rollout ({KERNEL}) B={batch} T={STEPS}: {out.nfe} NFE in {seconds:.2f} s = "
                f"{out.nfe / seconds:.1f} NFE/s "
                f"({rollout_eff:.2f} of raw at {b_raw})",
            )
            report.line(
                f"  completions of its states: {'max_batch':>9} | " + " | ".join(f"{m:>22}" for m in COMPLETIONS)
            )
            for mb in spec.max_batches:
                cells = []
                for method in COMPLETIONS:
                    if deadline.left() < 20:
                        cells.append(f"{'skipped (time)':>22}")
                        continue
                    nfe = completion_nfe(method, batch, STEPS)

                    def run(method: str = method, mb: int = mb) -> None:
                        complete(method, policy.velocity, out.states, sigmas, cond, max_batch=mb)

                    # no warm-up: the raw timings at these batch sizes warmed the kernels, and one
                    # `remaining` at full scale takes seconds
                    times = time_calls(run, device, spec.min_seconds, spec.max_calls, deadline, warmup=0)
                    per_call = statistics.median(times)
                    b_raw, r_raw = raw_at(mb)
                    eff = nfe / per_call / r_raw
                    completion_eff[(method, mb)] = eff
                    report.scale(
                        f"complete_{method}_{mb}",
                        {
                            "nfe": nfe,
                            "seconds": per_call,
                            "calls": len(times),
                            "nfe_per_s": nfe / per_call,
                            "ratio_to_raw": eff,
                            "raw_batch": b_raw,
                            **peak_memory(device),
                        },
                    )
                    cells.append(f"{nfe / per_call:9.1f} NFE/s ({eff:.2f})")
                report.line(f"  {'':<26} {mb:>9} | " + " | ".join(f"{c:>22}" for c in cells))
            report.line(
                "  cells: NFE/s of complete(method, max_batch) and, in brackets, its ratio to raw at that batch"
            )
            del out, cond
        except Exception as err:
            report.scale(
                "rollout_completions",
                error_summary(err),
                f"  rollout / completions: ERROR {type(err).__name__}: {str(err)[:200]}",
            )

    # -- one update micro-step of the GPU recipe: LoRA, CFG, KL to the reference
    update: dict[str, float] = {}
    before = peak_memory(device)  # measure_update resets the peak to report its own
    if deadline.left() > 40:
        try:
            update = measure_update(report, spec, policy, device, dtype, deadline)
        except Exception as err:
            report.scale(
                "update", error_summary(err), f"  update micro-step: ERROR {type(err).__name__}: {str(err)[:200]}"
            )
    else:
        report.line("  update micro-step: skipped (time budget)")
    peak = {k: max(v, peak_memory(device).get(k, 0.0)) for k, v in before.items()}
    text = ", ".join(f"{k} {v:.1f}" for k, v in peak.items()) or "n/a on the CPU"
    report.scale("peak_memory", peak, f"  section 2 peak GPU memory: {text}")
    estimates(report, raw_at, rollout_eff, completion_eff, update, spec)


def measure_update(
    report: Report, spec: ScaleSpec, policy: SD3Policy, device: torch.device, dtype: torch.dtype, deadline: Deadline
) -> dict[str, float]:
    """Seconds of one trained step on a micro-batch, as `training.update` runs it with the recipe."""
    micro = spec.update_micro
    trained = SD3Policy.from_pipeline(
        policy.pipe,
        dtype=dtype,
        device=device,
        guidance_scale=RECIPE_GUIDANCE,
        lora=RECIPE_LORA,
        max_batch=CFG_ROWS * micro,
        resolution=spec.latent_side,
    )  # one call per micro-batch
    cond = random_cond(spec, micro, device, dtype, cfg=True)
    sigmas = trained.sigmas(STEPS)
    x0 = trained.initial_noise(micro, torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = rollout(trained.velocity, x0, sigmas, cond, kernel=KERNEL, noise=NOISE, generator=generator(device, 1))
    advantages = torch.randn(micro, generator=torch.Generator().manual_seed(2)).to(device)
    k = STEPS // 2
    if device.type == "cuda":  # the update's own peak (the caller keeps the section's)
        torch.cuda.reset_peak_memory_stats(device)

    def forward() -> None:
        with torch.no_grad():
            step_log_prob(trained.velocity, out.states, sigmas, cond, k, KERNEL, NOISE)

    def train_step(kl: bool) -> None:
        new = step_log_prob(trained.velocity, out.states, sigmas, cond, k, KERNEL, NOISE)
        ref_mean = None
        if kl:
            with torch.no_grad(), trained.reference():
                ref_mean = step_log_prob(trained.velocity, out.states, sigmas, cond, k, KERNEL, NOISE).mean
        loss = grpo_loss(
            new.log_prob,
            out.log_probs[:, k],
            advantages,
            clip_range=RATIO_TOL,
            kl_beta=RECIPE_KL if kl else 0.0,
            mean=new.mean if kl else None,
            ref_mean=ref_mean,
            kl_std=new.std if kl else None,
        )
        loss.loss.backward()

    calls = max(2, spec.max_calls // 10)
    fwd = statistics.median(time_calls(forward, device, spec.min_seconds / 2, calls, deadline))
    fb = statistics.median(time_calls(lambda: train_step(False), device, spec.min_seconds / 2, calls, deadline))
    fbk = statistics.median(time_calls(lambda: train_step(True), device, spec.min_seconds / 2, calls, deadline))
    for p in trained.trainable_parameters():
        p.grad = None
    rows = CFG_ROWS * micro
    result = {
        "micro_trajectories": micro,
        "rows": rows,
        "lora_forward_s": fwd,
        "forward_backward_s": fb,
        "forward_backward_kl_s": fbk,
        "update_over_forward": fb / fwd,
        "update_kl_over_forward": fbk / fwd,
        **peak_memory(device),
    }
    report.scale(
        "update",
        result,
        f"  update micro-step (LoRA r{RECIPE_LORA.rank}, CFG {RECIPE_GUIDANCE}, {micro} trajectories = {rows} rows, "
        "one step): "
        f"LoRA forward {fwd:.3f} s, forward+backward {fb:.3f} s ({fb / fwd:.2f}x), with KL reference {fbk:.3f} s "
        f"({fbk / fwd:.2f}x); {memory_text(device)}",
    )
    return result


def estimates(
    report: Report,
    raw_at: Callable[[int], tuple[int, float] | None],
    rollout_eff: float | None,
    completion_eff: dict[tuple[str, int], float],
    update: dict[str, float],
    spec: ScaleSpec,
) -> None:
    """Seconds per GRPO iteration derived from the measured rates (module doc); printed as such."""
    big = raw_at(max(spec.max_batches))
    small = raw_at(CFG_ROWS * RECIPE_MICRO)
    if big is None or small is None:
        report.line("  derived estimates: no raw rate measured")
        return
    (b_big, r_big), (b_small, r_small) = big, small
    B, T = EST_TRAJECTORIES, EST_STEPS
    rows = B * T * CFG_ROWS  # guided NFEs of the rollout, in transformer rows
    eff = rollout_eff or 1.0
    rollout_s = rows / (r_big * eff)
    update_s = UPDATE_FORWARDS * rows / r_small  # every step trained (flow kernel), recipe micro-batch
    update_meas = None
    if update:
        steps_calls = B * T / update["micro_trajectories"]
        update_meas = steps_calls * update["forward_backward_kl_s"]
    mb = max(m for _, m in completion_eff) if completion_eff else None
    report.line("")
    report.line(
        f"  DERIVED ESTIMATES (not measured): one GRPO iteration, B = {B} trajectories x T = {T} steps, CFG "
        f"({CFG_ROWS} transformer rows per NFE), every step trained"
    )
    report.line(
        f"    rollout: {rows} rows at raw({b_big}) = {r_big:.1f} rows/s x rollout efficiency {eff:.2f} -> "
        f"{rollout_s:.1f} s"
    )
    report.line(
        f"    update: {UPDATE_FORWARDS:g} x {rows} rows at raw({b_small}) = {r_small:.1f} rows/s -> {update_s:.1f} s"
        + (
            f"; measured micro-step ({update['micro_trajectories']} traj., KL) x "
            f"{B * T // update['micro_trajectories']} "
            f"-> {update_meas:.1f} s"
            if update_meas is not None
            else ""
        )
    )
    report.line(f"    completion: NFE x {CFG_ROWS} rows at raw({b_big}) x its measured ratio at max_batch {mb}")
    report.line(
        f"    {'method':<12} {'compl. rows':>11} {'compl. s':>9} {'rollout s':>9} {'update s':>9} {'total s':>8}"
        + (f" {'total (measured update) s':>26}" if update_meas is not None else "")
    )
    table = {}
    for method in ("outcome", *COMPLETIONS):
        if method == "outcome":  # no completion: Flow-GRPO's final-reward credit
            c_rows, c_s = 0, 0.0
        elif (method, mb) in completion_eff:
            c_rows = completion_nfe(method, B, T) * CFG_ROWS
            c_s = c_rows / (r_big * completion_eff[(method, mb)])
        else:
            continue
        total = rollout_s + c_s + update_s
        table[method] = {
            "completion_rows": c_rows,
            "completion_s": c_s,
            "rollout_s": rollout_s,
            "update_s": update_s,
            "total_s": total,
        }
        line = f"    {method:<12} {c_rows:>11} {c_s:>9.1f} {rollout_s:>9.1f} {update_s:>9.1f} {total:>8.1f}"
        if update_meas is not None:
            table[method]["total_measured_update_s"] = rollout_s + c_s + update_meas
            line += f" {rollout_s + c_s + update_meas:>26.1f}"
        report.line(line)
    report.line(
        "    not included: VAE decoding and reward scoring of the B (T+1) completed latents, text encoding, "
        "data movement between stages"
    )
    report.data["estimates"] = {
        "trajectories": B,
        "steps": T,
        "cfg_rows": CFG_ROWS,
        "update_forwards": UPDATE_FORWARDS,
        "raw_batch_rollout": b_big,
        "raw_batch_update": b_small,
        "rollout_efficiency": eff,
        "completion_max_batch": mb,
        "update_measured_s": update_meas,
        "methods": table,
        "note": "derived from the measured rates, not measured",
    }
    report.save()


# ----------------------------------------------------------------------------- main


def main() -> None:
    global STEPS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "out" / "gpu", help="results.json and report.txt go here"
    )
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --small, to try the script)")
    parser.add_argument("--small", action="store_true", help="toy sizes everywhere (section 2 on a small transformer)")
    parser.add_argument("--skip-checks", action="store_true", help="skip section 1 (correctness)")
    parser.add_argument("--skip-scale", action="store_true", help="skip section 2 (throughput at SD3-medium scale)")
    parser.add_argument(
        "--budget",
        type=float,
        default=240.0,
        help="seconds for the whole script; section 2 stops starting measurements when it runs out",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=int(os.environ.get("STEPGRPO_THREADS", "0")) or None,
        help="torch CPU threads (default: $STEPGRPO_THREADS, else torch's)",
    )
    args = parser.parse_args()
    if args.small:
        STEPS = SMALL_STEPS
    deadline = Deadline(args.budget)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "--device cuda but torch sees no CUDA device; use --device cpu --small to try the script on a CPU"
        )
    problem = import_error()
    if problem:  # nothing below can run; leave the reason where the results would be
        failed = Report(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, "error": problem})
        failed.data["status"] = "failed"
        failed.save()
        failed.line(problem)
        raise SystemExit(1)
    quiet_libraries()
    report = Report(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, "machine": machine(device)})
    report.line(f"stepgrpo GPU checks: {json.dumps(report.data['meta']['machine'])}")
    start = time.perf_counter()
    trajectories, micro = (2, 1) if args.small else (8, 4)  # --small: every path, the fewest rows
    if not args.skip_checks:
        section_correctness(report, device, trajectories, micro)
        report.line(f"  section 1: {time.perf_counter() - start:.1f} s")
    if not args.skip_scale:
        t0 = time.perf_counter()
        try:
            section_scale(report, SMALL if args.small else REAL, device, deadline)
        except Exception as err:
            report.scale("error", error_summary(err), f"  section 2: ERROR {type(err).__name__}: {str(err)[:300]}")
        report.line(f"  section 2: {time.perf_counter() - t0:.1f} s")
    checks = report.data["checks"]
    failed = [f"{c['name']} ({c['dtype']})" for c in checks if c["passed"] is False]
    report.data["status"] = "done"
    report.data["seconds"] = time.perf_counter() - start
    report.save()
    report.line("")
    report.line(
        f"done in {time.perf_counter() - start:.1f} s: {len(checks) - len(failed)}/{len(checks)} checks passed"
        + (f"; FAILED: {', '.join(failed)}" if failed else "")
    )
    report.line(f"results: {args.out / 'results.json'}, {args.out / 'report.txt'}")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
