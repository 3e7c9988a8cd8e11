"""A throughput model of one GRPO iteration on SD3.5-M at 1 / 8 / 16 / 32 GPUs (docs/SCALING.md).

Built from the per-GPU rates `bench/gpu/gpu.py` measured on one H200 (docs/bench/gpu_h200.json: the
SD3-medium-shaped transformer, bf16, 512 px, CFG) and from how stepgrpo splits the work:

- rollout, completion: shards of whole prompt groups, at the measured rows/s of one GPU; the
  slowest GPU holds ceil(groups / GPUs) groups (shards are whole groups);
- update: each GPU computes its share of each optimizer step's trajectories at the measured
  micro-step time (forward + backward with the KL reference), then one ring all-reduce of the
  LoRA gradient per optimizer step (`2 (N-1)/N x bytes / bandwidth`);
- not modelled: VAE decoding, reward models, text encoding, storage, and the DP update's launch
  (process start and model load, which bench/scale/scale.py measures on the CPU).

These are derived numbers, not measurements of a cluster.

    python -m bench.scale.scale_model [--prompts 48] [--group-size 24] [--steps 10] [--method remaining]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RATES = ROOT / "docs" / "bench" / "gpu_h200.json"

# LoRA r32 on every attention projection of SD3.5-M: 24 joint blocks x 8 projections of 1536 x 1536,
# plus the 13 dual-attention blocks' second attention (4 projections): 2 x r x 1536 weights each.
LORA_PARAMS = (24 * 8 + 13 * 4) * 2 * 32 * 1536
GRAD_BYTES = LORA_PARAMS * 4  # fp32 gradients
NVLINK_GBPS = 200.0  # all-reduce bus bandwidth within a node (H100/H200 NVLink, conservative)
FABRIC_GBPS = 25.0  # across nodes (200 Gb/s InfiniBand per GPU)
GPUS_PER_NODE = 8


def completion_rows(method: str, T: int) -> int:
    """Transformer evaluations per trajectory to complete its states (METHODS.md)."""
    if method == "outcome":
        return 0
    if method == "remaining":
        return T * (T + 1) // 2
    if method.startswith("substeps:"):
        return T * int(method.split(":")[1])
    if method == "tweedie":
        return T
    raise ValueError(f"unknown method {method!r}")


def model(prompts: int, group: int, T: int, method: str, gpus: int, rates: dict, optimizer_steps: int) -> dict:
    scale = rates["scale"]
    rollout_rate = scale["raw_64"]["nfe_per_s"] * scale["rollout"]["ratio_to_raw"]
    key = f"complete_{method}_64"
    completion_rate = scale[key]["nfe_per_s"] if key in scale else scale["raw_64"]["nfe_per_s"]
    per_gpu_groups = math.ceil(prompts / gpus)
    rows = 2  # CFG: two transformer rows per evaluation
    traj = per_gpu_groups * group
    rollout = traj * (T + T / group) * rows / rollout_rate  # SDE steps + each group's ODE reference
    completion = traj * completion_rows(method, T) * rows / completion_rate
    u = scale["update"]
    micro_s = u["forward_backward_kl_s"] / u["micro_trajectories"]  # seconds per trajectory per trained step
    update = math.ceil(prompts * group / gpus) * T * micro_s
    bandwidth = NVLINK_GBPS if gpus <= GPUS_PER_NODE else FABRIC_GBPS
    allreduce = 0.0 if gpus == 1 else optimizer_steps * 2 * (gpus - 1) / gpus * GRAD_BYTES / (bandwidth * 1e9)
    total = rollout + completion + update + allreduce
    return {
        "gpus": gpus,
        "rollout_s": rollout,
        "completion_s": completion,
        "update_s": update,
        "allreduce_s": allreduce,
        "iteration_s": total,
        "gpu_hours_per_20_iterations": total * gpus * 20 / 3600,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--group-size", type=int, default=24)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--optimizer-steps", type=int, default=2)
    parser.add_argument("--method", default=None, help="one completion method (default: outcome and remaining)")
    a = parser.parse_args()
    rates = json.loads(RATES.read_text())
    print(
        f"SD3.5-M, 512 px, CFG, T={a.steps}, {a.prompts} prompts x {a.group_size} = {a.prompts * a.group_size} "
        f"trajectories an iteration, every step trained; rates of one {rates['meta']['machine']['gpu']} "
        f"(bench/gpu/gpu.py); LoRA gradient {GRAD_BYTES / 1e6:.0f} MB"
    )
    base = None
    for method in [a.method] if a.method else ["outcome", "remaining"]:
        print(f"\n{method}:")
        print("  GPUs  rollout s  complete s  update s  all-reduce s  iteration s  speed-up  GPU-h / 20 it.")
        for gpus in (1, 8, 16, 32):
            m = model(a.prompts, a.group_size, a.steps, method, gpus, rates, a.optimizer_steps)
            if gpus == 1:
                base = m["iteration_s"]
            print(
                f"  {gpus:4d} {m['rollout_s']:10.1f} {m['completion_s']:11.1f} {m['update_s']:9.1f} "
                f"{m['allreduce_s']:13.4f} {m['iteration_s']:12.1f} {base / m['iteration_s']:9.1f} "
                f"{m['gpu_hours_per_20_iterations']:15.1f}"
            )
    print(
        "\npapers: DenseGRPO 19 GPU-hours per 20 iterations on 16 A100s with full ODE completion "
        "(`remaining`); Flow-GRPO trains on 8-32 GPUs. An H200 is ~2-3x an A100 in bf16."
    )


if __name__ == "__main__":
    main()
