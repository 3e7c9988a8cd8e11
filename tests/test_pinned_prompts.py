"""The papers' evaluation prompt files, pinned by source and hash (stepgrpo.prompts.pinned): a
fixture file in the same format with its own hash stands in for each (no network)."""

from __future__ import annotations

import dataclasses
import hashlib
import http.server
import json
import re
import threading
import time
from pathlib import Path

import prefect  # noqa: F401  (Prefect binds its log handlers at import: not inside CliRunner's streams)
import pytest
from typer.testing import CliRunner

from stepgrpo.config import load_config
from stepgrpo.errors import StageError
from stepgrpo.prompts import pinned, prompt_source
from stepgrpo_cli import app

ROWS = [{"tag": "counting", "include": [{"class": "dog", "count": 2}], "prompt": "a photo of two dogs"}] * 4
BYTES = "\n".join(json.dumps(r) for r in ROWS).encode()  # no final newline, as the repositories' files


@pytest.fixture
def fixture_pin(tmp_path, monkeypatch):
    """`pinned:fixture`: a GenEval-format file of 4 rows, its hash pinned; the cache under tmp_path."""
    monkeypatch.setenv("STEPGRPO_CACHE", str(tmp_path / "cache"))
    entry = pinned.PinnedFile("owner/repo", "0" * 40, "dataset/x/test_metadata.jsonl",
                              hashlib.sha256(BYTES).hexdigest(), 4, "a fixture")  # fmt: skip
    monkeypatch.setitem(pinned.PINNED, "fixture", entry)
    good = tmp_path / "copy.jsonl"
    good.write_bytes(BYTES)
    return good


def test_every_pin_names_its_source_and_hash():
    for name, f in pinned.PINNED.items():
        assert re.fullmatch(r"[0-9a-f]{64}", f.sha256) and re.fullmatch(r"[0-9a-f]{40}", f.commit), name
        assert f.url == f"https://raw.githubusercontent.com/{f.repo}/{f.commit}/{f.path}" and f.prompts > 0
    assert {"geneval", "geneval_official", "ocr", "pickscore", "drawbench"} <= set(pinned.PINNED)


def test_a_pinned_source_is_read_only_from_a_verified_copy(fixture_pin, tmp_path):
    cfg = load_config(None, ["run.prompts=pinned:fixture", "run.heldout_prompts=null"])
    with pytest.raises(StageError, match=r"not in the cache .*`stepgrpo prompts fetch fixture`"):
        prompt_source(cfg)
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_bytes(BYTES + b"\n")  # one byte more
    digest = hashlib.sha256(wrong.read_bytes()).hexdigest()
    with pytest.raises(StageError, match=f"sha256 {digest}.*the pinned file"):
        pinned.fetch("fixture", wrong)
    assert not pinned.cached_path("fixture").exists()  # nothing written
    path = pinned.fetch("fixture", fixture_pin)
    texts, splits, metadata = prompt_source(cfg)
    assert texts == ["a photo of two dogs"] * 4 and splits == ["train"] * 4 and metadata == ROWS
    path.write_bytes(BYTES.replace(b"two", b"six"))  # the cache is not trusted over its hash
    with pytest.raises(StageError, match="the cached copy .* has sha256 .* delete it and fetch again"):
        prompt_source(cfg)


def test_a_source_that_never_ends_is_refused_without_reading_it_whole(fixture_pin, monkeypatch):
    """`prompts fetch --from /dev/zero` (or any file past the bound): refused after `MAX_BYTES`, not
    read into memory; nothing written."""
    monkeypatch.setattr(pinned, "MAX_BYTES", 1 << 16)
    with pytest.raises(StageError, match="larger than .* no pinned prompt file is"):
        pinned.fetch("fixture", Path("/dev/zero"))
    assert not pinned.cached_path("fixture").exists()


def test_fetch_downloads_from_the_pinned_commit_and_checks_the_bytes(fixture_pin, monkeypatch):
    served = {"body": BYTES}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.end_headers()
            self.wfile.write(served["body"])

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/file"
        entry = pinned.PINNED["fixture"]
        local = type("Local", (pinned.PinnedFile,), {"url": property(lambda self: url)})
        monkeypatch.setitem(pinned.PINNED, "fixture", local(**dataclasses.asdict(entry)))
        served["body"] = b"tampered"
        with pytest.raises(StageError, match="not the file the papers evaluate on"):
            pinned.fetch("fixture")
        served["body"] = BYTES
        assert pinned.fetch("fixture").read_bytes() == BYTES
    finally:
        server.shutdown()


def test_train_without_the_cached_file_fails_before_a_server_starts(fixture_pin, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.txt").write_text("a cat\na dog\n")
    t0 = time.perf_counter()
    sets = ["run.prompts=train.txt", "run.heldout_prompts=pinned:fixture", "run.runs_root=runs"]
    result = CliRunner().invoke(app, ["train", *[a for s in sets for a in ("--set", s)]])
    assert result.exit_code == 1 and "stepgrpo prompts fetch fixture" in result.output, result.output
    assert not (tmp_path / "runs").exists() and time.perf_counter() - t0 < 60
    fetched = CliRunner().invoke(app, ["prompts", "fetch", "fixture", "--from", str(fixture_pin)])
    assert fetched.exit_code == 0 and "sha256 verified" in fetched.output
    assert "pinned:fixture" in CliRunner().invoke(app, ["prompts", "list"]).output
