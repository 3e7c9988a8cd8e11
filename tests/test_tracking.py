"""The MLflow store of a runs root: made once, whole, by whichever run starts first."""

from __future__ import annotations

import sqlite3
import threading

from stepgrpo.reporting.tracking import (
    STORE_FILE,
    Tracker,
    ensure_local_store,
    experiment_name,
    store_dir,
    tracking_uri,
    ui_hint,
)


def test_runs_starting_at_once_share_one_store(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    errors: list[BaseException] = []

    def start() -> None:
        try:
            ensure_local_store(tmp_path)
        except BaseException as err:  # noqa: BLE001 - collected, asserted below
            errors.append(err)

    threads = [threading.Thread(target=start) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(STORE_FILE)] == [STORE_FILE]
    with sqlite3.connect(tmp_path / STORE_FILE) as db:
        assert db.execute("SELECT count(*) FROM experiments").fetchone()[0] >= 1


def test_a_run_logs_to_its_roots_store_and_reopens_its_mlflow_run(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path / "runs" / "a"
    run_dir.mkdir(parents=True)
    assert store_dir(run_dir) == run_dir.parent.resolve()
    assert tracking_uri(run_dir) == f"sqlite:///{tmp_path / 'runs' / STORE_FILE}"
    with Tracker.start(run_dir, "exp", "a") as first:
        first.log_metrics({"m": 1.0}, step=0)
    with Tracker.start(run_dir, "exp", "a") as again:
        assert again.resumed and again.run_id == first.run_id
        again.log_metrics({"m": 5.0}, step=0)  # a step logged before: not logged twice
        again.log_metrics({"m": 2.0}, step=1)
    history = again.client.get_metric_history(first.run_id, "m")
    assert sorted((m.step, m.value) for m in history) == [(0, 1.0), (1, 2.0)]
    with Tracker.start(tmp_path / "runs" / "b", "exp", "b") as other:
        assert not other.resumed and other.run_id != first.run_id


def test_a_full_disk_shows_the_runs_own_error_not_mlflows(tmp_path, monkeypatch):
    """A stage that fails with ENOSPC: MLflow cannot record the failure either (its SQLite file is
    on the same disk); the error the user sees is the stage's."""
    import errno

    import pytest

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path / "runs" / "a"
    run_dir.mkdir(parents=True)
    with pytest.raises(OSError, match="No space left") as err:
        with Tracker.start(run_dir, "exp", "a") as tracker:

            def full(*args, **kwargs):
                raise sqlite3.OperationalError("database or disk is full")

            monkeypatch.setattr(tracker.client, "set_terminated", full)
            raise OSError(errno.ENOSPC, "No space left on device")
    assert err.value.errno == errno.ENOSPC


def test_a_failed_store_creation_leaves_nothing_half_made(tmp_path, monkeypatch):
    import errno

    import pytest

    from stepgrpo.reporting import tracking

    root = tmp_path / "runs"
    root.mkdir()
    (root / f".{STORE_FILE}.12345.creating").write_text("left by a killed creation")

    def full(path):
        path.write_bytes(b"half")
        (path.parent / f"{path.name}-journal").write_bytes(b"j")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tracking, "_migrate", full)
    with pytest.raises(OSError, match="No space left"):
        ensure_local_store(root)
    assert sorted(p.name for p in root.iterdir()) == [f".{STORE_FILE}.lock"]


def test_a_new_store_is_a_copy_of_the_schema_template_with_its_own_default_experiment(tmp_path, monkeypatch):
    from stepgrpo.reporting import tracking

    monkeypatch.setenv("STEPGRPO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    ensure_local_store(tmp_path / "a")  # makes the template on the way
    (template,) = (tmp_path / "cache").glob("mlflow-store-*.db")
    with sqlite3.connect(template) as db:
        assert db.execute("SELECT count(*) FROM experiments").fetchone()[0] == 0

    def migrated(*args, **kwargs):  # a second store must not migrate again
        raise AssertionError("migrated")

    monkeypatch.setattr("mlflow.store.db.utils._initialize_tables", migrated)
    ensure_local_store(tmp_path / "b")
    for root in ("a", "b"):
        with sqlite3.connect(tmp_path / root / STORE_FILE) as db:
            rows = db.execute("SELECT experiment_id, name, artifact_location FROM experiments").fetchall()
        assert rows == [(0, "Default", (tmp_path / root / "mlflow-artifacts" / "0").as_uri())]
    monkeypatch.undo()

    # a damaged template is made again, never copied; an unwritable cache falls back to migrating
    monkeypatch.setenv("STEPGRPO_CACHE_DIR", str(tmp_path / "cache"))
    template.write_bytes(b"not a database")
    ensure_local_store(tmp_path / "c")
    assert tracking._readable(template, experiments=0) and tracking._readable(tmp_path / "c" / STORE_FILE)
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("STEPGRPO_CACHE_DIR", str(tmp_path / "file" / "cache"))
    ensure_local_store(tmp_path / "d")
    assert tracking._readable(tmp_path / "d" / STORE_FILE, experiments=1)


def test_one_experiment_per_store_and_runs_of_the_old_per_config_experiments_resume_there(tmp_path, monkeypatch):
    """Every run of a runs root logs to one experiment (`stepgrpo`, or MLflow's own
    MLFLOW_EXPERIMENT_NAME), so schemes overlay in one chart; a run made when the experiment was
    its config's name finds its MLflow run there on resume, not a second one."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    assert experiment_name() == "stepgrpo"
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "project-x")
    assert experiment_name() == "project-x"
    runs = tmp_path / "runs"
    (runs / "old").mkdir(parents=True)
    with Tracker.start(runs / "old", "shapes_dense", "old") as before:
        pass
    with Tracker.start(runs / "old", experiment_name(), "old") as resumed:
        assert resumed.resumed and resumed.run_id == before.run_id
    with Tracker.start(runs / "new", experiment_name(), "new") as new:
        exp = new.client.get_experiment(new.client.get_run(new.run_id).info.experiment_id)
        assert exp.name == "project-x" and exp.tags["mlflow.experimentKind"] == "custom_model_development"
    uri = tracking_uri(runs / "new")
    assert (
        ui_hint(uri, "3")
        == f"mlflow ui --backend-store-uri {uri}, then http://127.0.0.1:5000/#/experiments/3?workflowType=machine_learning"
    )
    assert ui_hint("http://mlflow:5000/", "3") == "http://mlflow:5000/#/experiments/3?workflowType=machine_learning"


def test_the_logged_evaluation_image_is_the_grids_first_tiles_square(tmp_path):
    """The stored grid keeps its layout in the PNG; `preview` cuts its first 16 captioned tiles
    out again, in order, 4 x 4 (MLflow shows that readably at its default size)."""
    import torch
    from PIL import Image

    from stepgrpo.images import captioned_grid, preview
    from stepgrpo.reporting.report import write_grid

    images = torch.stack([torch.full((3, 16, 16), i / 63) for i in range(64)])
    captions = [f"prompt {i}" for i in range(64)]
    write_grid(tmp_path / "g.png", images, captions=captions)
    with Image.open(tmp_path / "g.png") as stored:
        small = preview(stored)
        made = captioned_grid(images[:16], captions[:16], ncols=4)
        assert small.size == made.size and small.tobytes() == made.tobytes()
    plain = Image.new("RGB", (10, 10))
    assert preview(plain) is plain  # a grid without its layout: as it is


def test_a_run_scored_on_final_samples_logs_no_all_zero_step_series():
    """Outcome credit has no step rewards: no gain/step_k, turning points, completion or ODE
    reference series (all zero by construction); a run with step rewards logs them."""
    from types import SimpleNamespace as NS

    from stepgrpo.reporting.metrics import iteration_metrics

    stats = NS(
        **{k: 0.1 for k in ("clip_frac", "approx_kl", "kl", "loss", "grad_norm", "signal_cosine")},
        **{k: 0.1 for k in ("signal_cosine_window", "ratio_mean", "ratio_std", "ratio_min", "ratio_max")},
        **{k: 0.1 for k in ("lora_distance", "update_norm", "clip_frac_first", "clip_frac_later")},
        zero_grad_frac_first=0.0,
        zero_grad_frac_later=0.0,
        grad_energy_share=[0.5, 0.5],
        clip_frac_later_by_step=[0.0, 0.0],
        zero_grad_frac_later_by_step=[0.0, 0.0],
        clip_frac_by_part=[0.0, 0.25],
        zero_grad_frac_by_part=[0.0, 0.125],
        trained_step_ids=[0, 1],
    )
    done = dict(seconds=1.0, peak_memory_gib=None)
    rollout = NS(nfe=8, nfe_ode=0, **done)
    rewards = NS(reward_mean=0.5, reward_std=0.1, reward_strict=None, ode_reward_mean=None, **done)
    rewards.group_reward_std, rewards.zero_std_groups = 0.1, 0
    credit = NS(adv_mean=0.0, adv_std=1.0, adv_abs_max=2.0, zero_std_ratio=0.0, turning_points=0, **done)
    credit.gain_mean = [0.0] * 4
    update = NS(nfe=4, stats=stats, **done)
    outcome = iteration_metrics(rollout, rollout, rewards, credit, update, step_rewards=False)
    assert not [k for k in outcome if k.startswith("gain/") or k in ("turning_points", "nfe/complete")]
    assert "nfe/ode_reference" not in outcome and outcome["nfe/rollout"] == 8
    stepwise = iteration_metrics(rollout, rollout, rewards, credit, update, step_rewards=True)
    assert [f"gain/step_{k}" for k in range(4)] == [k for k in stepwise if k.startswith("gain/")]
    # an outcome run's ODE reference is a forward it made: logged (the compute axis itself is the
    # stored stages' sum, stepgrpo.reporting.costs, checked against MLflow in test_flows)
    referenced = NS(nfe=8, nfe_ode=2, **done)
    with_reference = iteration_metrics(referenced, referenced, rewards, credit, update, step_rewards=False)
    assert with_reference["nfe/ode_reference"] == 2
    # each optimizer step of the sampled batch: its clip fraction and the share of rows with no gradient
    assert (outcome["clip_frac/part_0"], outcome["clip_frac/part_1"]) == (0.0, 0.25)
    assert outcome["zero_grad_frac/part_1"] == 0.125
