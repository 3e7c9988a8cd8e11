"""The flow-matching objectives (`update.objective` nft, awm, dgpo) as pipeline stages: a run killed in
each stage resumes to the bytes of an uninterrupted one (the companion adapter included), the
reference loop computes what the pipeline stores, a stored run re-scores without a transformer
call, and step-level credit reaches the loss at the grid time of its step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stepgrpo.storage.run import Run

pytestmark = pytest.mark.slow

# nft on DPM-Solver++ rollouts with step-level credit on their own x0 predictions; awm on SA-Solver
# rollouts (their noise from the run's seeds) with outcome credit
CASES = {
    "nft": ["update.objective=nft", "sampler.ode_solver=dpm2", "completion.method=rollout", "credit.scheme=dense"],
    "awm": [
        "update.objective=awm",
        "sampler.sde_solver=sa_solver",
        "credit.scheme=outcome",
        "optim.optimizer_steps=2",
        "update.times=2",
    ],
    # dgpo on DPM-Solver++ rollouts, whole groups of 3, its EMA reference sampling from iteration 1
    "dgpo": [
        "update.objective=dgpo",
        "sampler.ode_solver=dpm2",
        "credit.scheme=outcome",
        "update.times=2",
        "update.companion_samples_after=0",
    ],
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> list[str]:
    from stepgrpo.shapes.model import build_pipeline, tiny_spec

    path = tmp_path_factory.mktemp("model") / "tiny-sd3"
    build_pipeline(tiny_spec(), seed=0).save_pretrained(str(path))
    return [
        f"model.path={path}",
        "model.lora_rank=4",
        "model.lora_alpha=8",
        "model.guidance_scale=1.0",
        "sampler.steps=4",
        "sampler.eval_steps=4",
        "sampler.kernel=ode",
        "sampler.shared_x0=false",
        "reward.name=jpeg_compressibility",
        "run.iterations=2",
        "run.prompts_per_iteration=2",
        "run.group_size=3",
        "run.eval_prompts=2",
        "run.eval_seeds=1",
        "optim.micro_batch=3",
        "optim.lr=1e-3",
        "scale.stage_retries=0",
        "scale.threads=1",  # the runs' bytes are compared
    ]


def _train(overrides: list[str], run_dir: Path) -> dict:
    from stepgrpo.flows.train import train

    return train(overrides=overrides, run_dir=str(run_dir))


def train_killed_in_turn(overrides: list[str], run_dir: Path, faults, tmp_path: Path, monkeypatch) -> None:
    """Train `run_dir` failed in turn at each `(stage, row)` of `faults` (each fault once, each
    checked to have fired), then finished."""
    spec = tmp_path / "fault"
    monkeypatch.setenv("STEPGRPO_FAULT", f"@{spec}")
    for n, (stage, row) in enumerate(faults):
        spec.write_text(f"raise:{stage}:{row}:{tmp_path / f'fired-{n}'}")
        with pytest.raises(Exception, match="STEPGRPO_FAULT"):
            _train(overrides, run_dir)
        assert (tmp_path / f"fired-{n}").exists()
    spec.write_text("")
    _train(overrides, run_dir)


def checkpoints(run_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every checkpoint (trained adapter, companion, AdamW state, RNG), by name."""
    out = {}
    for f in sorted((run_dir / "checkpoints").glob("iter_*/*.safetensors")):
        for name, t in load_file(str(f)).items():
            out[f"{f.parent.name}/{f.stem}/{name}"] = t
    return out


@pytest.fixture(scope="module")
def clean(harness, tiny, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("objectives")
    runs = {}
    for name, extra in CASES.items():
        runs[name] = root / name
        _train([*tiny, *extra], runs[name])
    return runs


@pytest.mark.parametrize("objective", sorted(CASES))
def test_a_run_killed_in_each_stage_resumes_bit_identical(objective, clean, tiny, tmp_path, monkeypatch):
    """One run directory, failed in turn in the rollout, the score and the update stage (each fault
    once), then finished: every checkpoint tensor equals the uninterrupted run's, the companion
    adapter (`old` / `kl_ema`) with them."""
    overrides = [*tiny, *CASES[objective]]
    run_dir = tmp_path / "killed"
    train_killed_in_turn(overrides, run_dir, [("rollout", 0), ("score", 0), ("update", 1)], tmp_path, monkeypatch)
    ours, theirs = checkpoints(run_dir), checkpoints(clean[objective])
    from stepgrpo_core.objectives import OBJECTIVES

    group = OBJECTIVES.facts(objective)["companion"]
    assert {k.split("/")[1] for k in ours} >= {"lora", "optimizer", group}
    assert ours.keys() == theirs.keys()
    if objective == "awm":  # the rollout records the solver that took its steps
        kp = Run.open(run_dir).stages.read_rollout(0).kernel_params
        assert kp["sde_solver"] == "sa_solver"
    assert all(torch.equal(ours[k], theirs[k]) for k in ours), [k for k in ours if not torch.equal(ours[k], theirs[k])]
    # the companion moved after every optimizer step: it is neither the start nor the trained adapter
    run = Run.open(run_dir)
    last = run.checkpoints.load_checkpoint(1).tensors
    assert any(not torch.equal(last[group][k], last["lora"][k]) for k in last["lora"])


@pytest.mark.parametrize("objective", sorted(CASES))
def test_the_reference_loop_computes_what_the_pipeline_stores(objective, clean):
    from stepgrpo.config import validate_config
    from stepgrpo.loops.reference import reference_loop

    run = Run.open(clean[objective])
    cfg = validate_config(run.config)
    assert cfg.update.objective == objective
    bare = reference_loop(cfg, cfg.run.iterations)
    scheme = cfg.credit.scheme
    for i, rec in enumerate(bare):
        digest = run.tables.read_advantages(i).column("options_digest").to_pylist()[0]
        assert torch.equal(rec["advantages"].float(), run.tables.advantage_grid(i, scheme, digest).float()), i


def test_dgpo_samples_with_its_ema_reference_after_the_switch(clean):
    """DGPO's companion (the EMA reference) samples once the run has taken more optimizer steps
    than `update.companion_samples_after` (0 here: from iteration 1 on), and the trained adapter
    before."""
    from stepgrpo.config import validate_config
    from stepgrpo.loops import workspace

    run = Run.open(clean["dgpo"])
    cfg = validate_config(run.config)
    ckpt = run.checkpoints.load_checkpoint(0).tensors
    before = workspace.lora_before(run, cfg, 1)
    assert all(torch.equal(before[k], ckpt["old"][k]) for k in before)
    assert any(not torch.equal(ckpt["old"][k], ckpt["lora"][k]) for k in before)
    late = cfg.model_copy(update={"update": cfg.update.model_copy(update={"companion_samples_after": 10})})
    trained = workspace.lora_before(run, late, 1)
    assert all(torch.equal(trained[k], ckpt["lora"][k]) for k in trained)


def test_nft_samples_with_its_old_adapter_and_costs_count_the_backward(clean):
    from stepgrpo.config import validate_config
    from stepgrpo.loops import workspace
    from stepgrpo.reporting.costs import iteration_costs

    run = Run.open(clean["nft"])
    cfg = validate_config(run.config)
    before = workspace.lora_before(run, cfg, 1)
    ckpt = run.checkpoints.load_checkpoint(0).tensors
    assert all(torch.equal(before[k], ckpt["old"][k]) for k in before)  # iteration 1 samples with `old`
    costs = iteration_costs(run)
    for row in costs:
        backward = run.stage_manifest(row["iteration"], "checkpoint")["inputs"]["backward"]
        assert backward > 0 and row["passes"] == row["nfe"] + 2 * backward
        # nft: the policy, the old adapter and the base (kl_beta > 0) a row: three forwards, one backward
        assert row["nfe_stages"]["update"] == 3 * backward
        assert row["nfe_stages"]["ode_reference"] == 0  # an ODE rollout is its own reference


def test_a_stored_nft_run_rescores_without_a_transformer_call(clean, tmp_path):
    import shutil

    from stepgrpo.config import validate_config
    from stepgrpo.flows.rescore import rescore
    from stepgrpo.loops import workspace

    copy = tmp_path / "copy"
    shutil.copytree(clean["nft"], copy)
    pol = workspace.policy(validate_config(Run.open(copy).config))
    before = pol.nfe
    rescore(str(copy), "jpeg_incompressibility")
    assert pol.nfe == before
    names = set(Run.open(copy).tables.read_rewards(0).column("reward_name").to_pylist())
    assert names == {"jpeg_compressibility", "jpeg_incompressibility"}


def test_dgpo_over_two_update_processes_keeps_groups_whole_and_matches_one(clean, tiny, tmp_path):
    """The dgpo run with its last checkpoint removed, resumed with two update processes: a rank takes
    whole groups only (here each optimizer step's part is one group: one rank computes it while the
    other has no rows, and the statistics still sum), so each group's preference weight is taken
    where all its members are, and the update equals the one-process update to float summation order."""
    import shutil

    run_dir = tmp_path / "two-ranks"
    shutil.copytree(clean["dgpo"], run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "iter_1")
    _train([*tiny, *CASES["dgpo"], "scale.update_processes=2"], run_dir)
    ours, theirs = checkpoints(run_dir), checkpoints(clean["dgpo"])
    assert Run.open(run_dir).stage_manifest(1, "checkpoint")["inputs"]["processes"] == 2
    for name in ("iter_1/lora", "iter_1/old"):
        keys = [k for k in ours if k.startswith(name + "/")]
        assert keys
        for k in keys:
            a, b = ours[k].double(), theirs[k].double()
            assert float((a - b).norm()) <= 1e-6 * max(float(b.norm()), 1e-12), k
