"""The data-parallel policy update: `scale.update_processes` processes launched by torchrun.

Every rank loads the policy and the iteration's stored trajectories, draws the same shuffled
parts, and computes the gradient of its share of each part (`stepgrpo.training.DataParallel`);
one all-reduce of the flattened LoRA gradient per optimizer step makes every rank take the same
AdamW step. Rank 0 publishes the checkpoint. The group size and the trajectories per iteration
are the config's whatever the number of processes.

Why torchrun and a hand-made all-reduce rather than `DistributedDataParallel`: an update step
runs one backward per trained step and micro-batch, a number that differs between ranks when a
part does not split evenly, and DDP reduces on every backward (or needs `no_sync` and equal
counts); the LoRA gradient is a few MB, so one all-reduce per optimizer step costs nothing next
to the forward passes. torchrun is torch's own launcher: nothing more to install, and on Slurm
`srun torchrun` runs the same command.

    python -m stepgrpo.parallel RUN_DIR ITERATION SCHEME OPTIONS_DIGEST KEY CONFIG_JSON   # per rank
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from stepgrpo.config import Config, validate_config
from stepgrpo.errors import StageError
from storage.run import Run


def launch_update(run: Run, cfg: Config, iteration: int, scheme: str, options_digest: str, key: str) -> None:
    """Run the update of `iteration` over `cfg.scale.update_processes` processes on this node and
    wait for rank 0 to publish its checkpoint."""
    n = cfg.scale.update_processes
    with tempfile.TemporaryDirectory(prefix="stepgrpo-update-") as tmp:
        config = Path(tmp) / "config.json"
        config.write_text(cfg.model_dump_json())
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={n}",
            "-m",
            "stepgrpo.parallel",
            str(Path(run.path).resolve()),
            str(iteration),
            scheme,
            options_digest,
            key,
            str(config),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise StageError(
            f"iteration {iteration} update over {n} processes failed (exit {done.returncode}):\n{tail}\n"
            "set scale.update_processes=1 to update in this process"
        )
    if run.stage_manifest(iteration, "checkpoint") is None:
        raise StageError(f"iteration {iteration} update over {n} processes ended without publishing its checkpoint")


def main(argv: list[str]) -> None:
    """One rank (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous)."""
    import torch
    import torch.distributed as dist

    from stepgrpo import workspace
    from stepgrpo.training import DataParallel
    from tasks.update import train

    run_dir, iteration, scheme, options_digest, key, config = argv
    cfg = validate_config(json.loads(Path(config).read_text()))
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    gpu = cfg.model.device.startswith("cuda")
    if gpu:
        device = f"cuda:{local}"
        torch.cuda.set_device(device)
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"device": device})})
    workspace.set_threads(cfg.scale.threads)
    dist.init_process_group("nccl" if gpu else "gloo")
    try:
        parallel = DataParallel(rank, world, cfg.model.device if gpu else "cpu")
        train(Run.open(run_dir), cfg, int(iteration), scheme, options_digest, key, parallel)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
