"""Storage: bit-exact round trips of every array and table, digests, publish rules, run isolation."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import zarr

from stepgrpo.storage import (
    AlreadyPublishedError,
    IncompleteStageError,
    NotPublishedError,
    Run,
    SchemaVersionError,
    options_digest,
)
from stepgrpo.storage.arrays import bf16_values
from stepgrpo.storage.publish import seal
from stepgrpo.storage.schema import COMPLETION, ROLLOUT

B, T, C, H, W = 4, 3, 2, 4, 4


def rollout_inputs(seed: int = 0, dtype: torch.dtype = torch.float16) -> dict:
    """A small rollout: states [B,T+1,C,H,W], log_probs/stds [B,T] (NaN outside a window), the plan."""
    g = torch.Generator().manual_seed(seed)
    log_probs = torch.randn(B, T, generator=g)
    log_probs[:, 0] = float("nan")  # step 0 outside the SDE window
    return {
        "states": torch.randn(B, T + 1, C, H, W, generator=g).to(dtype),
        "log_probs": log_probs,
        "stds": torch.rand(B, T, generator=g),
        "ode_final": torch.randn(B, C, H, W, generator=g).to(dtype),
        "velocities": torch.randn(B, T, C, H, W, generator=g).to(dtype),
        "sigmas": torch.linspace(1, 0, T + 1),
        "seeds": torch.arange(B) + 1000,
        "prompt_ids": torch.tensor([7, 7, 3, 3]),
        "group_ids": torch.tensor([0, 0, 1, 1]),
    }


def write_rollout(run: Run, iteration: int, x: dict, dtype: str = "float16", order=(0, 2)) -> dict:
    with run.stages.begin_rollout(
        iteration,
        sigmas=x["sigmas"],
        seeds=x["seeds"],
        prompt_ids=x["prompt_ids"],
        group_ids=x["group_ids"],
        latent_shape=(C, H, W),
        latent_dtype=dtype,
        kernel="sde",
        kernel_params={"eta": 0.7, "window": [1, 3]},
    ) as w:
        for start in order:  # two slices of two trajectories, in the given order
            sl = slice(start, start + 2)
            w.write(
                start,
                states=x["states"][sl],
                log_probs=x["log_probs"][sl],
                stds=x["stds"][sl],
                ode_final=x["ode_final"][sl],
                velocities=x["velocities"][sl],
            )
        return w.publish(inputs={"seed": 0})


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("dtype,stored", [("float16", np.float16), ("float32", np.float32), ("bfloat16", np.float32)])
def test_rollout_round_trip_is_bit_exact(tmp_path, dtype, stored):
    run = Run.create(tmp_path, "r", {"seed": 0})
    x = rollout_inputs(dtype=getattr(torch, dtype))
    manifest = write_rollout(run, 0, x, dtype)
    data = run.stages.read_rollout(0)
    # bf16 is stored as its 16 bits and read as float32: exact, every bf16 value is a float32 value
    assert same_bits(data.states, x["states"].float().numpy().astype(stored))
    assert same_bits(data.velocities, x["velocities"].float().numpy().astype(stored))
    chunk = run.stage_path(0, "rollout") / "states" / "c.0.0.0.0.0"
    assert chunk.stat().st_size == x["states"][0].numel() * x["states"].element_size() + 4  # 2 bytes a bf16 value
    assert same_bits(data.log_probs, x["log_probs"].numpy())  # NaN bits included
    assert same_bits(data.stds, x["stds"].numpy())
    assert same_bits(data.sigmas, x["sigmas"].numpy())
    for name in ("seeds", "prompt_ids", "group_ids"):
        assert same_bits(getattr(data, name), x[name].numpy())
    assert (data.kernel, data.kernel_params) == ("sde", {"eta": 0.7, "window": [1, 3]})
    assert manifest == run.stage_manifest(0, "rollout") == data.manifest
    assert manifest["counts"] == {"trajectories": B, "steps": T, "states": T + 1, "bytes": manifest["counts"]["bytes"]}
    assert manifest["attrs"]["source_dtype"] == dtype
    # selecting trajectories selects the per-trajectory rows and the plan rows alike
    part = run.stages.read_rollout(0, [3, 1])
    assert same_bits(part.states, data.states[[3, 1]]) and list(part.seeds) == [1003, 1001]
    # the store is plain Zarr v3 with the schema's layout and checksum codec
    group = zarr.open_group(str(run.stage_path(0, "rollout")), mode="r")
    for spec in ROLLOUT.arrays:
        if spec.name in ("state_rows", "velocity_rows"):  # only a rollout stored by node has them
            assert spec.name not in group
            continue
        arr = group[spec.name]
        plain = arr[...]
        if dtype == "bfloat16" and spec.dtype == "latent":  # a plain Zarr reader sees the bits
            assert plain.dtype == np.uint16 and group.attrs["latent_dtype"] == "bfloat16"
            plain = bf16_values(plain)
        assert same_bits(plain, run.stages.read_array(0, "rollout", spec.name))
        assert arr.metadata.dimension_names == spec.axes
        assert "crc32c" in json.dumps(arr.metadata.to_dict()["codecs"])
        assert arr.chunks[0] == (1 if spec.per_trajectory else arr.shape[0])


def test_a_bf16_store_refuses_values_that_are_not_bf16(tmp_path):
    run = Run.create(tmp_path, "r", {"seed": 0})
    x = rollout_inputs(dtype=torch.float32)  # float32 noise: not bf16 values
    with pytest.raises(ValueError, match="not bfloat16"):
        write_rollout(run, 0, x, "bfloat16")
    exact = {
        **x,
        "states": x["states"].to(torch.bfloat16).float(),
        "ode_final": x["ode_final"].to(torch.bfloat16),
        "velocities": x["velocities"].to(torch.bfloat16),
    }
    write_rollout(run, 1, exact, "bfloat16")  # float32 holding bf16 values is stored exactly
    assert same_bits(run.stages.read_rollout(1).states, exact["states"].numpy())


def test_completion_round_trip(tmp_path):
    run = Run.create(tmp_path, "r", {})
    x = rollout_inputs()
    write_rollout(run, 0, x)
    latents = torch.randn(B, T + 1, C, H, W).half()
    with run.stages.begin_completion(0, "heun") as w:
        w.write(0, latents=latents)
        manifest = w.publish(attrs={"nfe": 24})
    data = run.stages.read_completion(0, "heun")
    assert same_bits(data.latents, latents.numpy())
    assert (data.method, data.nfe) == ("heun", 24)
    assert manifest["attrs"]["rollout_digest"] == run.stage_manifest(0, "rollout")["digest"]
    assert run.stage_path(0, "completions/heun").name == "heun.zarr"
    assert [a.name for a in COMPLETION.arrays] == ["latents"]


def test_images_round_trip_and_follow_their_source(tmp_path):
    run = Run.create(tmp_path, "r", {"seed": 0})
    write_rollout(run, 0, rollout_inputs())
    with pytest.raises(NotPublishedError, match="publish completions/heun"):
        run.stages.begin_images(0, "completions/heun", k=np.arange(T + 1), image_shape=(3, 8, 8))
    assert run.stages.read_images(0, "rollout") is None
    final = np.random.default_rng(0).integers(0, 256, (B, 1, 3, 8, 8), dtype=np.uint8)
    with run.stages.begin_images(0, "rollout", k=[T], image_shape=(3, 8, 8)) as w:
        w.write(0, images=final)
        manifest = w.publish()
    got = run.stages.read_images(0, "rollout")
    assert same_bits(got.images, final) and list(got.k) == [T] and got.source == "rollout"
    assert manifest["counts"]["trajectories"] == B and manifest["counts"]["states"] == 1
    assert run.stage_path(0, "images/final").name == "final.zarr"
    assert same_bits(run.stages.read_images(0, "rollout", [2]).images, final[[2]])
    group = zarr.open_group(str(run.stage_path(0, "images/final")), mode="r")  # plain Zarr v3
    assert same_bits(group["images"][...], final)
    with pytest.raises(AlreadyPublishedError):
        run.stages.begin_images(0, "rollout", k=[T], image_shape=(3, 8, 8))
    # images of a completion; when the completion is replaced by other content they are ignored
    lat = torch.randn(B, T + 1, C, H, W).half()
    for attempt in range(2):
        if attempt:
            import shutil

            shutil.rmtree(run.stage_path(0, "completions/heun"))
            lat = lat + 1
        with run.stages.begin_completion(0, "heun") as w:
            w.write(0, latents=lat)
            w.publish(attrs={"nfe": 1})
        if not attempt:
            with run.stages.begin_images(0, "completions/heun", k=np.arange(T + 1), image_shape=(3, 8, 8)) as w:
                w.write(0, images=np.zeros((B, T + 1, 3, 8, 8), np.uint8))
                w.publish()
            assert run.stages.read_images(0, "completions/heun").images.shape == (B, T + 1, 3, 8, 8)
    assert run.stages.read_images(0, "completions/heun") is None
    with pytest.raises(ValueError, match="images are decoded from"):
        run.stages.images_stage("checkpoint")


def test_digest_is_deterministic_and_content_sensitive(tmp_path):
    runs = [Run.create(tmp_path, f"r{i}", {}) for i in range(3)]
    x = rollout_inputs()
    d0 = write_rollout(runs[0], 0, x, order=(0, 2))["digest"]
    d1 = write_rollout(runs[1], 0, x, order=(2, 0))["digest"]  # other write order, same content
    x["states"][1, 2, 0, 0, 0] += 1
    d2 = write_rollout(runs[2], 0, x)["digest"]
    assert d0 == d1 != d2


def test_digest_formats_threads_and_runs_published_before_format_2(tmp_path, monkeypatch):
    """Format 2 (each chunk's sha256, hashed by the reading threads) gives the same digest hashed in
    one thread; a stage published before it (format 1, none recorded) still verifies as one; a
    digest under the wrong format, or a format this version does not know, fails verification."""
    import stepgrpo.storage.arrays as arrays
    from stepgrpo.storage import CorruptChunkError
    from stepgrpo.storage.arrays import StageStore
    from stepgrpo.storage.schema import DIGEST_FORMAT

    run = Run.create(tmp_path, "r", {})
    x = rollout_inputs()
    big = torch.randn(B, T + 1, 4, 64, 64, generator=torch.Generator().manual_seed(1))  # 256 KiB chunks: threads
    with run.stages.begin_rollout(
        0,
        sigmas=x["sigmas"],
        seeds=x["seeds"],
        prompt_ids=x["prompt_ids"],
        group_ids=x["group_ids"],
        latent_shape=(4, 64, 64),
        latent_dtype="float32",
        kernel="sde",
        kernel_params={"eta": 0.7, "window": [1, 3]},
    ) as w:
        w.write(0, states=big, log_probs=x["log_probs"], stds=x["stds"], ode_final=big[:, -1])
        manifest = w.publish()
    assert manifest["digest_format"] == DIGEST_FORMAT == 2
    store = StageStore.open(run.stage_path(0, "rollout"), ROLLOUT)
    assert store.verify_and_digest(2)[0] == manifest["digest"]
    monkeypatch.setattr(arrays, "THREAD_MIN_BYTES", 1 << 40)  # every chunk in the calling thread
    assert store.verify_and_digest(2)[0] == manifest["digest"] != store.verify_and_digest(1)[0]
    monkeypatch.undo()

    published = run.stage_path(0, "rollout") / "_published.json"

    def republish(**changes):
        body = {k: v for k, v in manifest.items() if k not in ("digest_format", "seal")} | changes
        published.write_text(json.dumps(seal({k: v for k, v in body.items() if v is not None})))

    republish(digest=store.verify_and_digest(1)[0])  # as a version before format 2 published it
    run.verify(0, "rollout")
    assert same_bits(run.stages.read_rollout(0).states, big.numpy())
    republish(digest=manifest["digest"])  # a format 2 digest under no (so format 1) format
    with pytest.raises(CorruptChunkError, match="no longer matches"):
        run.verify(0, "rollout")
    republish(digest=manifest["digest"], digest_format=7)
    with pytest.raises(CorruptChunkError, match="digest format 7"):
        run.verify(0, "rollout")


def test_a_run_made_before_digest_format_2_keeps_format_1(tmp_path):
    """A stage an older run computes again is digested as its first one was, so the stages keyed
    on that digest stay valid; a run naming a format this version does not know is refused."""
    run = Run.create(tmp_path, "old", {})
    path = run.path / "manifest.json"
    manifest = {k: v for k, v in json.loads(path.read_text()).items() if k not in ("digest_format", "seal")}
    path.write_text(json.dumps(seal(manifest)))  # as a version before format 2 made it
    old = Run.open(run.path)
    assert old.digest_format == 1
    published = write_rollout(old, 0, rollout_inputs())
    assert published["digest_format"] == 1
    old.verify(0, "rollout")
    for unknown in (7, True, "2"):
        path.write_text(json.dumps(seal({**manifest, "digest_format": unknown})))
        with pytest.raises(SchemaVersionError, match=f"format {unknown!r}"):
            Run.open(run.path)


def test_publish_rules(tmp_path):
    run = Run.create(tmp_path, "r", {})
    x = rollout_inputs()
    with pytest.raises(NotPublishedError, match="publish the rollout"):
        run.stages.begin_completion(0, "heun")
    with run.stages.begin_rollout(
        0,
        sigmas=x["sigmas"],
        seeds=x["seeds"],
        prompt_ids=x["prompt_ids"],
        group_ids=x["group_ids"],
        latent_shape=(C, H, W),
        latent_dtype="float16",
        kernel="sde",
        kernel_params={},
    ) as w:
        w.write(
            0, states=x["states"][:3], log_probs=x["log_probs"][:3], stds=x["stds"][:3], ode_final=x["ode_final"][:3]
        )
        with pytest.raises(IncompleteStageError, match=r"states: \[3\]"):
            w.publish()
        with pytest.raises(ValueError, match="expected shape"):
            w.write(3, states=x["states"][3:, :2])
        w.write(
            3, states=x["states"][3:], log_probs=x["log_probs"][3:], stds=x["stds"][3:], ode_final=x["ode_final"][3:]
        )
        w.publish()
    assert run.stage_manifest(0, "rollout") is not None
    with pytest.raises(AlreadyPublishedError):
        write_rollout(run, 0, x)
    with pytest.raises(NotPublishedError):
        run.stages.read_rollout(1)
    assert run.stage_manifest(1, "rollout") is None
    assert run.iterations() == [0]


def test_a_rollout_made_without_its_ode_reference(tmp_path):
    """`sampler.ode_reference: false`: the stage is made without `ode_final` (an optional array),
    publishes without it and reads it as absent; a required array cannot be left out."""
    run = Run.create(tmp_path, "r", {})
    x = rollout_inputs()
    plan = {k: x[k] for k in ("sigmas", "seeds", "prompt_ids", "group_ids")}
    common = {**plan, "latent_shape": (C, H, W), "latent_dtype": "float16", "kernel": "sde", "kernel_params": {}}
    with pytest.raises(ValueError, match=r"\['states'\] are not optional"):
        run.stages.begin_rollout(0, **common, omit=("states",))
    with run.stages.begin_rollout(0, **common, omit=("ode_final",)) as w:
        with pytest.raises(ValueError, match="made without it"):
            w.write(0, ode_final=x["ode_final"])
        w.write(0, **{k: x[k] for k in ("states", "log_probs", "stds", "velocities")})
        w.publish()
    assert not run.stages.has_array(0, "rollout", "ode_final") and run.stages.has_array(0, "rollout", "states")
    got = run.stages.read_rollout(0)
    assert got.ode_final is None and same_bits(got.states, x["states"].numpy())
    run.verify(0, "rollout")  # the published stage is whole without it


def test_a_branched_rollout_stores_each_state_once_and_reads_whole(tmp_path):
    """Stored by node (`by_node`): a state that is the same bytes as one before it in the same write
    points to that chunk; every trajectory reads whole and bit-exact; the digest covers what is
    stored; a missing owned chunk or a `state_rows` entry pointing forward is refused."""
    from stepgrpo.storage.arrays import StageStore
    from stepgrpo.storage.errors import CorruptChunkError

    run = Run.create(tmp_path, "r", {})
    x = rollout_inputs()
    s = x["states"]
    s[1, :2] = s[0, :2]  # trajectory 1 shares x_0, x_1 with 0 (a branch at step 1)
    s[2, 0] = s[0, 0]  # equal to 0's, but written in another call: stored again
    s[3, :1] = s[2, :1]  # 3 shares x_0 with 2 (the second write call)
    v = x["velocities"]
    v[1, :1] = v[0, :1]  # and the velocity at x_0
    plan = {k: x[k] for k in ("sigmas", "seeds", "prompt_ids", "group_ids")}
    common = {**plan, "latent_shape": (C, H, W), "latent_dtype": "float16", "kernel": "sde", "kernel_params": {}}

    def write(i: int, order=(0, 2)) -> dict:
        with run.stages.begin_rollout(i, **common, by_node=True) as w:
            for start in order:
                sl = slice(start, start + 2)
                w.write(start, **{k: x[k][sl] for k in ("states", "log_probs", "stds", "ode_final", "velocities")})
            return w.publish()

    manifest = write(0)
    got = run.stages.read_rollout(0)
    assert same_bits(got.states, s.numpy()) and same_bits(run.stages.read_rollout(0, [3, 1]).states, s.numpy()[[3, 1]])
    rows = run.stages.read_array(0, "rollout", "state_rows")
    assert rows.tolist() == [[0] * 4, [0, 0, 1, 1], [2] * 4, [2, 3, 3, 3]]
    path = run.stage_path(0, "rollout")
    assert len(list((path / "states").glob("c.*"))) == 4 * (T + 1) - 3  # 3 states stored once for two
    assert run.stages.read_array(0, "rollout", "velocity_rows")[1].tolist() == [0, 1, 1]
    assert len(list((path / "velocities").glob("c.*"))) == 4 * T - 1 and same_bits(got.velocities, v.numpy())
    assert manifest["counts"]["bytes"] < write_rollout(Run.create(tmp_path / "plain", "p", {}), 0, x)["counts"]["bytes"]
    assert write(1, order=(2, 0))["digest"] == manifest["digest"]  # the same content, the same digest
    run.verify(0, "rollout")
    with pytest.raises(ValueError, match="written with their arrays"):
        with run.stages.begin_rollout(2, **common, by_node=True) as w:
            w.write(0, states=s[:2], state_rows=rows[:2])
    # damage: a pointer forward, then an owned chunk gone
    store = StageStore.open(path, ROLLOUT)
    forward = rows[1:2].copy()
    forward[0, 3] = 3
    store._write_chunk(ROLLOUT.array("state_rows"), (1, 0), forward)
    with pytest.raises(CorruptChunkError, match="at or before its own"):
        run.stages.read_rollout(0)
    store._write_chunk(ROLLOUT.array("state_rows"), (1, 0), rows[1:2].copy())
    (path / "states" / "c.0.1.0.0.0").unlink()
    with pytest.raises(CorruptChunkError, match="missing"):
        run.stages.read_rollout(0, [1])


def test_runs_with_different_ids_are_isolated(tmp_path):
    a, b = Run.create(tmp_path, "a", {"x": 1}), Run.create(tmp_path, "b", {"x": 2})
    x = rollout_inputs()
    # the same stage of two runs can be open at once: different locks, different directories
    wa = a.checkpoints.begin_checkpoint(0)
    wb = b.checkpoints.begin_checkpoint(0)
    (wa.path / "state.json").write_text("{}")
    (wb.path / "state.json").write_text("{}")
    wa.publish(), wb.publish()
    write_rollout(a, 0, x)
    assert b.stage_manifest(0, "rollout") is None
    assert {p.relative_to(b.path).as_posix() for p in b.path.rglob("*")} == {
        "manifest.json",
        "checkpoints",
        "checkpoints/iter_0",
        "checkpoints/iter_0/state.json",
        "checkpoints/iter_0/_published.json",
    }


def test_run_manifest_and_schema_version(tmp_path):
    config = {"model": "shapes", "train": {"lr": 1e-4, "steps": [1, 2]}}
    run = Run.create(tmp_path, "r", config)
    manifest = json.loads((run.path / "manifest.json").read_text())
    assert manifest["config"] == config and manifest["schema_version"] == run.manifest["schema_version"]
    assert set(manifest["code_version"]) == {"package", "git_commit"} and manifest["created_at"]
    assert Run.open(run.path).config == config
    assert Run.create(tmp_path, "r", config, exist_ok=True).config == config
    with pytest.raises(FileExistsError):
        Run.create(tmp_path, "r", config)
    with pytest.raises(ValueError, match="different config"):
        Run.create(tmp_path, "r", {"model": "other"}, exist_ok=True)
    with pytest.raises(ValueError, match="plain JSON"):
        Run.create(tmp_path, "s", {"x": object()})
    manifest["schema_version"] = 0
    (run.path / "manifest.json").write_text(json.dumps(seal(manifest)))  # as another version wrote it
    with pytest.raises(SchemaVersionError, match=r"schema version 0; this code reads version \d+\. Open it with"):
        Run.open(run.path)


def test_stage_written_with_another_schema_version_is_refused(tmp_path):
    run = Run.create(tmp_path, "r", {})
    write_rollout(run, 0, rollout_inputs())
    published = run.stage_path(0, "rollout") / "_published.json"
    manifest = json.loads(published.read_text())
    published.write_text(json.dumps(seal({**manifest, "schema_version": 99})))  # sealed by the code that wrote it
    with pytest.raises(SchemaVersionError, match="version 99"):
        run.stages.read_rollout(0)


def test_checkpoint_round_trip(tmp_path):
    run = Run.create(tmp_path, "r", {})
    torch.manual_seed(0)
    tensors = {
        "lora": {"a.weight": torch.randn(4, 2, dtype=torch.bfloat16), "b.weight": torch.randn(2, 4)},
        "optimizer": {"step": torch.tensor(3), "exp_avg.0": torch.randn(4, 2)},
    }
    state = {"iteration": 1, "torch_rng": torch.get_rng_state().tolist(), "numpy_rng": [1, 2, 3]}
    run.checkpoints.save_checkpoint(1, tensors, state)
    run.checkpoints.save_checkpoint(0, {"lora": {"a.weight": torch.zeros(1)}}, {"iteration": 0})
    assert run.checkpoints.latest_checkpoint() == 1
    ckpt = run.checkpoints.load_checkpoint()
    assert ckpt.iteration == 1 and ckpt.state == state
    for group, named in tensors.items():
        for name, t in named.items():
            got = ckpt.tensors[group][name]
            assert got.dtype == t.dtype and torch.equal(got, t)
    # tampering is detected against the published digest
    (run.stage_path(1, "checkpoint") / "state.json").write_text('{"iteration": 2}')
    with pytest.raises(Exception, match="do not match the published digest"):
        run.checkpoints.load_checkpoint(1)


def test_a_checkpoint_copied_under_another_number_is_not_that_iteration(tmp_path):
    """`cp -a checkpoints/iter_1 checkpoints/iter_7`: every byte verifies, and its sealed state says 1."""
    import shutil

    from stepgrpo.storage.errors import CorruptChunkError

    run = Run.create(tmp_path, "r", {})
    run.checkpoints.save_checkpoint(1, {"lora": {"a.weight": torch.ones(2)}}, {"iteration": 1})
    shutil.copytree(run.stage_path(1, "checkpoint"), run.stage_path(7, "checkpoint"))
    run.verify(1, "checkpoint")
    with pytest.raises(CorruptChunkError, match="iter_7 holds the checkpoint of iteration 1"):
        run.verify(7, "checkpoint")
    with pytest.raises(CorruptChunkError, match="iter_7 holds the checkpoint of iteration 1"):
        run.checkpoints.load_checkpoint(7)
    assert [what for what, _ in run.verify_all()] == ["iteration 7 checkpoint"]


def test_run_directory_holds_data_only(tmp_path):
    run = Run.create(tmp_path, "r", {})
    with run.checkpoints.begin_checkpoint(0) as w:
        (w.path / "optimizer.pt").write_bytes(b"\x80\x04pickle")
        with pytest.raises(ValueError, match="no pickle"):
            w.publish()
    assert run.stage_manifest(0, "checkpoint") is None


def test_prompts_round_trip_and_write_once(tmp_path):
    run = Run.create(tmp_path, "r", {})
    ids, texts, splits = [2, 0, 1], ["two red circles", "a blue square", "ünïcode ✓"], ["train", "test", "train"]
    meta = [{"objects": [{"shape": "circle", "count": 2}]}, {}, {"x": 1.5}]
    record = run.tables.write_prompts(ids, texts, splits, meta)
    assert run.tables.prompts_manifest() == record and record["rows"] == 3
    rows = run.tables.read_prompts().to_pylist()
    assert [r["prompt_id"] for r in rows] == [0, 1, 2]
    by_id = {r["prompt_id"]: r for r in rows}
    for i, t, s, m in zip(ids, texts, splits, meta):
        assert (by_id[i]["text"], by_id[i]["split"], json.loads(by_id[i]["metadata"])) == (t, s, m)
    assert run.tables.write_prompts(ids, texts, splits, meta) == record  # identical rewrite: no-op
    with pytest.raises(ValueError, match="immutable"):
        run.tables.write_prompts([0], ["other"], ["train"])
    assert run.tables.read_prompts().to_pandas().shape == (3, 4)


def test_options_digest_is_canonical():
    assert options_digest({"a": 1, "b": [1, 2]}) == options_digest({"b": [1, 2], "a": 1})
    assert options_digest({"a": 1}) != options_digest({"a": 2})
