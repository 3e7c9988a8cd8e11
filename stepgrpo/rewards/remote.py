"""A reward behind HTTP: the client reward `http`, and the server that serves any registered reward.

For rewards whose dependencies cannot share the training environment (Flow-GRPO's reward-server
pattern), or one big reward model shared by many workers. The wire format is data only, never
pickle: JSON with the 8-bit images as base64 PNG (lossless, so the server scores exactly the
bytes a local reward would see), the prompts and their metadata.

    GET  /info   -> {"name": ..., "version": ...}
    POST /score  {"images": [png base64], "prompts": [...], "metadata": [...]}
                 -> {"scores": [...], "strict": [...] | null, "sub": {name: [...]}}

The client's identity (`name`, `version`) is declared in its options, so cache keys and stored
rows name the served reward without a network call; on first use the client checks the server
serves that identity (a swapped service would otherwise mix two rewards' rows under one name).

    stepgrpo reward-server --reward pickscore --port 8100        # in the reward's environment
    reward: {name: http, options: {url: "http://host:8100", name: pickscore, version: "1"}}
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import torch
from PIL import Image

from stepgrpo.images import dequantize, quantize
from stepgrpo.rewards.base import REWARDS, Reward, RewardOutput

MAX_BODY = 1 << 30  # bytes a server reads from one request
MAX_IMAGE_PIXELS = 1 << 24  # one image's pixels a server decodes (4096 x 4096): checked from the PNG header
MAX_REQUEST_PIXELS = 1 << 26  # all images' pixels of one request (~0.8 GB as float32 RGB)
LISTEN_BACKLOG = 128  # connections the server's socket queues (http.server's default of 5 resets clients)


def encode_images(images: torch.Tensor) -> list[str]:
    """`[N, 3, H, W]` in [0, 1] -> base64 PNG of each image's 8 bits."""
    out = []
    for a in quantize(images).permute(0, 2, 3, 1).cpu().numpy():
        buffer = io.BytesIO()
        Image.fromarray(a).save(buffer, format="PNG")
        out.append(base64.b64encode(buffer.getvalue()).decode("ascii"))
    return out


def decode_images(encoded: Sequence[str]) -> torch.Tensor:
    """base64 PNG -> `[N, 3, H, W]` float32 in [0, 1] (exactly the client's 8-bit images). Every
    image's size is read from its header and bounded before any is decoded (`MAX_IMAGE_PIXELS`,
    `MAX_REQUEST_PIXELS`): a small request of huge PNGs must not allocate gigabytes."""
    opened, total = [], 0
    for i, e in enumerate(encoded):
        image = Image.open(io.BytesIO(base64.b64decode(e, validate=True)))
        pixels = image.size[0] * image.size[1]
        total += pixels
        if pixels > MAX_IMAGE_PIXELS or total > MAX_REQUEST_PIXELS:
            raise ValueError(
                f"image {i} is {image.size[0]}x{image.size[1]}: over the server's limits ({MAX_IMAGE_PIXELS} pixels "
                f"an image, {MAX_REQUEST_PIXELS} a request); send smaller images or fewer a request"
            )
        opened.append(image)
    if len({im.size for im in opened}) > 1:
        raise ValueError(f"the images of one request differ in size: {sorted({im.size for im in opened})}")
    arrays = [np.asarray(im.convert("RGB")) for im in opened]
    return dequantize(torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous())


class HttpReward:
    """A reward scored by a `stepgrpo reward-server` (or any server speaking its protocol)."""

    def __init__(self, url: str, name: str, version: str, timeout: float = 600.0, batch: int = 64) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"reward http: url {url!r} must start with http:// or https://")
        self.url, self.name, self.version = url.rstrip("/"), name, str(version)
        self.timeout, self.batch = timeout, batch
        self._checked = False

    def _request(self, path: str, body: dict[str, Any] | None = None) -> Any:
        """The JSON answer of the server, within `timeout` seconds for the whole request (a server
        that answers one byte at a time is given up on, not waited for byte by byte)."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path,
            data=data,
            headers={"Content-Type": "application/json"},
            method="GET" if data is None else "POST",
        )
        answer: dict[str, Any] = {}

        def call() -> None:
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    answer["value"] = json.loads(response.read())
            except BaseException as err:  # handed to the caller's thread
                answer["error"] = err

        worker = threading.Thread(target=call, daemon=True, name=f"reward-http {self.url}")
        worker.start()
        worker.join(self.timeout)
        if worker.is_alive():
            raise RuntimeError(
                f"reward server {self.url}{path} did not answer within {self.timeout:g} s; check that it is healthy, "
                "or raise reward.options.timeout"
            )
        err = answer.get("error")
        if err is None:
            return answer["value"]
        if isinstance(err, urllib.error.HTTPError):
            detail = err.read().decode(errors="replace")[:500]
            raise RuntimeError(f"reward server {self.url}{path} answered {err.code}: {detail}") from None
        reason = getattr(err, "reason", None)
        if isinstance(err, urllib.error.URLError) and isinstance(reason, ConnectionRefusedError | socket.gaierror):
            raise RuntimeError(
                f"reward server {self.url} cannot be reached ({reason}); start it with `stepgrpo reward-server` "
                "where the reward's dependencies are installed, or fix reward.options.url"
            ) from None
        if isinstance(err, json.JSONDecodeError | UnicodeDecodeError):
            raise RuntimeError(f"reward server {self.url}{path} answered something that is not JSON ({err})") from None
        if isinstance(err, http.client.HTTPException | ConnectionError | urllib.error.URLError | TimeoutError):
            raise RuntimeError(
                f"reward server {self.url}{path} failed while answering ({type(err).__name__}: {err}): it may have "
                "crashed; see its log"
            ) from None
        raise err

    def check(self) -> None:
        """The server must serve the identity this reward declares."""
        info = self._request("/info")
        served = (str(info.get("name")), str(info.get("version")))
        if served != (self.name, self.version):
            raise RuntimeError(
                f"reward server {self.url} serves {served[0]} v{served[1]}, but the config declares "
                f"{self.name} v{self.version}: set reward.options.name / version to what it serves"
            )
        self._checked = True

    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardOutput:
        if not self._checked:
            self.check()
        parts = []
        for c0 in range(0, len(images), self.batch):
            rows = slice(c0, c0 + self.batch)
            answer = self._request(
                "/score",
                {
                    "images": encode_images(images[rows]),
                    "prompts": list(prompts[rows]),
                    "metadata": [dict(m) for m in metadata[rows]],
                },
            )
            if not isinstance(answer, dict) or not isinstance(answer.get("scores"), list):
                raise ValueError(
                    f"reward {self.name!r} (server {self.url}) answered {type(answer).__name__} without a list of "
                    "scores"
                )
            n = len(images[rows])
            for field in ("scores", "strict"):
                if answer.get(field) is not None and len(answer[field]) != n:
                    raise ValueError(
                        f"reward {self.name!r} (server {self.url}) returned {len(answer[field])} {field} for {n} images"
                    )
            parts.append(answer)
        return RewardOutput(
            scores=torch.tensor([v for p in parts for v in p["scores"]], dtype=torch.float32),
            strict=None
            if any(p.get("strict") is None for p in parts)
            else torch.tensor([v for p in parts for v in p["strict"]], dtype=torch.float32),
            sub={
                n: torch.tensor([v for p in parts for v in (p.get("sub") or {}).get(n, [])], dtype=torch.float32)
                for n in (parts[0].get("sub") or {} if parts else {})
            },
        )


@REWARDS.register("http", identity=lambda url, name, version, timeout=600.0, batch=64: (name, str(version)))
def http_reward(url: str, name: str, version: str, timeout: float = 600.0, batch: int = 64) -> HttpReward:
    """A reward served over HTTP (`stepgrpo reward-server`); `name`, `version`: what it serves."""
    return HttpReward(url, name, version, timeout, batch)


def serve(reward: Reward, host: str = "127.0.0.1", port: int = 8100) -> ThreadingHTTPServer:
    """An HTTP server scoring with `reward` (`serve_forever()` it, or run it in a thread)."""
    lock = threading.Lock()  # a reward model is not assumed thread-safe

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, code: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path != "/info":
                return self._answer(404, {"error": f"no {self.path}: GET /info, POST /score"})
            self._answer(200, {"name": str(reward.name), "version": str(reward.version)})

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/score":
                return self._answer(404, {"error": f"no {self.path}: GET /info, POST /score"})
            try:
                length = int(self.headers.get("Content-Length", "0"))
                if not 0 < length <= MAX_BODY:
                    raise ValueError(f"a request body of {length} bytes")
                body = json.loads(self.rfile.read(length))
                images = decode_images(body["images"])
                with lock:
                    out = reward(images, list(body["prompts"]), list(body.get("metadata") or [{}] * len(images)))
            except (ValueError, KeyError, TypeError, OSError) as err:
                return self._answer(400, {"error": f"{type(err).__name__}: {err}"})
            self._answer(
                200,
                {
                    "scores": out.scores.float().tolist(),
                    "strict": None if out.strict is None else out.strict.float().tolist(),
                    "sub": {n: v.float().tolist() for n, v in out.sub.items()},
                },
            )

        def log_message(self, format: str, *args: Any) -> None:  # quiet: one line per batch is noise
            pass

    class Server(ThreadingHTTPServer):
        request_queue_size = LISTEN_BACKLOG
        daemon_threads = True

    return Server((host, port), Handler)
