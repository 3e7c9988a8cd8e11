"""Prompts: the sources a config names, the files they come in, and a run's stored prompt table.

A source is `shapes` (the shipped model's task, split into train and held-out prompts) or a file
per split (`run.prompts`, `run.heldout_prompts`; `pinned:NAME` names a papers' evaluation file, checked
by its hash: `stepgrpo.prompts.pinned`): `.txt` (one prompt a line) or `.jsonl`
(GenEval / Flow-GRPO's `metadata.jsonl`: one object a line with a `prompt` field; the whole
object is the prompt's metadata, which structured rewards such as `geneval` read).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from stepgrpo.config import Config
from stepgrpo.errors import StageError
from stepgrpo.paths import SHIPPED_ROOT
from stepgrpo.prompts.sets import PROMPT_SETS

if TYPE_CHECKING:
    from stepgrpo.storage.run import Run


class Prompts(NamedTuple):
    """Every prompt of a run, by prompt id: text, split ("train" / "test") and metadata."""

    texts: list[str]
    splits: list[str]
    metadata: list[dict[str, Any]]

    def ids(self, split: str) -> list[int]:
        return [i for i, s in enumerate(self.splits) if s == split]

    def texts_of(self, ids: Any) -> list[str]:
        return [self.texts[int(p)] for p in ids]

    def metadata_of(self, ids: Any) -> list[dict[str, Any]]:
        return [self.metadata[int(p)] for p in ids]


def prompt_source(cfg: Config) -> Prompts:
    """All prompts of the config's source."""
    if cfg.run.prompts == "shapes":
        from stepgrpo.shapes.data import prompt_of, split

        train, test = split(held_out=False), split(held_out=True)
        specs = train + test
        return Prompts([prompt_of(s) for s in specs], ["train"] * len(train) + ["test"] * len(test), specs)
    if cfg.run.prompts in PROMPT_SETS:
        if cfg.run.heldout_prompts is not None:
            raise StageError(
                f"run.prompts {cfg.run.prompts!r} holds its own held-out prompts; set run.heldout_prompts: null"
            )
        rows, splits = PROMPT_SETS[cfg.run.prompts]()
        return Prompts([r["prompt"] for r in rows], splits, rows)
    texts, splits, metadata = [], [], []
    for path, name in ((cfg.run.prompts, "train"), (cfg.run.heldout_prompts, "test")):
        if path is None:
            continue
        file_texts, file_meta = (
            read_hub_prompts(path) if path.startswith(HUB_PREFIX) else read_prompt_file(find_prompt_file(path))
        )
        texts += file_texts
        metadata += file_meta
        splits += [name] * len(file_texts)
    return Prompts(texts, splits, metadata)


_FLOW_GRPO = (
    "it is Flow-GRPO's prompt set: `git clone https://github.com/yifan123/flow_grpo` and copy its "
    "dataset/{0}/ here as data/{0}/ (docs/GPU.md)"
)
# The prompt files the paper recipes name (configs/*_pickscore.yaml, densegrpo_geneval.yaml): where to get them.
RECIPE_DATA = {
    "data/pickscore": _FLOW_GRPO.format("pickscore"),
    "data/geneval": _FLOW_GRPO.format("geneval") + ", or use the shipped GenEval-style set: "
    "--set run.prompts=geneval --set run.heldout_prompts=null",
    "data/ocr": _FLOW_GRPO.format("ocr")
    + ", or use the shipped set: --set run.prompts=ocr --set run.heldout_prompts=null",
}


HUB_PREFIX = "hf:"
HUB_COLUMNS = ("prompt", "caption", "text")  # the prompt column when the spec names none


def read_hub_prompts(spec: str) -> tuple[list[str], list[dict[str, Any]]]:
    """Prompts of a Hugging Face hub dataset, `hf:<dataset id>[@<split>][:<column>]` (split
    `train` by default; column the first of `HUB_COLUMNS` it has): the column as text, the whole
    row as metadata. Loaded with `datasets` (`pip install -e .[datasets]`), through its cache;
    the run then stores the prompt table, so it resumes without the hub."""
    body = spec.removeprefix(HUB_PREFIX)
    ref, _, column = body.partition(":")
    name, _, split = ref.partition("@")
    if not name:
        raise StageError(f"prompt source {spec!r}: expected hf:<dataset id>[@<split>][:<column>]")
    try:
        import datasets  # pyright: ignore[reportMissingImports]  (the optional [datasets] extra)
    except ImportError:
        raise StageError(
            f"prompt source {spec!r} needs the `datasets` package: pip install 'stepgrpo[datasets]' (in a checkout: "
            "pip install -e '.[datasets]')"
        ) from None
    try:
        data = datasets.load_dataset(name, split=split or "train")
    except Exception as err:  # offline, gated, unknown id or split: the library's own message
        raise StageError(
            f"prompt source {spec!r}: the dataset could not be loaded ({type(err).__name__}: {err})"
        ) from None
    columns = list(getattr(data, "column_names", None) or (data[0].keys() if len(data) else []))
    column = column or next((c for c in HUB_COLUMNS if c in columns), "")
    if column not in columns:
        raise StageError(f"prompt source {spec!r}: no column {column or '/'.join(HUB_COLUMNS)!r}; it has {columns}")
    rows = [dict(r) for r in data]
    texts = [str(r[column]) for r in rows]
    meta = [{k: v for k, v in r.items() if isinstance(v, str | int | float | bool | list | dict)} for r in rows]
    return texts, meta


def find_prompt_file(path: str) -> Path:
    """A prompt file relative to the working directory, else to the repository; `pinned:NAME`, a
    papers' file from the verified cache (`stepgrpo.prompts.pinned`)."""
    from stepgrpo.prompts import pinned

    if path.startswith(pinned.PREFIX):
        return pinned.verified(path.removeprefix(pinned.PREFIX))
    p = Path(path)
    if not p.exists() and (SHIPPED_ROOT / path).exists():
        p = SHIPPED_ROOT / path
    if not p.is_file():
        hint = RECIPE_DATA.get(Path(path).parent.as_posix(), "")
        raise StageError(
            f"prompt file {path!r} does not exist (.txt: one prompt a line; "
            ".jsonl: one JSON object a line with a 'prompt' field)" + (f"; {hint}" if hint else "")
        )
    return p


# Longer than any text encoder reads (CLIP 77 tokens, T5 at most 512, ~4 characters a token): a
# prompt beyond it is a pasted file, not a prompt (a 1 MB one tokenises for minutes, then fails).
MAX_PROMPT_CHARS = 4096


def read_prompt_file(path: Path) -> tuple[list[str], list[dict[str, Any]]]:
    """Prompts and metadata of a `.txt` or `.jsonl` file (module doc)."""
    try:
        lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except UnicodeDecodeError as err:
        raise StageError(f"{path} is not UTF-8 text (byte {err.start}: {err.reason}); save it as UTF-8") from None
    if path.suffix != ".jsonl":
        for number, line in enumerate(lines, 1):
            _check_length(line, path, number)
        return lines, [{} for _ in lines]
    texts, metadata = [], []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise StageError(
                f"{path}:{number} is not a JSON object ({err.msg}); a .jsonl prompt file holds one object a line"
            ) from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise StageError(
                f"{path}:{number} has no 'prompt' string field; each line must look like "
                '{"prompt": "a photo of two dogs", "tag": "counting", "include": [...]}'
            )
        try:  # a lone surrogate (`"\\ud800"`) parses, but no UTF-8 table can store it
            json.dumps(row, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as err:
            raise StageError(
                f"{path}:{number} holds a character that is not valid Unicode ({err.reason}, e.g. a lone surrogate "
                "escape like \\ud800); fix that line"
            ) from None
        _check_length(row["prompt"], path, number)
        texts.append(row["prompt"])
        metadata.append(row)
    return texts, metadata


def _check_length(prompt: str, path: Path, number: int) -> None:
    if len(prompt) > MAX_PROMPT_CHARS:
        raise StageError(
            f"{path}:{number} is a prompt of {len(prompt)} characters, more than any text encoder reads "
            f"({MAX_PROMPT_CHARS} at most); one prompt a line"
        )


def stored_prompts(run: Run) -> Prompts:
    """The prompt table a run stored (its prompts stage), by prompt id."""
    table = run.tables.read_prompts().sort_by("prompt_id")
    meta = [json.loads(m) for m in table.column("metadata").to_pylist()]
    return Prompts(table.column("text").to_pylist(), table.column("split").to_pylist(), meta)
