"""The papers' evaluation protocols (stepgrpo.prompts.protocols) and their evidence bundles
(stepgrpo.storage.bundle): each protocol's prompt file, here a fixture in the same format with its
own hash, yields the documented (prompt, sample) pairs with the seeds rule; GenEval's official
score is the mean of its task accuracies; a missing or mismatched file is refused before any model
loads; a bundle whose bytes change fails its check."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time

import pytest

from stepgrpo.errors import StageError
from stepgrpo.prompts import find_prompt_file, pinned, read_prompt_file
from stepgrpo.prompts.protocols import aggregate, pairs, protocol, sample_seed

GENEVAL = [
    {"tag": "counting", "include": [{"class": "dog", "count": 2}], "prompt": "a photo of two dogs"},
    {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}], "prompt": "a photo of a red car"},
    {"tag": "single_object", "include": [{"class": "cat", "count": 1}], "prompt": "a photo of a cat"},
]
FIXTURES = {  # protocol -> (file name, bytes, pairs the protocol makes of it)
    "geneval": ("evaluation_metadata.jsonl", "\n".join(json.dumps(r) for r in GENEVAL).encode(), 3 * 4),
    "ocr": ("test.txt", b'a sign that says "open"\na cup with "hello" on it\n', 2),
    "pickscore": ("test.txt", b"a castle at dusk\na bowl of fruit\na red fox\n", 3),
    "drawbench": ("test.txt", b"".join([b"a blue cube\n", b"a green apple\n"] * 5), 2 * 5),  # 2 prompts x 5 rows
}


@pytest.fixture
def pinned_fixtures(tmp_path, monkeypatch):
    """Each pinned protocol's file replaced by its fixture (its own hash), cached under tmp_path."""
    monkeypatch.setenv("STEPGRPO_CACHE", str(tmp_path / "cache"))
    for name, (file, data, _) in FIXTURES.items():
        key = protocol(name).prompts.removeprefix(pinned.PREFIX)
        entry = dataclasses.replace(
            pinned.PINNED[key],
            path=f"dataset/{file}",
            sha256=hashlib.sha256(data).hexdigest(),
            prompts=data.count(b"\n"),
        )
        monkeypatch.setitem(pinned.PINNED, key, entry)
        (tmp_path / file).write_bytes(data)
        pinned.fetch(key, tmp_path / file)
    return tmp_path


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_each_protocol_makes_its_pairs_with_the_seeds_rule(name, pinned_fixtures):
    p = protocol(name)
    texts, metadata = read_prompt_file(find_prompt_file(p.prompts))
    pr = pairs(p, texts, metadata)
    assert len(pr.seeds) == FIXTURES[name][2]
    assert pr.seeds == [sample_seed(pr.texts[i], j) for i, j in zip(pr.prompt_of, pr.sample_of)]
    assert len(set(pr.seeds)) == len(pr.seeds)  # no two pairs share a seed, duplicates rows included
    assert (
        sample_seed("a photo of a cat", 0) == sample_seed("a photo of a cat", 0) != sample_seed("a photo of a cat", 1)
    )
    if name == "geneval":  # 4 samples a prompt, each with its task
        assert pr.samples == [4, 4, 4] and [m["tag"] for m in pr.metadata] == ["counting", "colors", "single_object"]
    if name == "drawbench":  # a prompt repeated 5 times is one prompt with 5 samples
        assert pr.texts == ["a blue cube", "a green apple"] and pr.samples == [5, 5]


def test_the_seeds_rule_is_the_documented_formula():
    digest = hashlib.sha256(b"a red fox\n3").digest()
    assert sample_seed("a red fox", 3) == int.from_bytes(digest[:8], "little") & (2**63 - 1)


def test_genevals_score_is_the_mean_of_its_task_accuracies():
    p = protocol("geneval")
    # 6 images: counting 1 of 4 correct, colors 2 of 2
    tags = ["counting"] * 4 + ["colors"] * 2
    strict = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    scores = [0.9, 0.5, 0.5, 0.0, 1.0, 1.0]
    out = aggregate(p, scores, strict, tags)
    assert out["headline"]["value"] == pytest.approx((0.25 + 1.0) / 2)  # the task mean: 0.625
    assert out["image_mean"] == pytest.approx(3 / 6)  # what the training repositories log: 0.5
    assert out["score_mean"] == pytest.approx(sum(scores) / 6)
    assert out["tasks"] == {"colors": {"accuracy": 1.0, "images": 2}, "counting": {"accuracy": 0.25, "images": 4}}
    balanced = aggregate(p, scores, [1.0, 0.0, 1.0, 0.0, 1.0, 0.0], ["a", "a", "b", "b", "c", "c"])
    assert balanced["headline"]["value"] == balanced["image_mean"]  # equal task sizes: the two agree
    pick = aggregate(protocol("pickscore"), [0.8, 0.9], None, ["", ""])
    assert pick["headline"]["value"] == pytest.approx(0.85 * 26)  # the papers' unit


def test_a_missing_or_mismatched_prompt_file_is_refused_before_a_model_loads(pinned_fixtures, tmp_path, monkeypatch):
    from stepgrpo.flows import api
    from stepgrpo.loops import workspace

    def no_model(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(workspace, "policy", no_model)
    monkeypatch.setenv("STEPGRPO_CACHE", str(tmp_path / "empty"))  # offline, nothing cached
    with pytest.raises(StageError, match="stepgrpo prompts fetch pickscore"):
        api.evaluate_protocol(tmp_path / "no-run", "pickscore")
    monkeypatch.setenv("STEPGRPO_CACHE", str(pinned_fixtures / "cache"))
    copy = pinned.cached_path("pickscore")
    copy.write_bytes(copy.read_bytes() + b"one more line\n")
    with pytest.raises(StageError, match=r"has sha256 [0-9a-f]{64}, the pinned file [0-9a-f]{64}"):
        api.evaluate_protocol(tmp_path / "no-run", "pickscore")


def test_a_bundle_fails_its_check_after_one_byte_changes(tmp_path):
    from stepgrpo.storage.bundle import CHECKSUMS, verify_bundle, write_bundle
    from stepgrpo.storage.errors import CorruptChunkError

    folder = write_bundle(tmp_path / "b", {"report.json": b'{"x": 1}\n', "images/000000.png": b"\x89PNG..."})
    assert verify_bundle(folder) == 2
    assert (folder / CHECKSUMS).read_text().splitlines()[0].endswith("  images/000000.png")  # sha256sum -c reads it
    data = bytearray((folder / "report.json").read_bytes())
    data[2] ^= 1
    (folder / "report.json").write_bytes(bytes(data))
    with pytest.raises(CorruptChunkError, match="report.json does not match its checksum"):
        verify_bundle(folder)
    (folder / "report.json").write_bytes(b'{"x": 1}\n')
    (folder / "extra.txt").write_text("added later")
    with pytest.raises(CorruptChunkError, match="extra.txt is not in CHECKSUMS"):
        verify_bundle(folder)
    with pytest.raises(Exception, match="never replaced"):
        write_bundle(folder, {"a": b""})


@pytest.mark.parametrize(
    "line, says",
    [
        ("0" * 64 + "  /proc/self/pagemap", "a bundle lists relative paths inside it"),
        ("0" * 64 + "  ../other/report.json", "a bundle lists relative paths inside it"),
        ("0" * 64 + "  linked/report.json", "reached through a link"),
    ],
)
def test_a_bundle_reads_nothing_outside_itself(tmp_path, line, says):
    """A checksum list naming a file outside the bundle (an absolute path, `..`, a linked folder) is
    refused before anything is read; so are a linked bundle folder and an oversized list."""
    from stepgrpo.storage.bundle import CHECKSUMS, MAX_LISTING, verify_bundle, write_bundle
    from stepgrpo.storage.errors import CorruptChunkError

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "report.json").write_text("{}")
    folder = write_bundle(tmp_path / "b", {"report.json": b"{}"})
    (folder / "linked").symlink_to(outside, target_is_directory=True)
    (folder / CHECKSUMS).write_text(line + "\n")
    with pytest.raises(CorruptChunkError, match=says):
        verify_bundle(folder)
    link = tmp_path / "link"
    link.symlink_to(write_bundle(tmp_path / "c", {"report.json": b"{}"}), target_is_directory=True)
    with pytest.raises(CorruptChunkError, match="is a link"):
        verify_bundle(link)
    big = write_bundle(tmp_path / "d", {"report.json": b"{}"})
    (big / CHECKSUMS).write_bytes(b"x" * (MAX_LISTING + 1))
    with pytest.raises(CorruptChunkError, match="no bundle's checksum list is that long"):
        verify_bundle(big)


def test_run_eval_protocol_names_a_protocol_and_its_file_is_checked_before_training(tmp_path, monkeypatch):
    from stepgrpo.checks import check_config
    from stepgrpo.config import load_config

    with pytest.raises(StageError, match="no evaluation protocol 'nope'; protocols: .*geneval"):
        check_config(load_config(None, ["run.eval_protocol=nope"]))
    monkeypatch.setenv("STEPGRPO_CACHE", str(tmp_path / "empty"))
    cfg = load_config(None, ["run.eval_protocol=pickscore"])
    with pytest.raises(StageError, match="stepgrpo prompts fetch pickscore"):
        check_config(cfg)
    # its prompt file present, its scorer's weights not to be had (offline): refused now, naming them
    import huggingface_hub

    from stepgrpo import prompts

    monkeypatch.setattr(prompts, "find_prompt_file", lambda source: None)
    monkeypatch.setattr(huggingface_hub, "is_offline_mode", lambda: True)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **k: None, raising=False)
    with pytest.raises(StageError, match="run.eval_protocol pickscore's scorer pickscore"):
        check_config(cfg)


def test_a_bundle_goes_to_wandb_as_an_artifact(tmp_path, monkeypatch):
    """W&B, offline: an evaluation's record with its bundle folder logs the folder as an `evidence`
    artifact of the evaluation's run (MLflow's: tests/test_flows.py)."""
    from test_flows import wandb_records

    from stepgrpo.reporting.wandb_tracker import log_offline_record

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    bundle = tmp_path / "shapes-base"
    bundle.mkdir()
    (bundle / "report.json").write_text("{}")
    (tmp_path / "run").mkdir()
    record = {"kind": "evaluate", "name": "run evaluate shapes-base", "tags": {"stepgrpo.parent_run_id": "run"},
              "params": {}, "rows": [{"iteration": 0, "headline": 0.5}], "metrics": ["headline"],
              "artifacts": [str(bundle)]}  # fmt: skip
    log_offline_record(tmp_path / "run", "p", record)
    (folder,) = (tmp_path / "wandb").glob("offline-run-*")
    deadline = time.monotonic() + 60  # W&B's own process writes the run file: on a busy machine, after finish
    while True:
        records = wandb_records(next(folder.glob("run-*.wandb")))
        artifacts = [r.artifact for r in records if r.HasField("artifact")]
        if artifacts or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert ("evidence-shapes-base", "evidence", ["report.json"]) in [
        (a.name, a.type, [e.path for e in a.manifest.contents]) for a in artifacts
    ]


def test_a_bundle_is_its_run_s_under_its_own_name(tmp_path):
    from stepgrpo.storage.bundle import verify_owner, write_bundle
    from stepgrpo.storage.errors import CorruptChunkError

    report = {"run_id": "r1", "label": "iter_3", "protocol": {"name": "geneval"}}
    ok = write_bundle(tmp_path / "geneval-iter_3", {"report.json": json.dumps(report).encode()})
    verify_owner(ok, "r1")
    with pytest.raises(CorruptChunkError, match="run 'r1''s evidence, not this run's"):
        verify_owner(ok, "r2")
    swapped = write_bundle(tmp_path / "geneval-iter_5", {"report.json": json.dumps(report).encode()})
    with pytest.raises(CorruptChunkError, match="renamed or swapped"):
        verify_owner(swapped, "r1")
    odd = write_bundle(tmp_path / "geneval-base", {"report.json": b"[1, 2]"})
    with pytest.raises(CorruptChunkError, match="no report"):
        verify_owner(odd, "r1")
