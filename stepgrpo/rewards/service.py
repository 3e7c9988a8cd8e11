"""`stepgrpo reward-server`: any registered reward behind HTTP, on FastAPI and uvicorn.

    GET  /info    -> {"name": ..., "version": ...}
    POST /score   {"images": [png base64], "prompts": [...], "metadata": [...]}
                  -> {"scores": [...], "strict": [...] | null, "sub": {name: [...]}}
    GET  /docs    the OpenAPI page (/openapi.json its schema)

Requests that arrive while the reward is busy are scored together: one reward call takes the
waiting requests of one image size, in arrival order, up to `max_batch` images, and each request
gets its own rows back (a request larger than `max_batch` is scored alone, in chunks). The reward
runs in one thread (a model is not assumed thread-safe); decoding runs beside it. If a batched call
fails, each of its requests is scored alone, so that an error reaches only the request that caused it.

What is checked before any work: the bearer token (`token`, required when the server listens
beyond the loopback), the body's declared length (`max_body`; a body without Content-Length is
refused), and every image's size from its PNG header against the declared `resolution` (or
against `MAX_IMAGE_PIXELS` when none is declared), before any image is decoded.
"""

from __future__ import annotations

import asyncio
import binascii
import hmac
import ipaddress
import json
import logging
import socket
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel, Field
from starlette.requests import Request  # the score route's parameter: resolved from this module's names

from stepgrpo.images import dequantize
from stepgrpo.rewards.base import Reward, RewardOutput, checked
from stepgrpo.rewards.remote import PROTOCOL, TOKEN_ENV, body_limit, decode_images, image_id

LISTEN_BACKLOG = 1024  # connections the socket queues while the server accepts (100 clients at once must not reset)
log = logging.getLogger("stepgrpo.reward_server")


class ServiceError(ValueError):
    """A reward server that cannot be started as asked (the message says what to change)."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class _Request:
    images: torch.Tensor
    prompts: list[str]
    metadata: list[dict[str, Any]]
    done: asyncio.Future[RewardOutput]
    size: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.size = tuple(self.images.shape[1:])


class Batcher:
    """Scores queued requests with `reward`, several at once (see the module's docstring)."""

    def __init__(self, reward: Reward, max_batch: int) -> None:
        self.reward, self.max_batch = reward, max_batch
        self.queue: asyncio.Queue[_Request] = asyncio.Queue()
        self.calls = 0  # reward calls made (the batching tests read it)
        self.scorer = ThreadPoolExecutor(1, thread_name_prefix="reward")
        self._held: list[_Request] = []  # taken from the queue, waiting for a batch of their size

    async def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        done: asyncio.Future[RewardOutput] = asyncio.get_running_loop().create_future()
        await self.queue.put(_Request(images, prompts, metadata, done))
        return await done

    def _take(self) -> list[_Request]:
        """The next batch: the oldest request, then every waiting one of its size that still fits."""
        while not self.queue.empty():
            self._held.append(self.queue.get_nowait())
        first = self._held.pop(0)
        batch, n = [first], len(first.images)
        for r in list(self._held):
            if r.size == first.size and n + len(r.images) <= self.max_batch:
                batch.append(r)
                n += len(r.images)
                self._held.remove(r)
        return batch

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._held:
                self._held.append(await self.queue.get())
            batch = self._take()
            t0 = time.perf_counter()
            try:
                outs: list[Any] = await loop.run_in_executor(self.scorer, self._score_batch, batch)
            except Exception:  # noqa: BLE001 - then one at a time, so that each request gets its own error
                outs = [await self._alone(loop, r) for r in batch]
            for r, out in zip(batch, outs):
                if r.done.done():  # its client went away
                    continue
                if isinstance(out, BaseException):
                    r.done.set_exception(out)
                else:
                    r.done.set_result(out)
            images = sum(len(r.images) for r in batch)
            log.info("scored %d images of %d requests in %.3f s", images, len(batch), time.perf_counter() - t0)

    async def _alone(self, loop: asyncio.AbstractEventLoop, r: _Request) -> RewardOutput | BaseException:
        try:
            return (await loop.run_in_executor(self.scorer, self._score_batch, [r]))[0]
        except Exception as err:  # noqa: BLE001 - handed to its request
            return err

    def _score_batch(self, batch: list[_Request]) -> list[RewardOutput]:
        """One reward call on the batch's rows (chunks of `max_batch` for a single large request),
        split back per request."""
        images = batch[0].images if len(batch) == 1 else torch.cat([r.images for r in batch])  # one request: no copy
        prompts = [p for r in batch for p in r.prompts]
        metadata = [m for r in batch for m in r.metadata]
        parts = []
        for c0 in range(0, len(images), self.max_batch):
            rows = slice(c0, c0 + self.max_batch)
            self.calls += 1
            chunk = dequantize(images[rows])  # the reward's float input, one call's rows at a time
            parts.append(checked(self.reward(chunk, prompts[rows], metadata[rows]), len(chunk), self.reward.name))
        whole = _cat(parts)
        out, c0 = [], 0
        for r in batch:
            rows = slice(c0, c0 + len(r.images))
            c0 += len(r.images)
            out.append(
                RewardOutput(
                    scores=whole.scores[rows],
                    strict=None if whole.strict is None else whole.strict[rows],
                    sub={k: v[rows] for k, v in whole.sub.items()},
                )
            )
        return out


def _cat(parts: Sequence[RewardOutput]) -> RewardOutput:
    return RewardOutput(
        scores=torch.cat([p.scores for p in parts]),
        strict=None if any(p.strict is None for p in parts) else torch.cat([p.strict for p in parts]),
        sub={k: torch.cat([p.sub[k] for p in parts]) for k in parts[0].sub},
    )


class ScoreRequest(BaseModel):
    """POST /score's body."""

    images: list[str] = Field(description="The 8-bit images, each a base64 PNG, all of one size.")
    prompts: list[str] = Field(description="One prompt per image.")
    metadata: list[dict[str, Any]] | None = Field(None, description="One object per image (the prompt's metadata).")


class ScoreAnswer(BaseModel):
    """POST /score's answer: the scored images' ids (`image_id` of each base64 string, in order) and
    one score per image (`strict` and `sub` when the reward has them)."""

    ids: list[str]
    scores: list[float]
    strict: list[float] | None
    sub: dict[str, list[float]]


class Info(BaseModel):
    """GET /info's answer: the reward served (what a client's config declares)."""

    name: str
    version: str
    protocol: int = PROTOCOL


async def read_json(request: Request) -> Any:
    """The request's JSON body, parsed with the body held once: read into one buffer of its declared
    length (the guard checked it), decoded, and parsed, each copy let go as the next is made (the
    framework's body parsing keeps the chunks, the joined bytes and the text beside the parsed
    strings). A body longer or shorter than its Content-Length is refused."""
    length = int(request.headers["content-length"])
    buffer, n = bytearray(length), 0
    async for chunk in request.stream():
        if n + len(chunk) > length:
            raise ValueError(f"the body is longer than its Content-Length ({length} bytes)")
        buffer[n : n + len(chunk)] = chunk
        n += len(chunk)
    if n != length:
        raise ValueError(f"the body ended after {n} of its Content-Length's {length} bytes")
    try:
        text = buffer.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"the body is not UTF-8 JSON ({err.reason} at byte {err.start})") from None
    del buffer
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"the body is not JSON: {err}") from None
    except RecursionError:
        raise ValueError("the body's JSON is nested too deeply; send a ScoreRequest object") from None


def build_app(
    reward: Reward,
    *,
    max_batch: int = 64,
    token: str | None = None,
    resolution: int | None = None,
    max_body: int | None = None,
) -> Any:
    """The FastAPI application serving `reward` (its `batcher` is on `app.state`); `max_body`
    None: its largest batch of the largest images it scores (`body_limit`)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.concurrency import run_in_threadpool
    from fastapi.encoders import jsonable_encoder
    from fastapi.responses import JSONResponse, Response
    from pydantic import ValidationError

    batcher = Batcher(reward, max_batch)
    max_body = body_limit(max_batch, resolution) if max_body is None else max_body

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202 - FastAPI's contract
        task = asyncio.create_task(batcher.run())
        yield
        task.cancel()
        batcher.scorer.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(
        title=f"stepgrpo reward server: {reward.name} v{reward.version}",
        description="Scores images with a stepgrpo reward for the `http` reward of runs elsewhere.",
        lifespan=lifespan,
    )
    app.state.batcher = batcher

    def refuse(code: int, text: str) -> JSONResponse:
        return JSONResponse({"error": text}, status_code=code)

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Any:
        """The token and the body's length, before the body is read."""
        if request.url.path in ("/docs", "/openapi.json"):
            return await call_next(request)
        if token is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                return refuse(
                    401,
                    f"a missing or wrong token: send `Authorization: Bearer <token>` (the client reads {TOKEN_ENV})",
                )
        if request.method == "POST":
            length = request.headers.get("content-length")
            if length is None:
                return refuse(411, "a request body needs a Content-Length")
            if not length.isdigit() or int(length) > max_body:
                return refuse(413, f"a request body of {length} bytes: this server takes at most {max_body}")
        return await call_next(request)

    @app.get("/info", response_model=Info)
    async def info() -> Info:
        """The reward served: what a client's config must declare."""
        return Info(name=str(reward.name), version=str(reward.version), protocol=PROTOCOL)

    schema = {"content": {"application/json": {"schema": ScoreRequest.model_json_schema()}}, "required": True}

    @app.post(
        "/score",
        response_model=ScoreAnswer,
        responses={400: {"description": "bad images or lengths"}, 422: {"description": "not a ScoreRequest"}},
        openapi_extra={"requestBody": schema},
    )
    async def score(request: Request) -> Any:
        """Score the images (batched with other clients' requests of the same size)."""
        try:
            body = ScoreRequest.model_validate(await read_json(request))
        except ValueError as err:  # not JSON, or not a ScoreRequest (pydantic's ValidationError is one)
            detail = err.errors(include_url=False) if isinstance(err, ValidationError) else str(err)
            return JSONResponse({"detail": jsonable_encoder(detail)}, status_code=422)
        n = len(body.images)
        metadata = body.metadata if body.metadata is not None else [{}] * n
        if not n or len(body.prompts) != n or len(metadata) != n:
            why = f"{n} images, {len(body.prompts)} prompts and {len(metadata)} metadata: give one of each per image"
            return refuse(400, why)
        ids = [image_id(e) for e in body.images]
        encoded: list[str | None] = body.images  # type: ignore[assignment]  # released as decoded
        body.images = []
        try:
            images = await run_in_threadpool(decode_images, encoded, resolution)
        except (ValueError, binascii.Error, OSError) as err:
            return refuse(400, f"{type(err).__name__}: {err}")
        try:
            out = await batcher.score(images, body.prompts, metadata)
        except (ValueError, KeyError, TypeError) as err:
            return refuse(400, f"reward {reward.name!r} refused the request: {type(err).__name__}: {err}")
        answer = {
            "ids": ids,
            "scores": out.scores.float().tolist(),
            "strict": None if out.strict is None else out.strict.float().tolist(),
            "sub": {k: v.float().tolist() for k, v in out.sub.items()},
        }
        # json.dumps, not the model's serializer: a sub-score's NaN (not applicable) stays NaN, not null
        return Response(json.dumps(answer), media_type="application/json")

    return app


class RewardServer:
    """A reward server on uvicorn: bound when made (`server_port` is known, port 0 picks one);
    `serve_forever()` runs it until `shutdown()` (another thread) or Ctrl-C (main thread)."""

    def __init__(
        self,
        reward: Reward,
        host: str = "127.0.0.1",
        port: int = 8100,
        *,
        max_batch: int = 64,
        token: str | None = None,
        resolution: int | None = None,
        max_body: int | None = None,
        access_log: bool = False,
    ) -> None:
        import uvicorn

        if max_batch < 1:
            raise ServiceError(f"--max-batch {max_batch}: give at least 1")
        if not token and not is_loopback(host):
            raise ServiceError(
                f"listening on {host} without a token would let anyone who reaches this machine use the reward: "
                f"give --token (or set {TOKEN_ENV}); clients set {TOKEN_ENV} to the same value"
            )
        self.app = build_app(reward, max_batch=max_batch, token=token or None, resolution=resolution, max_body=max_body)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        self.server_port = self.socket.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            log_level="info" if access_log else "warning",
            access_log=access_log,
            backlog=LISTEN_BACKLOG,
            timeout_graceful_shutdown=5,
        )
        self.server = uvicorn.Server(config)
        self._stopped = threading.Event()

    def serve_forever(self) -> None:
        try:
            self.server.run(sockets=[self.socket])
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop a server that `serve_forever`s in another thread; returns when it has stopped."""
        self.server.should_exit = True
        self._stopped.wait(30)

    def server_close(self) -> None:
        self.socket.close()


def serve(reward: Reward, host: str = "127.0.0.1", port: int = 8100, **options: Any) -> RewardServer:
    """A reward server scoring with `reward` (`serve_forever()` it, or run that in a thread)."""
    return RewardServer(reward, host, port, **options)
