"""Transformer throughput of the policy, and how much of it the completions keep.

For each batch size `b` it measures, in NFEs (velocity rows) per second:

- `raw`: the transformer called directly on `b` prepared rows (the ceiling);
- `velocity`: `SD3Policy.velocity` on the same rows (adapter overhead: timestep scale, casts);
- `remaining`, `substeps:2`, `tweedie`: `stepgrpo_core.completions.complete` on the states of a
  `T`-step rollout through the adapter with `max_batch = b`, reported as NFE/s and as a ratio to
  `raw` at the same batch (target >= 0.8). Completions batch rows of all trajectories at the
  same noise level; `remaining` has levels with fewer rows than `b`, so partial batches cost it.

The model is the shipped `models/shapes`; if it has not been built yet, a random-weight pipeline
of the same architecture (`ModelSpec()`, same cost per forward) stands in and the header says so.
No CFG (guidance 1): one transformer row per NFE, so the ratios compare like with like.

    python -m bench.costs.forward [--batch-sizes 8 32 64 128] [--steps 10] [--trajectories 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from stepgrpo.policy.base import DEFAULT_MODEL
from stepgrpo.policy.sd3 import SD3Policy
from stepgrpo_core.completions import complete
from stepgrpo_core.rollout import rollout

COMPLETIONS = ("remaining", "substeps:2", "tweedie")


def load_policy(spec_name: str, device: str, dtype: str | None) -> tuple[SD3Policy, str]:
    if spec_name == "shipped" and DEFAULT_MODEL.is_dir():
        return SD3Policy.from_pretrained(device=device, dtype=dtype), "shipped models/shapes"
    from stepgrpo.shapes.model import ModelSpec, build_pipeline, tiny_spec

    spec = tiny_spec() if spec_name == "tiny" else ModelSpec()
    label = (
        "tiny_spec() random weights" if spec_name == "tiny" else "ModelSpec() random weights (models/shapes not built)"
    )
    return SD3Policy.from_pipeline(build_pipeline(spec, seed=0), device=device, dtype=dtype), label


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCKS["wall"]


def _timed(fn, device: torch.device) -> float:
    start = clock()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return clock() - start


def paired_rates(fn, rows: int, raw, raw_rows: int, rounds: int, device: torch.device) -> tuple[float, float]:
    """Median NFE/s of `fn` (`rows` rows per call) and median ratio to `raw` (`raw_rows` per call).

    Each round times raw, fn, raw back to back and divides by the mean of the two raw timings, so
    a CPU shared with other jobs slows both sides of a ratio alike. One warm-up call each first.
    """
    fn(), raw()
    rates, ratios = [], []
    for _ in range(rounds):
        before = _timed(raw, device)
        elapsed = _timed(fn, device)
        after = _timed(raw, device)
        rates.append(rows / elapsed)
        ratios.append(rates[-1] / (raw_rows / ((before + after) / 2)))
    return statistics.median(rates), statistics.median(ratios)


@torch.no_grad()
def measure(
    policy: SD3Policy, batch: int, steps: int, trajectories: int, rounds: int
) -> dict[str, tuple[float, float]]:
    """name -> (NFE/s, ratio to raw at this batch); raw's own ratio is 1."""
    gen = torch.Generator().manual_seed(batch)
    x = policy.initial_noise(batch, gen)
    sigma = torch.rand(batch, generator=gen).to(policy.device)
    prompts = ["a red circle left of a blue square"] * batch
    cond = policy.encode(prompts)
    timestep = sigma * policy.num_train_timesteps

    def raw() -> torch.Tensor:
        return policy.transformer(
            hidden_states=x,
            timestep=timestep,
            encoder_hidden_states=cond["prompt_embeds"],
            pooled_projections=cond["pooled_prompt_embeds"],
            return_dict=False,
        )[0]

    dev = policy.device
    out = {"raw": paired_rates(raw, batch, raw, batch, rounds, dev)}
    out["velocity"] = paired_rates(lambda: policy.velocity(x, sigma, cond), batch, raw, batch, rounds, dev)

    # completions of the states of `trajectories` rollouts, max_batch = b
    sigmas = policy.sigmas(steps)
    tcond = policy.encode(prompts[:1] * trajectories)
    states = rollout(policy.velocity, policy.initial_noise(trajectories, gen), sigmas, tcond, kernel="ode").states
    for method in COMPLETIONS:
        nfe = complete(method, policy.velocity, states, sigmas, tcond, max_batch=batch).nfe
        run = lambda: complete(method, policy.velocity, states, sigmas, tcond, max_batch=batch)  # noqa: E731
        out[method] = paired_rates(run, nfe, raw, batch, rounds, dev)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32, 64, 128])
    parser.add_argument("--steps", type=int, default=10, help="T of the rollout whose states are completed")
    parser.add_argument("--trajectories", type=int, default=8, help="B whose states are completed")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per cell (the median is shown)")
    parser.add_argument(
        "--model",
        choices=["shipped", "random", "tiny"],
        default="shipped",
        help="shipped models/shapes (random ModelSpec() stand-in if absent), or force one",
    )
    parser.add_argument(
        "--clock",
        choices=list(CLOCKS),
        default="wall",
        help="wall: NFEs per second; cpu: NFEs per CPU-second of this process "
        "(steadier on a CPU shared with other jobs)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's); 1 avoids oversubscribing a CPU shared with other jobs",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--dtype", default=None, help="float32 / float16 / bfloat16 (default: fp32 on CPU, bf16 on GPU)"
    )
    args = parser.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)

    policy, label = load_policy(args.model, args.device, args.dtype)
    params = sum(p.numel() for p in policy.transformer.parameters())
    print(
        f"model: {label}; transformer {params / 1e6:.2f} M params; latents {policy.latent_shape}; "
        f"{args.device} {policy.dtype}; torch threads {torch.get_num_threads()}; "
        f"completions of B = {args.trajectories} trajectories x T = {args.steps} steps; {args.clock} clock"
    )
    header = f"{'batch':>5} | {'raw NFE/s':>9} | {'velocity':>16} | " + " | ".join(f"{m:>18}" for m in COMPLETIONS)
    print(header)
    print("-" * len(header))
    for batch in args.batch_sizes:
        r = measure(policy, batch, args.steps, args.trajectories, args.rounds)
        cells = [f"{r[k][0]:8.0f} ({r[k][1]:.2f})" for k in ("velocity", *COMPLETIONS)]
        print(
            f"{batch:>5} | {r['raw'][0]:9.0f} | {cells[0]:>16} | " + " | ".join(f"{c:>18}" for c in cells[1:]),
            flush=True,
        )
    print("cells: median NFE/s (median ratio to raw timed around it); completions use max_batch = batch")


if __name__ == "__main__":
    main()
