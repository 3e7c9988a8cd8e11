"""What the reward server holds for one large request, end to end: its peak resident memory's growth
over the request's body.

`stepgrpo reward-server --reward jpeg_compressibility` runs as its own process, as a user runs it; a
small request first brings every import and the reward's own buffers in. Then its peak resident set
is reset (`/proc/PID/clear_refs`) and one request of `--images` incompressible (random) `--side` px
PNGs is sent; the growth is the server's peak (`VmHWM`) after the request minus its resident set
(`VmRSS`) before it, printed beside the body's size.

    .venv/bin/python -m bench.reward_server.memory                 # 48 images of 512 px (a 48 MiB body)
    .venv/bin/python -m bench.reward_server.memory --images 8 --side 128
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def status_mib(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise KeyError(key)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=48)
    ap.add_argument("--side", type=int, default=512)
    ap.add_argument("--port", type=int, default=8171)
    a = ap.parse_args()
    import httpx
    import numpy as np
    from PIL import Image

    def png(seed: int) -> str:
        pixels = np.random.default_rng(seed).integers(0, 256, (a.side, a.side, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="PNG", compress_level=1)
        return base64.b64encode(buf.getvalue()).decode()

    def body(n: int) -> bytes:
        return json.dumps({"images": [png(i) for i in range(n)], "prompts": ["x"] * n}).encode()

    cmd = [sys.executable, "-m", "stepgrpo_cli", "reward-server", "--reward", "jpeg_compressibility", "--port",
           str(a.port), "--max-batch", str(a.images), "--max-body-mib", "1024"]  # fmt: skip
    env = dict(os.environ, STEPGRPO_THREADS="1")
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{a.port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                httpx.get(url + "/info", timeout=2).raise_for_status()
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("the reward server did not start") from None
                time.sleep(0.5)
        headers = {"content-type": "application/json"}
        assert httpx.post(url + "/score", content=body(2), headers=headers, timeout=300).status_code == 200
        big = body(a.images)
        Path(f"/proc/{server.pid}/clear_refs").write_text("5")  # the peak (VmHWM) starts again from now
        before = status_mib(server.pid, "VmRSS")
        answer = httpx.post(url + "/score", content=big, headers=headers, timeout=600)
        assert answer.status_code == 200, answer.text[:500]
        growth = status_mib(server.pid, "VmHWM") - before
    finally:
        server.terminate()
        server.wait(timeout=30)
    mib = len(big) / 2**20
    print(f"{a.images} images of {a.side} px: a {mib:.0f} MiB body; the server's peak resident memory grew by "
          f"{growth:.0f} MiB ({growth / mib:.1f}x the body)")  # fmt: skip


if __name__ == "__main__":
    main()
