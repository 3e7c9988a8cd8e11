"""The prompt sets shipped as code (`run.prompts: geneval`, `ocr`): GenEval's metadata, quoted OCR
targets, disjoint splits, and the same prompts on every call."""

from __future__ import annotations

import pytest

from stepgrpo.config import load_config
from stepgrpo.errors import StageError
from stepgrpo.prompts import prompt_source
from stepgrpo.prompts.sets import COCO_CLASSES, TASKS, geneval_prompts, ocr_prompts
from stepgrpo.rewards.geneval import validate_spec
from stepgrpo.rewards.ocr import quoted_text


def test_geneval_prompts_carry_valid_metadata_over_the_coco_classes():
    rows, splits = geneval_prompts()
    assert len(COCO_CLASSES) == 80 and len({r["prompt"] for r in rows}) == len(rows)
    assert {r["tag"] for r in rows} == set(TASKS)
    for r in rows:
        validate_spec(r, COCO_CLASSES)
    counting = next(r for r in rows if r["tag"] == "counting")
    assert counting["exclude"][0]["count"] == counting["include"][0]["count"] + 1
    position = next(r for r in rows if r["tag"] == "position")
    rel = position["include"][1]["position"][0]
    assert position["prompt"] == (
        f"a photo of a{'n' if position['include'][1]['class'][0] in 'aeiou' else ''} "
        f"{position['include'][1]['class']} {rel} "
        f"a{'n' if position['include'][0]['class'][0] in 'aeiou' else ''} {position['include'][0]['class']}"
    )
    assert geneval_prompts() == (rows, splits)  # the same prompts every time
    assert splits.count("test") == 600


def test_ocr_prompts_quote_their_text_and_hold_out_unseen_texts():
    rows, splits = ocr_prompts()
    assert all(quoted_text(r["prompt"]) == r["text"] for r in rows)
    train = {r["text"] for r, s in zip(rows, splits) if s == "train"}
    test = {r["text"] for r, s in zip(rows, splits) if s == "test"}
    assert test and train and not train & test


def test_a_config_names_a_set_and_gets_its_splits():
    cfg = load_config(None, ["run.prompts=geneval"])
    prompts = prompt_source(cfg)
    assert len(prompts.ids("train")) == 5400 and len(prompts.ids("test")) == 600
    assert prompts.metadata[0]["prompt"] == prompts.texts[0]
    with pytest.raises(StageError, match="heldout_prompts: null"):
        prompt_source(load_config(None, ["run.prompts=ocr", "run.heldout_prompts=x.txt"]))


def test_a_missing_paper_prompt_file_says_where_to_get_it():
    cfg = load_config(None, ["run.prompts=data/pickscore/train.txt"])
    with pytest.raises(StageError, match=r"flow_grpo.*dataset/pickscore"):
        prompt_source(cfg)


def test_a_hub_dataset_by_name_gives_its_column_and_rows(monkeypatch):
    import sys
    import types

    loaded = []

    def load_dataset(name, split):
        loaded.append((name, split))
        rows = {"train": [{"caption": "a cat", "id": 1}, {"caption": "a dog", "id": 2}], "test": [{"caption": "a cow"}]}
        return rows[split]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    cfg = load_config(None, ["run.prompts=hf:org/prompts", "run.heldout_prompts=hf:org/prompts@test:caption"])
    prompts = prompt_source(cfg)
    assert loaded == [("org/prompts", "train"), ("org/prompts", "test")]
    assert prompts.texts == ["a cat", "a dog", "a cow"] and prompts.splits == ["train", "train", "test"]
    assert prompts.metadata[1] == {"caption": "a dog", "id": 2}
    with pytest.raises(StageError, match="no column 'prompt'"):
        prompt_source(load_config(None, ["run.prompts=hf:org/prompts:prompt"]))
