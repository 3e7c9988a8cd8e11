"""Prompt files: `.txt` (one prompt a line) and `.jsonl` (GenEval-style metadata per prompt)."""

from __future__ import annotations

import json

import pytest

from stepgrpo.config import load_config
from stepgrpo.errors import StageError
from stepgrpo.prompts import prompt_source

GENEVAL_ROW = {"tag": "counting", "include": [{"class": "dog", "count": 2}], "prompt": "a photo of two dogs"}


def test_txt_and_jsonl_prompt_files(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps(GENEVAL_ROW) + "\n\n" + json.dumps({"prompt": "a red car"}) + "\n")
    test = tmp_path / "test.txt"
    test.write_text("a cat\n  \na bird\n")
    cfg = load_config(None, [f"run.prompts={train}", f"run.heldout_prompts={test}"])
    texts, splits, metadata = prompt_source(cfg)
    assert texts == ["a photo of two dogs", "a red car", "a cat", "a bird"]
    assert splits == ["train", "train", "test", "test"]
    assert metadata == [GENEVAL_ROW, {"prompt": "a red car"}, {}, {}]


@pytest.mark.parametrize("line, must_say", [("not json", "is not a JSON object"), ('{"text": "x"}', "no 'prompt'")])
def test_bad_jsonl_lines_name_the_line(tmp_path, line, must_say):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "fine"}) + "\n" + line + "\n")
    cfg = load_config(None, [f"run.prompts={bad}"])
    with pytest.raises(StageError, match=must_say) as err:
        prompt_source(cfg)
    assert "bad.jsonl:2" in str(err.value)


def test_missing_prompt_file_is_named(tmp_path):
    cfg = load_config(None, [f"run.prompts={tmp_path / 'nope.txt'}"])
    with pytest.raises(StageError, match="nope.txt"):
        prompt_source(cfg)


def test_iteration_plan_fills_every_group_even_from_few_prompts(tmp_path):
    from stepgrpo.loops.sampling import iteration_plan

    few = tmp_path / "few.txt"
    few.write_text("a\nb\nc\n")
    cfg = load_config(None, [f"run.prompts={few}", "run.prompts_per_iteration=5", "run.group_size=2"])
    _, splits, _ = prompt_source(cfg)
    prompt_ids, group_ids, seeds = iteration_plan(cfg, splits, 0)
    assert len(prompt_ids) == len(group_ids) == 10 and len(seeds) == 5
    assert list(group_ids) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert set(prompt_ids[:6]) == {0, 1, 2} and list(prompt_ids[6:]) == list(prompt_ids[:4])  # the permutation repeats
    assert (prompt_ids[::2] == prompt_ids[1::2]).all()  # a group shares its prompt
    again = iteration_plan(cfg, splits, 0)
    assert all((x == y).all() for x, y in zip(again, (prompt_ids, group_ids, seeds)))
    assert not (iteration_plan(cfg, splits, 1)[2] == seeds).all()
