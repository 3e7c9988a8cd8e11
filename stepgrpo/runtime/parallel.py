"""Rank processes on this node for a data-parallel computation (the update's, `stepgrpo.loops.update`):
start them, let them meet, wait for them, and stop every one when one fails.

Why not torchrun: its rendezvous store listens on every interface without authentication. Here
the ranks meet through a file in a private temporary directory (`torch.distributed.FileStore`:
no port is opened for the rendezvous), gloo's own connections bind to the loopback interface
(`GLOO_SOCKET_IFNAME`, unless the user set it for a cluster), and every rank dies with the
process that launched it (Linux `PR_SET_PDEATHSIG`; the ranks also share its process group), so a
killed command leaves no rank writing into a run that a resumed command now owns.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from stepgrpo.errors import StageError

PARENT_ENV = "STEPGRPO_UPDATE_PARENT"  # the launcher's pid: a rank exits when it is gone
STORE_ENV = "STEPGRPO_RENDEZVOUS"  # the FileStore the ranks meet through
POLL_S = 0.05


def loopback_interface() -> str:
    """The name of the loopback interface (`lo` on Linux, `lo0` on macOS)."""
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    return names[0] if names else "lo"


def run_ranks(args: Callable[[Path], list[str]], n: int, what: str, hint: str) -> None:
    """Run `n` ranks of the command `args(tmp)` (`tmp`: a private directory for the files they
    read, removed after) and wait for all; a rank that fails stops the others, and the error names
    it with the tail of its output and `hint`."""
    with tempfile.TemporaryDirectory(prefix="stepgrpo-ranks-") as tmp:
        procs = start_ranks(args(Path(tmp)), n, tmp)
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
                f"{what} over {n} processes failed (rank {failed} on {socket.gethostname()}, "
                f"exit {procs[failed].returncode}):\n{tail}\n{hint}"
            )


def start_ranks(cmd: list[str], n: int, tmp: str | Path) -> list[subprocess.Popen]:
    """Start `n` processes of `cmd` as ranks 0..n-1 of one group: they meet through a FileStore in
    the private directory `tmp` (no port is opened for the rendezvous), their collectives bind to
    the loopback interface unless the user chose one, each writes its output to `tmp/rank<r>.log`,
    and each dies with this process (`die_with_parent`)."""
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


def die_with_parent() -> None:
    """This rank is killed when the launching process dies (Linux), and exits now if it already has."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(os.environ.get(PARENT_ENV, os.getppid())):
        os._exit(1)  # the launcher died before the death signal was armed
