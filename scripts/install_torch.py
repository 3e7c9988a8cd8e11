"""Install torch into the running Python before stepgrpo (`make install` runs it; standard library only).

    python scripts/install_torch.py torch==2.13.0

- torch already installed (a CUDA build a GPU user put there first, README): kept.
- A Linux machine without an NVIDIA GPU: the CPU build, from PyTorch's CPU wheel index when it is
  reachable (the default index would fetch the multi-GB CUDA build), else from the default index
  (a machine that mirrors a CPU wheel locally, or a default index that only has CUDA builds).
- Otherwise (a GPU, macOS, Windows): the default index, which serves the right build there.

It prints which build it got.
"""

from __future__ import annotations

import importlib.util
import platform
import shutil
import subprocess
import sys
import urllib.request

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def reachable(url: str, timeout: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout):
            return True
    except OSError:
        return False


def pip(*args: str) -> int:
    return subprocess.call([sys.executable, "-m", "pip", "install", "--quiet", *args])


def main(spec: str) -> None:
    if importlib.util.find_spec("torch") is None:
        cpu_only = platform.system() == "Linux" and shutil.which("nvidia-smi") is None
        if cpu_only and reachable(f"{CPU_INDEX}/torch/"):
            print(f"installing {spec} (CPU build) from {CPU_INDEX}")
            code = pip("--index-url", CPU_INDEX, spec)
        else:
            where = "the default index" + (f" ({CPU_INDEX} is not reachable)" if cpu_only else "")
            print(f"installing {spec} from {where}")
            code = pip(spec)
        if code:
            sys.exit(code)
    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.__version__, torch.version.cuda or '')"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    version, cuda = out[0], out[1] if len(out) > 1 else None
    print(f"torch {version}: " + (f"a CUDA {cuda} build" if cuda else "a CPU-only build"))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "torch")
