"""The data-parallel policy update: `scale.update_processes` rank processes on this node.

Every rank loads the policy and the iteration's stored trajectories, draws the same shuffled
parts, and computes the gradient of its share of each part (`stepgrpo.training.DataParallel`);
one all-reduce of the flattened LoRA gradient per optimizer step makes every rank take the same
AdamW step. Rank 0 publishes the checkpoint. The group size and the trajectories per iteration
are the config's whatever the number of processes.

Why a hand-made all-reduce rather than `DistributedDataParallel`: an update step runs one
backward per trained step and micro-batch, a number that differs between ranks when a part does
not split evenly, and DDP reduces on every backward (or needs `no_sync` and equal counts); the
LoRA gradient is a few MB, so one all-reduce per optimizer step costs nothing next to the forward
passes.

Why not torchrun: its rendezvous store listens on every interface without authentication. Here
the ranks meet through a file in a private temporary directory (`torch.distributed.FileStore`:
no port is opened for the rendezvous), gloo's own connections bind to the loopback interface
(`GLOO_SOCKET_IFNAME`, unless the user set it for a cluster), and every rank dies with the
process that launched it (Linux `PR_SET_PDEATHSIG`; the ranks also share its process group), so a
killed command leaves no rank writing into a run that a resumed command now owns.

    python -m stepgrpo.parallel RUN_DIR ITERATION SCHEME OPTIONS_DIGEST KEY CONFIG_JSON   # per rank
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stepgrpo.config import Config, validate_config
from stepgrpo.errors import StageError
from storage.run import Run

PARENT_ENV = "STEPGRPO_UPDATE_PARENT"  # the launcher's pid: a rank exits when it is gone
STORE_ENV = "STEPGRPO_RENDEZVOUS"  # the FileStore the ranks meet through
POLL_S = 0.05


def loopback_interface() -> str:
    """The name of the loopback interface (`lo` on Linux, `lo0` on macOS)."""
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    return names[0] if names else "lo"


def launch_update(run: Run, cfg: Config, iteration: int, scheme: str, options_digest: str, key: str) -> None:
    """Run the update of `iteration` over `cfg.scale.update_processes` processes on this node and
    wait for rank 0 to publish its checkpoint; a rank that fails stops the others."""
    n = cfg.scale.update_processes
    with tempfile.TemporaryDirectory(prefix="stepgrpo-update-") as tmp:
        config = Path(tmp) / "config.json"
        config.write_text(cfg.model_dump_json())
        cmd = [sys.executable, "-m", "stepgrpo.parallel", str(Path(run.path).resolve()), str(iteration), scheme]
        procs = start_ranks([*cmd, options_digest, key, str(config)], n, tmp)
        try:
            failed = _wait(procs)
        finally:
            for proc in procs:  # on any way out (an error, Ctrl-C), no rank outlives the launch
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
        if failed is not None:
            log = Path(tmp) / f"rank{failed}.log"
            tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-15:])
            raise StageError(
                f"iteration {iteration} update over {n} processes failed (rank {failed} on {socket.gethostname()}, "
                f"exit {procs[failed].returncode}):\n{tail}\nset scale.update_processes=1 to update in this process"
            )
    if run.stage_manifest(iteration, "checkpoint") is None:
        raise StageError(f"iteration {iteration} update over {n} processes ended without publishing its checkpoint")


def start_ranks(cmd: list[str], n: int, tmp: str | Path) -> list[subprocess.Popen]:
    """Start `n` processes of `cmd` as ranks 0..n-1 of one group: they meet through a FileStore in
    the private directory `tmp` (no port is opened for the rendezvous), their collectives bind to
    the loopback interface unless the user chose one, each writes its output to `tmp/rank<r>.log`,
    and each dies with this process (`_die_with_parent`)."""
    base = {
        **os.environ,
        "WORLD_SIZE": str(n),
        "LOCAL_WORLD_SIZE": str(n),
        PARENT_ENV: str(os.getpid()),
        STORE_ENV: str(Path(tmp) / "rendezvous"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        base.setdefault(var, loopback_interface())
    procs = []
    for r in range(n):
        with open(Path(tmp) / f"rank{r}.log", "wb") as out:
            env = {**base, "RANK": str(r), "LOCAL_RANK": str(r)}
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT))
    return procs


def init_group(backend: str) -> None:
    """Join the group `start_ranks` formed (its FileStore; RANK and WORLD_SIZE from the environment)."""
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    store = dist.FileStore(os.environ[STORE_ENV], world)
    dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]), world_size=world)


def _wait(procs: list[subprocess.Popen]) -> int | None:
    """Wait for every rank; the index of the first that failed (the others are killed: they would
    wait for it in the next all-reduce forever), or None."""
    while True:
        codes = [p.poll() for p in procs]
        bad = [i for i, c in enumerate(codes) if c not in (None, 0)]
        if bad:
            return bad[0]
        if all(c == 0 for c in codes):
            return None
        time.sleep(POLL_S)


def _die_with_parent() -> None:
    """This rank is killed when the launching process dies (Linux), and exits now if it already has."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(os.environ.get(PARENT_ENV, os.getppid())):
        os._exit(1)  # the launcher died before the death signal was armed


def main(argv: list[str]) -> None:
    """One rank (the launcher sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous file)."""
    _die_with_parent()
    import torch
    import torch.distributed as dist

    from stepgrpo import workspace
    from stepgrpo.environment import pin_threads
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
    run = Run.open(run_dir)
    if pin_threads(run) is None:
        workspace.set_threads(cfg.scale.threads)
    init_group("nccl" if gpu else "gloo")
    try:
        parallel = DataParallel(rank, world, cfg.model.device if gpu else "cpu")
        train(run, cfg, int(iteration), scheme, options_digest, key, parallel)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
