"""The reward contract is checked at every call: one number per image, named when broken; a reward's
options are part of its stored rows' identity; the HTTP reward gives up on a server within its
deadline, retries only what is transient and says what happened; the reward server (FastAPI on
uvicorn) serves many clients at once, scores their concurrent requests together, and checks the
token, the body's size and the images' sizes before it decodes anything."""

from __future__ import annotations

import base64
import io
import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from PIL import Image

from stepgrpo.config import RewardConfig
from stepgrpo.errors import StageError
from stepgrpo.loops.scoring import score_images
from stepgrpo.rewards import build_reward
from stepgrpo.rewards.base import RewardOutput, checked
from stepgrpo.rewards.remote import HttpReward
from stepgrpo.rewards.service import ServiceError, serve

N = 4


class Broken:
    """A reward that breaks the contract in one way (`how`)."""

    name, version = "broken", "1"

    def __init__(self, how: str) -> None:
        self.how = how

    def __call__(self, images, prompts, metadata):
        n = len(images)
        return {
            "one more": RewardOutput(scores=torch.zeros(n + 1)),
            "one fewer": RewardOutput(scores=torch.zeros(n - 1)),
            "short strict": RewardOutput(scores=torch.zeros(n), strict=torch.zeros(n - 1)),
            "short sub": RewardOutput(scores=torch.zeros(n), sub={"count": torch.zeros(1)}),
            "a list": [0.0] * n,
            "strings": RewardOutput(scores=["high"] * n),
            "a matrix": RewardOutput(scores=torch.zeros(n, 2)),
        }[self.how]


@pytest.mark.parametrize("how", ["one more", "one fewer", "short strict", "short sub", "a list", "strings", "a matrix"])
def test_a_reward_that_breaks_the_contract_is_named(how):
    images = torch.zeros(N, 3, 8, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="reward 'broken'"):
        score_images(Broken(how), images, ["a"] * N, [{}] * N, chunk=N)


def test_a_weighted_sum_checks_each_part():
    from stepgrpo.rewards.combine import WeightedSum

    with pytest.raises(ValueError, match="reward 'broken'.*shape \\(5,\\) for 4 images"):
        WeightedSum([(Broken("one more"), 1.0)])(torch.zeros(N, 3, 8, 8), ["a"] * N, [{}] * N)


def test_a_good_output_passes_unchanged():
    out = checked(RewardOutput(scores=[1, 2], strict=torch.ones(2), sub={"a": [0.5, 0.5]}), 2, "r")
    assert out.scores.dtype == torch.float32 and out.scores.tolist() == [1.0, 2.0] and out.sub["a"].shape == (2,)


def test_reward_options_are_part_of_the_stored_identity():
    """Rows scored with other options are never read back as these (a plug-in's declared identity
    rarely names its options; the built-ins' are checked the same way)."""
    from stepgrpo.loops.workspace import reward_identity

    plain = reward_identity(RewardConfig(name="jpeg_compressibility"))
    other = reward_identity(RewardConfig(name="jpeg_compressibility", options={"quality": 50}))
    again = reward_identity(RewardConfig(name="jpeg_compressibility", options={"quality": 50}))
    assert plain["name"] == other["name"] and plain["version"] != other["version"] == again["version"]
    assert other["version"].startswith(other["declared_version"] + "+")  # the built reward carries the declared one
    assert (
        build_reward({"name": "jpeg_compressibility", "options": {"quality": 50}}).version == other["declared_version"]
    )


# ------------------------------------------------------------------------------ the HTTP reward


def _server_thread(handler) -> tuple[str, socket.socket]:
    """A raw TCP server running `handler(conn)` for each connection; its URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)

    def loop():
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            threading.Thread(target=handler, args=(conn,), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()
    return f"http://127.0.0.1:{sock.getsockname()[1]}", sock


def test_a_server_that_drips_its_answer_is_given_up_within_the_deadline():
    def drip(conn):
        conn.recv(65536)
        try:
            for byte in b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n":
                conn.send(bytes([byte]))
                time.sleep(0.3)
        except OSError:
            pass

    url, sock = _server_thread(drip)
    reward = HttpReward(url, "x", "1", timeout=1.5)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="did not answer within 1.5 s"):
        reward.check()
    assert time.monotonic() - t0 < 4
    sock.close()


def test_a_server_that_crashes_mid_request_is_not_called_unreachable():
    def crash(conn):
        conn.recv(65536)
        conn.close()

    url, sock = _server_thread(crash)
    with pytest.raises(RuntimeError, match="may have crashed") as err:
        HttpReward(url, "x", "1", timeout=5, backoff=0.05).check()
    assert "cannot be reached" not in str(err.value)
    sock.close()


def test_a_refused_connection_is_unreachable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RuntimeError, match="cannot be reached"):
        HttpReward(f"http://127.0.0.1:{port}", "x", "1", timeout=5, backoff=0.05).check()


@pytest.fixture(scope="module")
def jpeg_server():
    server = serve(build_reward("jpeg_compressibility"), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def test_the_reward_server_serves_a_hundred_clients_at_once(jpeg_server):
    reward = HttpReward(jpeg_server, "jpeg_compressibility", "1", timeout=120)
    images = torch.rand(2, 3, 16, 16)

    def one(_):
        return HttpReward(jpeg_server, reward.name, build_reward("jpeg_compressibility").version, timeout=120)(
            images, ["a", "b"], [{}, {}]
        ).scores

    with ThreadPoolExecutor(100) as pool:
        results = list(pool.map(one, range(100)))
    assert all(torch.equal(r, results[0]) for r in results)


def test_the_reward_server_refuses_huge_images_before_decoding_them(jpeg_server):
    import json
    import urllib.error
    import urllib.request

    buffer = io.BytesIO()
    Image.new("RGB", (9000, 9000)).save(buffer, format="PNG")  # 81 megapixels, a small file
    body = {"images": [base64.b64encode(buffer.getvalue()).decode()], "prompts": ["a"]}
    request = urllib.request.Request(
        jpeg_server + "/score", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=60)
    assert err.value.code == 400 and "9000x9000" in err.value.read().decode()


def _reversed(a):
    return {**a, "ids": a["ids"][::-1], "scores": a["scores"][::-1]}


TAMPERED = {  # what a faulty or hostile server could answer, and what the client says
    "short": (lambda a: {**a, "ids": a["ids"][:-1], "scores": a["scores"][:-1]}, "not the 2 images it was sent"),
    "padded": (lambda a: {**a, "ids": [*a["ids"], "0" * 16], "scores": [*a["scores"], 0.5]}, "3 ids"),
    "permuted": (_reversed, "in order"),
    "another request's": (lambda a: {**a, "ids": ["f" * 16, "e" * 16]}, "another request's answer"),
    "without ids (an older server)": (lambda a: {k: v for k, v in a.items() if k != "ids"}, "must echo"),
    "a score short": (lambda a: {**a, "scores": a["scores"][:-1]}, "scores that holds 1 values for 2 images"),
    "a boolean score": (lambda a: {**a, "scores": [True, a["scores"][1]]}, "value 0 is bool"),
    "a string score": (lambda a: {**a, "scores": ["0.5", a["scores"][1]]}, "value 0 is str"),
    "a null score": (lambda a: {**a, "scores": [None, a["scores"][1]]}, "value 0 is NoneType"),
    "a NaN score": (lambda a: {**a, "scores": [float("nan"), a["scores"][1]]}, "not a finite number"),
    "a string sub-score": (lambda a: {**a, "sub": {"x": ["a", "b"]}}, "sub-score 'x'"),
}


@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_the_http_reward_refuses_an_answer_that_is_not_for_its_images(jpeg_server, case):
    """Each image's id comes back with its score, in order: a misaligned or malformed answer is named
    (the server's address in the message), never stored shifted or coerced."""
    tamper, says = TAMPERED[case]

    class Tampered(HttpReward):
        def _request(self, path, body=None, limit=1 << 20):
            answer = super()._request(path, body, limit)
            return tamper(answer) if path == "/score" else answer

    version = build_reward("jpeg_compressibility").version
    with pytest.raises(StageError, match=re.escape(says)) as err:
        Tampered(jpeg_server, "jpeg_compressibility", version)(torch.rand(2, 3, 8, 8), ["a", "b"], [{}, {}])
    assert jpeg_server in str(err.value)


def test_the_http_reward_reads_at_most_a_bound_of_an_answer():
    """A 3 MB answer for 2 images is refused as it arrives (the bound is derived from the batch)."""
    from stepgrpo.rewards.remote import answer_limit

    huge = json.dumps({"name": "r", "version": "1", "pad": "x" * (3 << 20)})
    url, sock, _ = _answering([(200, huge)])
    try:
        with pytest.raises((StageError, RuntimeError), match=f"more than {1 << 20} bytes"):
            HttpReward(url, "r", "1", retries=0).check()
        assert answer_limit(2) < 3 << 20
    finally:
        sock.close()


def _answering(answers: list[tuple[int, str]]):
    """A raw server answering the n-th connection with `answers[n]` (status, JSON body), the last
    one from then on; its URL, socket and the list of requests it saw."""
    seen: list[bytes] = []

    def handler(conn):
        seen.append(conn.recv(65536))
        status, body = answers[min(len(seen) - 1, len(answers) - 1)]
        data = body.encode()
        head = f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
        conn.sendall(head.encode() + b"Connection: close\r\n\r\n" + data)
        conn.close()

    url, sock = _server_thread(handler)
    return url, sock, seen


def test_a_busy_server_is_tried_again_and_a_refusal_is_not():
    """503 / 502 / 504 / 429 and dropped connections are transient: tried again with backoff; a
    400 is the server's answer: not tried again, its error text reaches the user; neither is an
    identity mismatch."""
    url, sock, seen = _answering(
        [(503, '{"error": "warming up"}'), (503, "{}"), (200, '{"name": "x", "version": "1"}')]
    )
    HttpReward(url, "x", "1", timeout=5, backoff=0.05).check()
    assert len(seen) == 3
    sock.close()
    url, sock, seen = _answering([(400, '{"error": "image 0 is 8x8, but this server scores 16x16 images"}')])
    with pytest.raises(RuntimeError, match="answered 400: image 0 is 8x8, but this server scores 16x16"):
        HttpReward(url, "x", "1", timeout=5, backoff=0.05).check()
    assert len(seen) == 1
    sock.close()
    url, sock, seen = _answering([(200, '{"name": "y", "version": "1"}')])
    with pytest.raises(RuntimeError, match="serves y v1, but the config declares x v1") as refused:
        HttpReward(url, "x", "1", timeout=5, backoff=0.05).check()
    assert len(seen) == 1
    sock.close()
    # and a stage that meets either is not retried by Prefect (permanent errors, tasks.base.transient)
    from types import SimpleNamespace

    from stepgrpo.tasks.base import transient

    failed = SimpleNamespace(result=lambda raise_on_failure=False: refused.value)
    assert transient(None, None, failed) is False
    url, sock, seen = _answering([(503, '{"error": "still warming up"}')])
    with pytest.raises(RuntimeError, match="answered 503: still warming up"):
        HttpReward(url, "x", "1", timeout=5, retries=2, backoff=0.05).check()
    assert len(seen) == 3  # one try and two more
    sock.close()


class Slow:
    """A reward that takes a while per call and records the rows of each call."""

    name, version = "slow", "1"

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, images, prompts, metadata):
        self.calls.append(len(images))
        time.sleep(0.2)
        return RewardOutput(scores=images.float().mean(dim=(1, 2, 3)), sub={"first": images[:, 0, 0, 0].float()})


def _serving(reward, **options):
    server = serve(reward, "127.0.0.1", 0, **options)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, f"http://127.0.0.1:{server.server_port}"


def test_concurrent_requests_are_scored_together_and_each_gets_its_own_rows():
    reward = Slow()
    server, url = _serving(reward, max_batch=8)
    try:
        batches = [torch.rand(2, 3, 8, 8) for _ in range(12)]
        with ThreadPoolExecutor(12) as pool:
            outs = list(pool.map(lambda x: HttpReward(url, "slow", "1", timeout=60)(x, ["a", "b"], [{}, {}]), batches))
        for x, out in zip(batches, outs):
            local = x.mul(255).round().div(255).mean(dim=(1, 2, 3))  # the 8-bit images the server decodes
            assert torch.allclose(out.scores, local, atol=1e-6) and out.sub["first"].shape == (2,)
        assert sum(reward.calls) == 24 and max(reward.calls) <= 8
        assert len(reward.calls) < 12  # requests that waited while the reward was busy went in together
        big = torch.rand(20, 3, 8, 8)  # one request larger than max_batch: scored alone, in chunks
        reward.calls.clear()
        HttpReward(url, "slow", "1", timeout=60, batch=20)(big, ["a"] * 20, [{}] * 20)
        assert reward.calls == [8, 8, 4]
    finally:
        server.shutdown()
        server.server_close()


def test_the_server_checks_token_body_and_resolution_before_decoding(monkeypatch):
    import httpx

    with pytest.raises(ServiceError, match="without a token"):
        serve(Slow(), "0.0.0.0", 0)
    server, url = _serving(build_reward("jpeg_compressibility"), token="s3cret", resolution=16, max_body=20_000)
    version = build_reward("jpeg_compressibility").version
    try:
        monkeypatch.delenv("STEPGRPO_REWARD_TOKEN", raising=False)
        with pytest.raises(RuntimeError, match="answered 401: a missing or wrong token"):
            HttpReward(url, "jpeg_compressibility", version, timeout=30).check()
        monkeypatch.setenv("STEPGRPO_REWARD_TOKEN", "s3cret")
        client = HttpReward(url, "jpeg_compressibility", version, timeout=30)
        assert client(torch.rand(2, 3, 16, 16), ["a", "b"], [{}, {}]).scores.shape == (2,)
        with pytest.raises(RuntimeError, match="answered 400: .*image 0 is 8x8, but this server scores 16x16"):
            client(torch.rand(1, 3, 8, 8), ["a"], [{}])
        with pytest.raises(RuntimeError, match="answered 413: a request body of .* at most 20000"):
            client(torch.rand(64, 3, 16, 16), ["a"] * 64, [{}] * 64)
        # a malformed image is named, with the fix, not answered with the decoder's own words
        headers = {"Authorization": "Bearer s3cret"}
        bad = httpx.post(url + "/score", json={"images": ["abc"], "prompts": ["a"], "metadata": [{}]}, headers=headers)
        assert bad.status_code == 400 and "image 0 is not valid base64" in bad.text and "base64 of its PNG" in bad.text
        not_png = httpx.post(
            url + "/score", json={"images": ["AAAA"], "prompts": ["a"], "metadata": [{}]}, headers=headers
        )
        assert not_png.status_code == 400 and "image 0 is base64 but not a PNG image" in not_png.text
        schema = httpx.get(url + "/openapi.json").json()  # the OpenAPI page needs no token
        assert "/score" in schema["paths"] and "/info" in schema["paths"]
    finally:
        server.shutdown()
        server.server_close()


def test_reward_server_beyond_the_loopback_without_a_token_exits_before_listening(monkeypatch):
    from typer.testing import CliRunner

    from stepgrpo_cli import app

    monkeypatch.delenv("STEPGRPO_REWARD_TOKEN", raising=False)
    result = CliRunner().invoke(app, ["reward-server", "--reward", "jpeg_compressibility", "--host", "0.0.0.0"])
    assert result.exit_code == 1 and "without a token" in result.output and "--token" in result.output


def test_train_checks_the_reward_server_before_anything_starts(jpeg_server, tmp_path, monkeypatch):
    """A declared identity the server does not serve, and a server that is not there, fail the
    command before its Prefect server starts or its run directory is made: one line with the fix,
    no traceback (it is behind --verbose)."""
    from typer.testing import CliRunner

    from stepgrpo_cli import app

    monkeypatch.chdir(tmp_path)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    cases = {
        jpeg_server: ["serves jpeg_compressibility", "set reward.options.name / version"],
        closed: ["cannot be reached", "stepgrpo reward-server"],
    }
    for url, says in cases.items():
        options = f'reward.options={{url: "{url}", name: pickscore, version: "1"}}'
        args = ["train", "--set", "reward.name=http", "--set", options, "--run-id", "x", "--set", "run.runs_root=runs"]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 1, result.output
        assert all(text in result.output for text in says), result.output
        assert "Traceback" not in result.output and "--verbose" in result.output
        assert not (tmp_path / "runs").exists()


def test_a_servers_default_body_limit_fits_its_largest_batch():
    """Not 1 GiB whatever it serves: `--max-batch` images at `--resolution` (1024 px when unset)."""
    from stepgrpo.rewards.remote import MAX_BODY, body_limit

    assert body_limit(4, 16) < 1 << 21 and body_limit(64, None) < MAX_BODY // 3
    server, url = _serving(build_reward("jpeg_compressibility"), max_batch=2, resolution=16)
    version = build_reward("jpeg_compressibility").version
    try:
        client = HttpReward(url, "jpeg_compressibility", version, timeout=30, batch=4096)
        assert client(torch.rand(2, 3, 16, 16), ["a", "b"], [{}, {}]).scores.shape == (2,)
        limit = body_limit(2, 16)
        with pytest.raises(RuntimeError, match=f"answered 413: a request body of .* at most {limit}"):
            client(torch.rand(2048, 3, 16, 16), ["a"] * 2048, [{}] * 2048)  # ~2.5 MB of PNGs in one request
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    "body, says",
    [("[" * 100_000 + "]" * 100_000, "RecursionError"), ('{"n": ' + "9" * 5000 + "}", "ValueError")],
)
def test_an_answer_too_deep_or_too_long_a_number_is_named_with_its_server(body, says):
    """JSON that Python will not parse (nesting past its recursion limit, an integer past its digit
    limit): one error naming the server, not a raw traceback."""
    url, sock, _ = _answering([(200, body)])
    try:
        with pytest.raises(StageError, match=f"{re.escape(url)}.*not a reward's JSON \\({says}"):
            HttpReward(url, "r", "1", retries=0).check()
    finally:
        sock.close()


def test_a_request_s_images_are_held_once_at_a_byte_a_channel():
    """The server decodes a request's PNGs straight into one uint8 tensor, the client's exact pixels
    (the reward gets them as floats a call's rows at a time): 48 incompressible 512 px images, a
    48 MiB body, are held as 36 MiB, not as 144 MiB of float32 beside their decoded copies."""
    import numpy as np

    from stepgrpo.rewards.remote import decode_images, encode_images
    from stepgrpo.runtime.memory import held_bytes

    rng = np.random.default_rng(0)
    pixels = torch.from_numpy(rng.integers(0, 256, (48, 3, 512, 512), dtype=np.uint8))
    encoded = encode_images(pixels.float() / 255.0)
    before = held_bytes()
    decoded = decode_images(encoded, 512)
    assert decoded.dtype == torch.uint8 and torch.equal(decoded, pixels)
    assert held_bytes() - before <= 48 * 3 * 512 * 512 + (1 << 20)
    assert encoded == [None] * 48  # each base64 string let go once its image is decoded


def test_the_server_parses_a_body_once_and_refuses_what_is_not_a_score_request():
    """The body is read into one buffer of its declared length and parsed with each copy let go
    (`service.read_json`); what is not JSON, or not a ScoreRequest, is a 422 naming why, and the
    OpenAPI page still documents the request's schema."""
    from fastapi.testclient import TestClient

    from stepgrpo.rewards.remote import encode_images
    from stepgrpo.rewards.service import build_app

    app = build_app(build_reward("jpeg_compressibility"), max_batch=4)
    json_type = {"content-type": "application/json"}
    with TestClient(app) as client:
        good = {"images": encode_images(torch.rand(2, 3, 8, 8)), "prompts": ["a", "b"]}
        answer = client.post("/score", content=json.dumps(good).encode(), headers=json_type)
        assert answer.status_code == 200 and len(answer.json()["scores"]) == 2
        not_json = client.post("/score", content=b"{images: [", headers=json_type)
        assert not_json.status_code == 422 and "not JSON" in not_json.text
        not_utf8 = client.post("/score", content=b'{"images": ["\xff"]}', headers=json_type)
        assert not_utf8.status_code == 422 and "not UTF-8 JSON" in not_utf8.text
        deep = client.post("/score", content=b"[" * 100_000 + b"]" * 100_000, headers=json_type)
        assert deep.status_code == 422 and "nested too deeply" in deep.text
        not_strings = client.post("/score", content=json.dumps({"images": [1], "prompts": ["a"]}), headers=json_type)
        assert not_strings.status_code == 422 and "images" in not_strings.text
        missing = client.post("/score", content=json.dumps({"images": []}), headers=json_type)
        assert missing.status_code == 422 and "prompts" in missing.text
        schema = client.get("/openapi.json").json()["paths"]["/score"]["post"]["requestBody"]
        assert "images" in json.dumps(schema)
