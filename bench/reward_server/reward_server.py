"""8 clients scoring through one `stepgrpo reward-server` against each scoring in-process, in one run.

    python -m bench.reward_server.reward_server [--reward shapes | --clip] [--clients 8] [--requests 6] [--images 16]

Each of `--clients` threads scores `--requests` requests of `--images` shipped-model-sized images
(the shapes data set's renders, 64 x 64). In-process, each client builds its own reward (what 8
rollout workers that each load the reward do) and scores in its thread; served, one server process
(started as a user starts it, then waited for) holds one reward and scores the clients' concurrent
requests together, up to `--max-batch` images a call. The table gives images per second of each
way, best of `--repeats`, and the ratio. Run it on an idle machine: both ways use every core.

`--clip` serves `pickscore` on a random CLIP of ViT-B/32's shape (224 px; built once under the
output's directory): a reward with a model's cost per image, where the shapes reward costs less
per image than the HTTP codec (PNG, base64, JSON) does.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from bench._lib.common import OUT_DIR


def batches(clients: int, requests: int, images: int) -> list[list[tuple[torch.Tensor, list[str], list[dict]]]]:
    """Each client's requests: images, prompts and metadata of the shapes data set."""
    from stepgrpo.images import from_uint8
    from stepgrpo.shapes import data

    rng = np.random.default_rng(0)
    specs = data.all_specs()
    out = []
    for _ in range(clients):
        mine = []
        for _ in range(requests):
            chosen = [specs[i] for i in rng.integers(0, len(specs), images)]
            pixels = from_uint8(np.stack([data.render(s, rng) for s in chosen]))
            mine.append((pixels, [data.prompt_of(s) for s in chosen], chosen))
        out.append(mine)
    return out


def clip_model(path: Path) -> str:
    """A random CLIPModel of ViT-B/32's vision shape (and CLIP's text shape), with a processor."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from stepgrpo.shapes.model import build_tokenizer

    if not (path / "config.json").is_file():
        tokenizer = build_tokenizer("a photo of red blue green square circle triangle left right and".split())
        config = CLIPConfig(
            text_config={"vocab_size": len(tokenizer), "max_position_embeddings": 77},
            vision_config={"image_size": 224, "patch_size": 32},
        )
        torch.manual_seed(0)
        CLIPModel(config).save_pretrained(str(path))
        image = CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224})
        CLIPProcessor(image_processor=image, tokenizer=tokenizer).save_pretrained(str(path))
    return str(path)


def run_clients(work, score_of) -> float:
    """Images per second of all clients at once; `score_of(client)` -> its scoring function."""
    fns = [score_of(c) for c in range(len(work))]

    def client(c: int) -> int:
        return sum(len(fns[c](*req).scores) for req in work[c])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(work)) as pool:
        n = sum(pool.map(client, range(len(work))))
    return n / (time.perf_counter() - t0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reward", default="shapes")
    p.add_argument("--clip", action="store_true", help="pickscore on a random ViT-B/32-shaped CLIP")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--images", type=int, default=16)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="the JSON result (default bench/out/reward_server*.json)")
    a = p.parse_args()
    from stepgrpo.rewards import build_reward
    from stepgrpo.rewards.remote import HttpReward

    a.out = a.out or OUT_DIR / ("reward_server_clip.json" if a.clip else "reward_server.json")
    a.out.parent.mkdir(parents=True, exist_ok=True)

    options: dict[str, str] = {}
    if a.clip:
        a.reward = "pickscore"
        model = clip_model(a.out.parent / "reward_server_clip")
        options = {"model": model, "processor": model, "device": "cpu"}
    spec = {"name": a.reward, "options": options}
    work = batches(a.clients, a.requests, a.images)
    port = free_port()
    env = dict(os.environ, STEPGRPO_REWARD_TOKEN="")
    server = subprocess.Popen(
        [sys.executable, "-m", "stepgrpo_cli", "reward-server", "--reward", a.reward, "--port", str(port)]
        + ["--max-batch", str(a.max_batch), "--options", json.dumps(options)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=(a.out.with_suffix(".log")).open("w"),
    )
    try:
        local = build_reward(spec)
        url = f"http://127.0.0.1:{port}"
        probe = HttpReward(url, local.name, local.version, timeout=5, retries=60, backoff=0.5)
        probe.check()  # waits for the server to come up (connection refused is retried)
        served, inproc = [], []
        for _ in range(a.repeats):
            rewards = [build_reward(spec) for _ in range(a.clients)]  # each client loads its own
            inproc.append(run_clients(work, lambda c: rewards[c]))
            served.append(run_clients(work, lambda c: HttpReward(url, local.name, local.version, timeout=600)))
    finally:
        server.terminate()
        server.wait(30)
    calls = [
        (int(m[1]), int(m[2]), float(m[3]))
        for m in re.finditer(
            r"scored (\d+) images of (\d+) requests in ([\d.]+) s", a.out.with_suffix(".log").read_text()
        )
    ]
    result = {
        "reward": a.reward + (" (random ViT-B/32-shaped CLIP)" if a.clip else ""),
        "clients": a.clients,
        "requests_per_client": a.requests,
        "images_per_request": a.images,
        "max_batch": a.max_batch,
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "in_process_images_per_s": max(inproc),
        "served_images_per_s": max(served),
        "ratio_served_over_in_process": max(served) / max(inproc),
        "runs": {"in_process": inproc, "served": served},
        # the server's reward calls over all repeats (its log): how well it batched, and how much of
        # the served time the reward itself took
        "server_calls": len(calls),
        "server_images_per_call": sum(c[0] for c in calls) / max(1, len(calls)),
        "server_requests_per_call": sum(c[1] for c in calls) / max(1, len(calls)),
        "server_reward_images_per_s": sum(c[0] for c in calls) / max(1e-9, sum(c[2] for c in calls)),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2))

    print(
        f"{a.clients} clients x {a.requests} requests x {a.images} images, reward {result['reward']}, "
        f"{os.cpu_count()} cpus"
    )
    print(f"  in-process (a reward per client): {max(inproc):8.1f} images/s")
    print(f"  one reward server (batched):      {max(served):8.1f} images/s")
    print(f"  served / in-process:              {result['ratio_served_over_in_process']:8.2f}x")
    print(
        f"  the server's reward calls: {len(calls)}, {result['server_images_per_call']:.1f} images "
        f"({result['server_requests_per_call']:.1f} requests) a call, "
        f"{result['server_reward_images_per_s']:.1f} images/s inside the reward"
    )
    print(f"written: {a.out}")


if __name__ == "__main__":
    main()
