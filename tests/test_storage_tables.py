"""Storage: rewards and advantages tables are long, append-only and selected by name/version/scheme."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from stepgrpo.storage import NotPublishedError, Run

B, T = 4, 3


@pytest.fixture
def run(tmp_path) -> Run:
    """A run with a published rollout of B=4 trajectories, T=3 steps (sizes the grids)."""
    run = Run.create(tmp_path, "r", {})
    with run.stages.begin_rollout(
        0,
        sigmas=np.linspace(1, 0, T + 1),
        seeds=np.arange(B),
        prompt_ids=np.zeros(B),
        group_ids=[0, 0, 1, 1],
        latent_shape=(1, 2, 2),
        latent_dtype="float32",
        kernel="sde",
        kernel_params={},
    ) as w:
        w.write(
            0,
            states=np.zeros((B, T + 1, 1, 2, 2)),
            log_probs=np.zeros((B, T)),
            stds=np.zeros((B, T)),
            ode_final=np.zeros((B, 1, 2, 2)),
        )
        w.publish()
    return run


def all_states() -> tuple[np.ndarray, np.ndarray]:
    traj, k = np.meshgrid(np.arange(B), np.arange(T + 1), indexing="ij")
    return traj.ravel(), k.ravel()


def test_rewards_round_trip_with_strict_and_sub_scores(run):
    traj, k = all_states()
    value = np.random.default_rng(0).random(len(traj)).astype(np.float32)  # float32 scores: exact in float64
    count = np.where(k == T, 1.0, np.nan)  # a sub-score only defined for final states
    run.tables.append_rewards(
        0, "shapes", "1", traj, k, torch.from_numpy(value), strict=(value > 0.5), sub={"count": count, "colour": value}
    )
    table = run.tables.read_rewards(0, "shapes", "1")
    assert table.num_rows == B * (T + 1)
    assert table.column("value").to_numpy().astype(np.float32).tobytes() == value.tobytes()
    assert table.column("strict").to_pylist() == [float(v > 0.5) for v in value]
    subs = [dict(s) for s in table.column("sub").to_pylist()]
    assert [s["colour"] for s in subs] == [float(v) for v in value]
    assert [math.isnan(s["count"]) for s in subs] == list(k != T)
    grid = run.tables.reward_grid(0, "shapes")  # the only stored version
    assert grid.shape == (B, T + 1) and grid.dtype == torch.float32
    assert torch.equal(grid, torch.from_numpy(value.reshape(B, T + 1)))
    assert torch.equal(run.tables.reward_grid(0, "shapes", "1", field="strict"), (grid > 0.5).float())
    count_grid = run.tables.reward_grid(0, "shapes", field="count")
    assert torch.isnan(count_grid[:, :T]).all() and (count_grid[:, T] == 1).all()
    df = run.tables.read_rewards(as_pandas=True)  # pandas for notebooks
    assert list(df.columns) == ["iteration", "traj", "k", "reward_name", "reward_version", "value", "strict", "sub"]


def test_reward_without_strict_has_nulls_and_missing_states_are_nan(run):
    run.tables.append_rewards(0, "pickscore", "v2", traj=[0, 3], k=[T, T], value=[0.25, -1.5])
    table = run.tables.read_rewards(reward_name="pickscore")
    assert table.column("strict").null_count == 2
    grid = run.tables.reward_grid(0, "pickscore")
    assert grid[0, T] == 0.25 and grid[3, T] == -1.5 and int(torch.isnan(grid).sum()) == B * (T + 1) - 2


def test_nan_or_inf_rewards_are_refused_naming_rows(run):
    with pytest.raises(
        ValueError, match=r"2 values are NaN or infinite, \(traj, k, value\): \[\(1, 2, nan\), \(3, 0, inf\)\]"
    ):
        run.tables.append_rewards(
            0, "shapes", "1", traj=[0, 1, 3], k=[0, 2, 0], value=[0.1, float("nan"), float("inf")]
        )
    assert run.tables.read_rewards().num_rows == 0  # nothing of the refused append was stored


def test_rewards_are_append_only(run):
    traj, k = all_states()
    first = run.tables.append_rewards(0, "shapes", "1", traj, k, np.full(len(traj), 0.5))
    folder = run.path / "rewards"
    before = {p.name: p.read_bytes() for p in folder.glob("*.parquet")}
    # re-scoring with the same version would overwrite values: refused, naming a row
    with pytest.raises(ValueError, match=r"already stored.*'traj': 0, 'k': 0.*Bump the version"):
        run.tables.append_rewards(0, "shapes", "1", traj, k, np.full(len(traj), 0.7))
    # the very same rows again (a stage re-run after a crash): a no-op, no duplicates
    assert run.tables.append_rewards(0, "shapes", "1", traj, k, np.full(len(traj), 0.5)) == first
    # a new version and a new reward add rows; older files are untouched
    run.tables.append_rewards(0, "shapes", "2", traj, k, np.full(len(traj), 0.7))
    run.tables.append_rewards(0, "ocr", "1", traj[:2], k[:2], [1.0, 0.0])
    run.tables.append_rewards(1, "shapes", "1", traj, k, np.full(len(traj), 0.9))
    assert {p.name: p.read_bytes() for p in folder.glob("*.parquet") if p.name in before} == before
    assert len(list(folder.glob("*.parquet"))) == 4  # one file per accepted append
    assert run.tables.read_rewards().num_rows == 3 * B * (T + 1) + 2
    assert set(run.tables.read_rewards(0, "shapes", "1").column("value").to_pylist()) == {0.5}
    assert set(run.tables.read_rewards(0, "shapes", "2").column("value").to_pylist()) == {0.7}
    assert run.tables.read_rewards(iteration=1).num_rows == B * (T + 1)
    with pytest.raises(ValueError, match=r"several reward_version values \['1', '2'\]"):
        run.tables.reward_grid(0, "shapes")
    with pytest.raises(NotPublishedError):
        run.tables.reward_grid(0, "unknown")
    # the digest of a version's rows is stable and independent of other rows
    d1 = run.tables.rewards_digest(0, "shapes", "1")
    run.tables.append_rewards(0, "shapes", "3", traj, k, np.full(len(traj), 0.1))
    assert run.tables.rewards_digest(0, "shapes", "1") == d1 != run.tables.rewards_digest(0, "shapes", "2")


def test_advantages_round_trip_and_selection(run):
    steps_traj, steps_k = np.meshgrid(np.arange(B), np.arange(T), indexing="ij")
    adv = np.random.default_rng(1).standard_normal((B, T))
    adv[:, 0] = np.nan  # no credit outside the SDE window
    opts = {"gamma": 1.0, "normalize": "group"}
    record = run.tables.append_advantages(0, "dense", opts, steps_traj.ravel(), steps_k.ravel(), adv.ravel())
    run.tables.append_advantages(
        0, "dense", {**opts, "gamma": 0.9}, steps_traj.ravel(), steps_k.ravel(), adv.ravel() * 2
    )
    run.tables.append_advantages(0, "flow_grpo", {}, steps_traj.ravel(), steps_k.ravel(), np.ones(B * T))
    digest = record["options_digest"]
    assert run.tables.scheme_options(digest) == {"scheme": "dense", "options": opts}
    got = run.tables.read_advantages(0, "dense", digest).column("value").to_numpy()
    assert got.tobytes() == adv.ravel().tobytes()
    grid = run.tables.advantage_grid(0, "dense", digest)
    assert grid.shape == (B, T) and torch.equal(grid.isnan(), torch.from_numpy(np.isnan(adv)))
    assert torch.equal(run.tables.advantage_grid(0, "flow_grpo"), torch.ones(B, T))
    with pytest.raises(ValueError, match="several options_digest"):
        run.tables.advantage_grid(0, "dense")
    with pytest.raises(ValueError, match=r"infinite advantages at \(traj, k\): \[\(2, 1\)\]"):
        run.tables.append_advantages(0, "x", {}, [2], [1], [float("-inf")])
    with pytest.raises(ValueError, match="already stored"):
        run.tables.append_advantages(0, "dense", opts, [0], [1], [0.0])
    assert run.tables.advantages_digest(0, "dense", digest) != run.tables.advantages_digest(
        0, "flow_grpo", run.tables.read_advantages(scheme="flow_grpo").column("options_digest")[0].as_py()
    )


def test_grid_needs_a_published_rollout(tmp_path):
    run = Run.create(tmp_path, "r", {})
    run.tables.append_rewards(0, "shapes", "1", [0], [0], [1.0])
    with pytest.raises(NotPublishedError, match="no published rollout"):
        run.tables.reward_grid(0, "shapes")


def test_a_part_whose_rows_decode_the_same_but_whose_bytes_changed_is_damaged(tmp_path):
    """Bytes outside the rows (statistics, metadata) are covered by the digest recorded at append."""
    import numpy as np
    import pyarrow.parquet as pq

    from stepgrpo.storage import CorruptChunkError, Run

    run = Run.create(tmp_path, "r", {"a": 1})
    run.tables.append_rewards(0, "x", "1", np.arange(4), np.zeros(4, int), np.arange(4.0))
    part = next((run.path / "rewards").glob("part-*.parquet"))
    table = pq.read_table(part)
    pq.write_table(table.replace_schema_metadata({"edited": "yes"}), part)  # the same rows, other bytes
    assert run.tables.damaged_parts("rewards") == [part]
    with pytest.raises(CorruptChunkError, match="bytes no longer match"):
        run.tables.read_rewards(0)


def test_a_read_of_one_iteration_opens_only_the_parts_that_may_hold_it(tmp_path, monkeypatch):
    import pyarrow.dataset as pads

    import stepgrpo.storage.tables as tables

    run = Run.create(tmp_path, "r", {"seed": 0})
    for i in range(6):  # a part per iteration, as a run appends them
        run.tables.append_rewards(i, "shapes", "1", traj=[0, 1], k=[2, 2], value=[0.1 * i, 0.2])
    opened = []
    original = pads.dataset

    def dataset(files, **kwargs):
        opened.append(list(files))
        return original(files, **kwargs)

    monkeypatch.setattr(tables.ds, "dataset", dataset)
    assert run.tables.read_rewards(4).column("value").to_pylist() == [0.4, 0.2]
    assert len(opened[-1]) == 1  # not the six parts
    assert run.tables.read_rewards(9).num_rows == 0 and run.tables.read_rewards().num_rows == 12
