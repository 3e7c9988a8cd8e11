"""A reward behind HTTP: the client reward `http` (on httpx), and the wire format it shares with the
server that serves any registered reward (`stepgrpo.rewards.service`, FastAPI and uvicorn).

For rewards whose dependencies cannot share the training environment (Flow-GRPO's reward-server
pattern), or one big reward model shared by many workers. The wire format is data only, never
pickle: JSON with the 8-bit images as base64 PNG (lossless, so the server scores exactly the
bytes a local reward would see), the prompts and their metadata.

    GET  /info   -> {"name": ..., "version": ..., "protocol": 2}
    POST /score  {"images": [png base64], "prompts": [...], "metadata": [...]}
                 -> {"ids": [...], "scores": [...], "strict": [...] | null, "sub": {name: [...]}}

`ids` are the digests of the images the server scored (`image_id`: sha256 of each base64 string,
16 hex digits), in the order it scored them: the client refuses an answer whose ids are not its
own images' in its order (permuted, short, padded or another request's), and one whose scores are
not finite JSON numbers (`strict` and `sub` may hold NaN for "not applicable"; never a boolean,
a string or null). It reads at most `answer_limit(n)` bytes of an answer for n images.

The client's identity (`name`, `version`) is declared in its options, so cache keys and stored
rows name the served reward without a network call; on first use the client checks the server
serves that identity (a swapped service would otherwise mix two rewards' rows under one name).

    stepgrpo reward-server --reward pickscore --port 8100        # in the reward's environment
    reward: {name: http, options: {url: "http://host:8100", name: pickscore, version: "1"}}

A server that listens beyond the loopback needs a shared secret: `--token`, and the same value in
`STEPGRPO_REWARD_TOKEN` where the client runs.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
import os
import threading
import time
from collections.abc import Mapping, MutableSequence, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from stepgrpo.errors import StageError
from stepgrpo.images import quantize
from stepgrpo.rewards.base import REWARDS, RewardOutput

MAX_BODY = 1 << 30  # bytes a server reads from one request, at most (`body_limit` sizes the default)
PROTOCOL = 2  # the wire format's version (2: the answer echoes the scored images' ids)


def image_id(encoded: str) -> str:
    """An image's id on the wire: the first 16 hex digits of the sha256 of its base64 string."""
    import hashlib

    return hashlib.sha256(encoded.encode("ascii", "replace")).hexdigest()[:16]


def answer_limit(n: int) -> int:
    """The most bytes a client reads of the answer for `n` images: ids, three numbers a score's
    fields and sub-scores, generously (a score is ~25 bytes of JSON)."""
    return (1 << 20) + n * (16 << 10)


def body_limit(max_batch: int, resolution: int | None) -> int:
    """A server's default request limit: its largest batch of the largest images it scores (a
    base64 PNG of an RGB image is at most ~1.4x its raw bytes; 1024 x 1024 when `--resolution` does
    not say), capped at `MAX_BODY`."""
    side = resolution or 1024
    return min(MAX_BODY, (1 << 20) + max_batch * (3 * side * side * 14 // 10 + (4 << 10)))


MAX_IMAGE_PIXELS = 1 << 24  # one image's pixels a server decodes (4096 x 4096): checked from the PNG header
MAX_REQUEST_PIXELS = 1 << 26  # all images' pixels of one request (~0.8 GB as float32 RGB)
TOKEN_ENV = "STEPGRPO_REWARD_TOKEN"  # the shared secret, for the client and the server (`--token`'s default)


def encode_images(images: torch.Tensor) -> list[str]:
    """`[N, 3, H, W]` in [0, 1] -> base64 PNG of each image's 8 bits."""
    out = []
    for a in quantize(images).permute(0, 2, 3, 1).cpu().numpy():
        buffer = io.BytesIO()
        Image.fromarray(a).save(buffer, format="PNG")
        out.append(base64.b64encode(buffer.getvalue()).decode("ascii"))
    return out


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(encoded: str, i: int) -> tuple[int, int]:
    """(width, height) of the base64 PNG `encoded` (image `i` of a request), from its first 24 bytes
    (the signature and the IHDR chunk): nothing else of it is decoded."""
    try:
        head = base64.b64decode(encoded[:32], validate=True)
    except (binascii.Error, ValueError) as err:
        raise ValueError(
            f"image {i} is not valid base64 ({err}); send each image as the standard base64 of its PNG "
            "bytes (`base64.b64encode(png).decode()`), without line breaks or a data: prefix"
        ) from None
    if len(head) < 24 or not head.startswith(PNG_SIGNATURE) or head[12:16] != b"IHDR":
        raise ValueError(f"image {i} is base64 but not a PNG image (no PNG header); send PNG bytes")
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def decode_images(encoded: MutableSequence[str | None], resolution: int | None = None) -> torch.Tensor:
    """base64 PNG -> `[N, 3, H, W]` uint8: the client's 8-bit images (`dequantize` makes them the
    reward's float input, a batch at a time). Every image's size is read from its PNG header (the
    first 32 base64 characters) and checked before any is decoded: against `resolution` (a side)
    when given, the images of one request alike, and bounded (`MAX_IMAGE_PIXELS`,
    `MAX_REQUEST_PIXELS`): a small request of huge PNGs must not allocate gigabytes. Then each image
    is decoded straight into its row of the result and its base64 string let go (`encoded[i]` becomes
    None: the caller's list, parsed from the request, is released as it is read): the request's
    pixels are held once, at a byte a channel, beside what remains of its text."""
    sizes, total = [], 0
    for i, e in enumerate(encoded):
        width, height = png_size(e or "", i)
        if resolution is not None and (width, height) != (resolution, resolution):
            raise ValueError(
                f"image {i} is {width}x{height}, but this server scores "
                f"{resolution}x{resolution} images (--resolution); send images at the model's resolution"
            )
        total += width * height
        if width * height > MAX_IMAGE_PIXELS or total > MAX_REQUEST_PIXELS:
            raise ValueError(
                f"image {i} is {width}x{height}: over the server's limits ({MAX_IMAGE_PIXELS} pixels "
                f"an image, {MAX_REQUEST_PIXELS} a request); send smaller images or fewer a request"
            )
        sizes.append((width, height))
    if len(set(sizes)) > 1:
        raise ValueError(f"the images of one request differ in size: {sorted(set(sizes))}")
    width, height = sizes[0] if sizes else (0, 0)
    out = torch.empty((len(sizes), 3, height, width), dtype=torch.uint8)
    for i in range(len(sizes)):
        e, encoded[i] = encoded[i], None
        try:
            data = base64.b64decode(e or "", validate=True)
        except (binascii.Error, ValueError) as err:
            raise ValueError(
                f"image {i} is not valid base64 ({err}); send each image as the standard base64 of its PNG "
                "bytes (`base64.b64encode(png).decode()`), without line breaks or a data: prefix"
            ) from None
        del e
        try:
            with Image.open(io.BytesIO(data)) as image:
                if image.format != "PNG" or image.size != (width, height):
                    raise ValueError(f"image {i} is base64 but not the PNG its header says; send PNG bytes")
                out[i] = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)
        except (OSError, Image.DecompressionBombError, SyntaxError) as err:
            raise ValueError(
                f"image {i} is base64 but not a PNG image ({type(err).__name__}); send PNG bytes"
            ) from None
    return out


TRANSIENT_STATUS = (429, 502, 503, 504)  # answers worth another try: the server is busy or restarting


def _token() -> str | None:
    """The shared secret from `STEPGRPO_REWARD_TOKEN`; one with whitespace or a control character
    (a newline read from a file) is refused naming the variable, never showing the value."""
    token = os.environ.get(TOKEN_ENV)
    if token and (token != token.strip() or not token.isprintable() or " " in token):
        raise ValueError(
            f"{TOKEN_ENV} holds whitespace or a control character (a trailing newline, if it was read from a "
            f"file: export {TOKEN_ENV}=\"$(tr -d '\\n' < FILE)\"); its value is not shown"
        )
    return token


class HttpReward:
    """A reward scored by a `stepgrpo reward-server` (or any server speaking its protocol), on httpx.

    `timeout`: the deadline of one whole request (connect, send, the answer's last byte), not of
    each read; `connect_timeout`: of the connection alone. A transient failure (refused or dropped
    connection, 429 / 502 / 503 / 504) is tried again `retries` times after `backoff`, 2 `backoff`,
    4 `backoff` ... seconds; an answer the server means (another 4xx, an identity mismatch) and an
    exceeded deadline are not. The server's error text reaches the user. The shared secret, when
    the server has one, is read from `STEPGRPO_REWARD_TOKEN` (never stored in a run's config)."""

    def __init__(
        self,
        url: str,
        name: str,
        version: str,
        timeout: float = 600.0,
        batch: int = 64,
        connect_timeout: float = 10.0,
        retries: int = 3,
        backoff: float = 0.5,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"reward http: url {url!r} must start with http:// or https://")
        self.url, self.name, self.version = url.rstrip("/"), name, str(version)
        self.timeout, self.batch = timeout, batch
        self.connect_timeout, self.retries, self.backoff = min(connect_timeout, timeout), retries, backoff
        self._checked = False

    @staticmethod
    def check_options(options: dict[str, Any]) -> None:
        """Every problem of an `http` reward's options at once (ValueError), and of the token it
        would send (never shown): `url` (http:// or https://), `name` and `version` are required."""
        problems = [f"`{key}`" for key in ("url", "name", "version") if options.get(key) in (None, "")]
        problems = [f"{', '.join(problems)} missing"] if problems else []
        url = options.get("url")
        if url not in (None, "") and not str(url).startswith(("http://", "https://")):
            problems.append(f"url {url!r} must start with http:// or https://")
        if problems:
            raise ValueError(
                f"reward http: {'; '.join(problems)} (reward.options: url of the `stepgrpo reward-server`, "
                "and the name and version it serves)"
            )
        _token()

    def _headers(self) -> dict[str, str]:
        token = _token()
        return {"Authorization": f"Bearer {token}"} if token else {}

    def _request(self, path: str, body: dict[str, Any] | None = None, limit: int = 1 << 20) -> Any:
        """The JSON answer of the server, at most `limit` bytes of it (see the class's docstring for
        deadlines and retries)."""
        for attempt in range(self.retries + 1):
            try:
                return self._once(path, body, limit)
            except _Transient as err:
                if attempt == self.retries:
                    raise RuntimeError(str(err)) from None
                time.sleep(self.backoff * 2**attempt)
        raise AssertionError("unreachable")

    def _once(self, path: str, body: dict[str, Any] | None, limit: int) -> Any:
        """One try: the exchange runs in a thread given `timeout` seconds in all (httpx's own
        timeouts bound each read, so a server that drips its answer would outlast them)."""
        where = f"reward server {self.url}{path}"
        answer: dict[str, Any] = {}

        def call() -> None:
            try:
                answer["value"] = self._exchange(path, body, limit)
            except BaseException as err:  # handed to the caller's thread
                answer["error"] = err

        worker = threading.Thread(target=call, daemon=True, name=f"reward-http {self.url}")
        worker.start()
        worker.join(self.timeout)
        if worker.is_alive() or isinstance(answer.get("error"), _Late):
            raise RuntimeError(
                f"{where} did not answer within {self.timeout:g} s; check that it is healthy, "
                "or raise reward.options.timeout"
            )
        if "error" in answer:
            raise answer["error"]
        status, data = answer["value"]
        text = data.decode(errors="replace")
        if status in TRANSIENT_STATUS:
            raise _Transient(f"{where} answered {status}: {_error_text(text)}")
        if status >= 400:  # the server's own answer to these inputs: the same again on a retry
            raise StageError(f"{where} answered {status}: {_error_text(text)}")
        try:
            return json.loads(data)
        except (ValueError, RecursionError) as err:  # not JSON, an integer past Python's digits, nesting too deep
            raise StageError(f"{where} answered something that is not a reward's JSON ({type(err).__name__}: "
                             f"{str(err)[:200]})") from None  # fmt: skip

    def _exchange(self, path: str, body: dict[str, Any] | None, limit: int) -> tuple[int, bytes]:
        """The request on httpx: the answer's status and at most `limit` of its bytes (a longer
        answer is refused as it arrives, never held); failures as the user reads them."""
        import httpx

        limits = httpx.Timeout(self.timeout, connect=self.connect_timeout)
        try:
            with (
                httpx.Client(timeout=limits, headers=self._headers()) as client,
                client.stream("GET" if body is None else "POST", self.url + path, json=body) as response,
            ):
                data = bytearray()
                for chunk in response.iter_bytes():
                    data += chunk
                    if len(data) > limit:
                        raise StageError(
                            f"reward server {self.url}{path} answered more than {limit} bytes for this request; "
                            "a reward answer is a few numbers an image: its answer is refused"
                        )
                return response.status_code, bytes(data)
        except httpx.ConnectTimeout as err:
            raise _Transient(f"reward server {self.url} did not accept a connection ({err})") from None
        except httpx.ConnectError as err:
            raise _Transient(
                f"reward server {self.url} cannot be reached ({err}); start it with `stepgrpo reward-server` "
                "where the reward's dependencies are installed, or fix reward.options.url"
            ) from None
        except httpx.TimeoutException:
            raise _Late from None
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as err:
            raise _Transient(
                f"reward server {self.url}{path} failed while answering ({type(err).__name__}: {err}): it may have "
                "crashed; see its log"
            ) from None

    def _checked_answer(self, answer: Any, ids: list[str]) -> dict[str, Any]:
        """One /score answer, refused unless it scores exactly these images in this order with
        numbers: a misaligned answer would store one image's score under another's row."""
        where = f"reward {self.name!r} (server {self.url})"
        if not isinstance(answer, dict):
            raise StageError(f"{where} answered {type(answer).__name__}, not an object with ids and scores")
        if answer.get("ids") != ids:
            got = answer.get("ids")
            shown = f"{len(got)} ids" if isinstance(got, list) else f"ids {str(got)[:40]!r}"
            raise StageError(
                f"{where} answered with {shown} that are not the {len(ids)} images it was sent, in order "
                "(permuted, short, padded or another request's answer); its scores are not stored. A server "
                f"must echo each image's id (protocol {PROTOCOL}: `stepgrpo reward-server` of this version)"
            )
        n = len(ids)
        checks = [("scores", answer.get("scores"), True)]
        if answer.get("strict") is not None:
            checks.append(("strict", answer["strict"], False))
        sub = answer.get("sub") or {}
        if not isinstance(sub, dict):
            raise StageError(f"{where} answered sub-scores that are {type(sub).__name__}, not an object")
        checks += [(f"sub-score {k!r}", v, False) for k, v in sub.items()]
        for field, values, finite in checks:
            if (why := _numbers(values, n, finite)) is not None:
                raise StageError(f"{where} answered {field} that {why}; its scores are not stored")
        return answer

    def check(self) -> None:
        """The server must serve the identity this reward declares."""
        info = self._request("/info")
        served = (str(info.get("name")), str(info.get("version")))
        if served != (self.name, self.version):  # permanent: a stage retry would meet the same server
            raise StageError(
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
            encoded = encode_images(images[rows])
            answer = self._request(
                "/score",
                {"images": encoded, "prompts": list(prompts[rows]), "metadata": [dict(m) for m in metadata[rows]]},
                limit=answer_limit(len(encoded)),
            )
            parts.append(self._checked_answer(answer, [image_id(e) for e in encoded]))
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


def _numbers(values: Any, n: int, finite: bool) -> str | None:
    """Why `values` is not a list of `n` JSON numbers (finite ones when `finite`), or None."""
    if not isinstance(values, list):
        return f"is {type(values).__name__}, not a list"
    if len(values) != n:
        return f"holds {len(values)} values for {n} images"
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int | float):
            return f"value {i} is {type(v).__name__} {str(v)[:40]!r}, not a number"
        if finite and not math.isfinite(v):
            return f"value {i} is {v}, not a finite number"
    return None


class _Transient(Exception):
    """A failure another try may not meet (the message is the user's)."""


class _Late(Exception):
    """httpx's own timeout: the request's deadline has passed."""


def _error_text(text: str) -> str:
    """The server's own error message: `error` (this server) or `detail` (FastAPI's validation)."""
    try:
        answer = json.loads(text)
    except (ValueError, RecursionError):
        return text[:500]
    if isinstance(answer, dict) and ("error" in answer or "detail" in answer):
        return str(answer.get("error", answer.get("detail")))[:2000]
    return text[:500]


# the reward `http`: its options are HttpReward's arguments; its identity is the one it declares
REWARDS.register("http", identity=lambda url, name, version, **_: (name, str(version)))(HttpReward)
