"""Prepared GPU check of the sharded update: a full fine-tune step of an SD3.5-M-shaped transformer
(random weights, bf16) sharded with stepgrpo's FSDP2 setup (`stepgrpo.loops.sharding.shard_policy`:
per block, then the root, the frozen reference copy too) over `--ranks` processes, one GPU each
(NCCL); each rank runs a forward and backward of the policy and a no-grad forward of the reference
on `--rows` rows at 512 px, then an AdamW step, and reports its peak allocated memory against the
formula's states (`stepgrpo.runtime.memory.update_states`, transformer only: no encoders here).
The difference is activations and the allocator's slack, which the formula leaves out.

    python -m bench.scale.gpu_sharded                      # every GPU of the node (1 GPU: FSDP2 over one rank)
    python -m bench.scale.gpu_sharded --ranks 8 --rows 2
    python -m bench.scale.gpu_sharded --offload            # the shards and AdamW's state in host memory
    python -m bench.scale.gpu_sharded --small --device cpu --ranks 2     # the script's own check, on CPUs (gloo)
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.scale.memory_table import MODELS

GIB = 1 << 30


def transformer_config(small: bool) -> dict:
    config = dict(MODELS["SD3.5-M"][0])
    if small:
        config.update(num_layers=2, num_attention_heads=2, attention_head_dim=16, joint_attention_dim=32)
        config.update(caption_projection_dim=32, pooled_projection_dim=16, dual_attention_layers=[0], sample_size=8)
    return config


def rank_main(rank: int, world: int, args: argparse.Namespace, store: str, out: str) -> None:
    import copy

    import diffusers

    from stepgrpo.config import load_config
    from stepgrpo.loops.sharding import shard_policy
    from stepgrpo.runtime.memory import ModelCounts, transformer_counts, update_states

    gpu = args.device == "cuda"
    device = torch.device(f"cuda:{rank}" if gpu else "cpu")
    if gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if gpu else "gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    config = transformer_config(args.small)
    dtype = torch.bfloat16 if gpu else torch.float32
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)  # built in its dtype on the CPU, sharded onto the GPU block by block
    model = getattr(diffusers, config["_class_name"]).from_config(
        {k: v for k, v in config.items() if not k.startswith("_")}
    )
    torch.set_default_dtype(torch.float32)
    reference = copy.deepcopy(model).requires_grad_(False)
    pol = SimpleNamespace(transformer=model, _reference=reference, device=device, dtype=dtype)
    sets = ["model.finetune=full", f"scale.update_processes={max(world, 2)}", "scale.update_sharding=fsdp"]
    if args.offload:  # FSDP2's CPU offload: the shards and AdamW's state in host memory
        sets += ["model.device=cuda", "scale.update_offload=true"]
    cfg = load_config(None, sets)
    t0 = time.perf_counter()
    shard_policy(pol, cfg, world)
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    shard_s = time.perf_counter() - t0
    side = 8 if args.small else 64  # latent side: 512 px
    B = args.rows
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(B, config["in_channels"], side, side, generator=gen).to(device, dtype)
    text = torch.randn(B, 32 if args.small else 333, config["joint_attention_dim"], generator=gen).to(device, dtype)
    pooled = torch.randn(B, config["pooled_projection_dim"], generator=gen).to(device, dtype)
    t = torch.full((B,), 500.0, device=device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6, foreach=False)
    t1 = time.perf_counter()
    with torch.no_grad():
        ref = reference(hidden_states=x, encoder_hidden_states=text, pooled_projections=pooled, timestep=t).sample
    v = model(hidden_states=x, encoder_hidden_states=text, pooled_projections=pooled, timestep=t).sample
    loss = (v.float() - ref.float()).square().mean() + v.float().square().mean()
    loss.backward()
    opt.step()
    if gpu:
        torch.cuda.synchronize()
    step_s = time.perf_counter() - t1
    P, block, lora = transformer_counts(config, 32, ("to_q",))
    states = update_states(
        ModelCounts(P, block, lora, 0),
        dtype="bfloat16" if gpu else "float32",
        full=True,
        shards=world,
        offload=args.offload,
        gpu=gpu,
    )["device"]
    states = {k: v for k, v in states.items() if k not in ("initial", "snapshots", "signal sums", "signal halves")}
    result = {
        "rank": rank,
        "world": world,
        "parameters": P,
        "formula_gib": round(sum(states.values()) / GIB, 3),
        "terms_gib": {k: round(v / GIB, 3) for k, v in states.items() if v},
        "shard_seconds": round(shard_s, 2),
        "step_seconds": round(step_s, 2),
        "loss": float(loss),
    }
    if gpu:
        result["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / GIB, 3)
        result["measured_over_formula"] = round(result["peak_allocated_gib"] / result["formula_gib"], 3)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--ranks", type=int)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--small", action="store_true", help="a toy transformer (the script's own check)")
    ap.add_argument("--offload", action="store_true", help="with FSDP2's CPU offload (GPU only)")
    args = ap.parse_args()
    if args.offload and args.device != "cuda":
        raise SystemExit("--offload moves the shards from GPU to host memory: it needs --device cuda")
    world = args.ranks or (torch.cuda.device_count() if args.device == "cuda" else 2)
    if args.device == "cuda" and world > torch.cuda.device_count():
        raise SystemExit(f"--ranks {world}: this node has {torch.cuda.device_count()} GPUs (one a rank)")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(rank_main, args=(world, args, os.path.join(tmp, "store"), tmp), nprocs=world, join=True)
        results = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(world)]
    print(json.dumps({"device": args.device, "rows": args.rows, "ranks": results}, indent=1))


if __name__ == "__main__":
    main()
