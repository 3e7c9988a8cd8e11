"""The papers' evaluation prompt files, pinned: each named by its source (repository, commit, path)
and the sha256 of its bytes, never shipped as a copy.

A config names one as a prompt source, `run.heldout_prompts: pinned:pickscore`. stepgrpo reads it
from a cache (`$STEPGRPO_CACHE/prompts`, default `~/.cache/stepgrpo/prompts`) only after checking
its hash; `stepgrpo prompts fetch NAME` puts it there once, downloaded from the pinned commit or
copied from a file you already have (`--from FILE`), refused in either case unless its bytes hash
to the pinned value. Offline with no cached copy, a command fails before any server starts, in one
line with the command that fetches it.

The files are the ones the papers in this line evaluate on: Flow-GRPO's test splits (its
repository's `dataset/`; DenseGRPO, TP-GRPO, DiffusionNFT, AWM carry the same git blobs), GenEval's
official 553 prompts, and the DrawBench file of DiffusionNFT's repository.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from stepgrpo.errors import StageError

PREFIX = "pinned:"
MAX_BYTES = 16 << 20  # a pinned prompt file is well under 1 MB; anything past this is not one (nor read whole)


def read_bounded(path: Path, what: str) -> bytes:
    """At most `MAX_BYTES` of `path` (a device or a huge file is refused, not read into memory)."""
    with open(path, "rb") as fh:
        data = fh.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise StageError(f"{what} {path} is larger than {MAX_BYTES >> 20} MiB: no pinned prompt file is")
    return data


@dataclass(frozen=True)
class PinnedFile:
    repo: str  # owner/name on GitHub
    commit: str
    path: str  # inside the repository
    sha256: str  # of the file's bytes
    prompts: int  # non-empty lines: the prompts (rows) it holds
    about: str

    @property
    def url(self) -> str:
        return f"https://raw.githubusercontent.com/{self.repo}/{self.commit}/{self.path}"

    @property
    def source(self) -> str:
        return f"{self.repo}@{self.commit[:7]}:{self.path}"


_FLOW_GRPO = ("yifan123/flow_grpo", "ac4c86e8cae021841f1fde853d340e0db67690dd")
PINNED: dict[str, PinnedFile] = {
    "geneval": PinnedFile(
        *_FLOW_GRPO,
        "dataset/geneval/test_metadata.jsonl",
        "cec4b24b9fee7bac21c8f787054ecc8dc9ff831674037713a4cd35e0f0a74a28",
        2212,
        "GenEval's 553 official prompts x 4, with their metadata (the training repositories' test split)",
    ),
    "geneval_official": PinnedFile(
        "djghosh13/geneval",
        "af4902f24d3ca90ebbb446dd9891a59e0f82725f",
        "prompts/evaluation_metadata.jsonl",
        "5c48e0813e812e3c373fa5c8ed07a8f0a483be30272b4427b0559c8048e67c13",
        553,
        "GenEval's official prompts (4 samples a prompt)",
    ),
    "ocr": PinnedFile(
        *_FLOW_GRPO,
        "dataset/ocr/test.txt",
        "4dd8caf3ab6ade73bd376c7d14c6ca49b6eacfb1bd321e22c40714ae4a98d4dc",
        1018,
        "Flow-GRPO's OCR test prompts (one image each)",
    ),
    "pickscore": PinnedFile(
        *_FLOW_GRPO,
        "dataset/pickscore/test.txt",
        "d75c025fa451866e70f7e36243f7cdd93095523cb51f5f9651f2ce3236d20262",
        2048,
        "Flow-GRPO's PickScore test prompts (an unseeded shuffle of Pick-a-Pic v1: pinned, not regenerable)",
    ),
    "drawbench": PinnedFile(
        "NVlabs/DiffusionNFT",
        "24af5554898d85e93efa492f42b5e9cdf4156e9b",
        "dataset/drawbench/test.txt",
        "9006b98feabb94b28a2bc0c88de42fd4f31a9ec3c2a19e308a02c5385b7172f0",
        1000,
        "DrawBench's 200 prompts x 5 (DiffusionNFT's PickScore / CLIPScore / HPSv2.1 evaluation)",
    ),
}


def cache_dir() -> Path:
    root = os.environ.get("STEPGRPO_CACHE") or Path.home() / ".cache" / "stepgrpo"
    return Path(root) / "prompts"


def pinned(name: str) -> PinnedFile:
    if name not in PINNED:
        raise StageError(f"no pinned prompt file {PREFIX}{name}; pinned: {', '.join(PREFIX + n for n in PINNED)}")
    return PINNED[name]


def cached_path(name: str) -> Path:
    """Where the verified copy of `name` lives (its hash in the folder name, its file name kept)."""
    f = pinned(name)
    return cache_dir() / f"{name}-{f.sha256[:16]}" / Path(f.path).name


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def verified(name: str) -> Path:
    """The cached copy of `name`, its bytes checked against the pinned hash; a clear error (with the
    command that fetches it) when there is none, and a refusal naming both hashes when it differs."""
    f, path = pinned(name), cached_path(name)
    if not path.is_file():
        raise StageError(
            f"{PREFIX}{name} ({f.source}) is not in the cache ({path}): fetch it once with "
            f"`stepgrpo prompts fetch {name}` (or `--from FILE` with a copy you have)"
        )
    digest = sha256_of(read_bounded(path, f"{PREFIX}{name}: the cached copy"))
    if digest != f.sha256:
        raise StageError(
            f"{PREFIX}{name}: the cached copy {path} has sha256 {digest}, the pinned file {f.sha256}: "
            f"delete it and fetch again (`stepgrpo prompts fetch {name}`)"
        )
    return path


def fetch(name: str, source: Path | None = None, timeout: float = 60.0) -> Path:
    """Put the pinned file `name` into the cache: the bytes of `source`, or downloaded from its pinned
    commit; refused unless they hash to the pinned value (nothing is written then). Returns its path."""
    f = pinned(name)
    if source is not None:
        data, origin = read_bounded(Path(source), f"{PREFIX}{name}: --from"), str(source)
    else:
        import httpx

        try:
            with httpx.stream("GET", f.url, timeout=timeout, follow_redirects=True) as response:
                response.raise_for_status()
                chunks, size = [], 0
                for chunk in response.iter_bytes():
                    chunks.append(chunk)
                    size += len(chunk)
                    if size > MAX_BYTES:
                        raise StageError(f"{PREFIX}{name}: {f.url} is larger than {MAX_BYTES >> 20} MiB: not the file")
        except httpx.HTTPError as err:
            raise StageError(f"{PREFIX}{name}: could not download {f.url} ({type(err).__name__}: {err})") from None
        data, origin = b"".join(chunks), f.url
    digest = sha256_of(data)
    if digest != f.sha256:
        raise StageError(
            f"{PREFIX}{name}: {origin} has sha256 {digest}, the pinned file ({f.source}) {f.sha256}: "
            "not the file the papers evaluate on"
        )
    path = cached_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".fetch-")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
