"""Branched rollouts (`sampler.branch_window`) as pipeline stages: a run killed in each stage
resumes to the bytes of an uninterrupted one, the reference loop computes what the pipeline
stores, the rollout's transformer rows count each group's shared prefix once, each trajectory has a
density at its group's branch step alone, and a stored branched run re-scores without a transformer
call."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from test_objectives_pipeline import _train, checkpoints, train_killed_in_turn

from stepgrpo.storage.run import Run

pytestmark = pytest.mark.slow

T, P, G = 4, 2, 3


@pytest.fixture(scope="module")
def branched(tmp_path_factory) -> list[str]:
    from stepgrpo.shapes.model import build_pipeline, tiny_spec

    path = tmp_path_factory.mktemp("model") / "tiny-sd3"
    build_pipeline(tiny_spec(), seed=0).save_pretrained(str(path))
    return [
        f"model.path={path}",
        "model.lora_rank=4",
        "model.lora_alpha=8",
        "model.guidance_scale=1.0",
        f"sampler.steps={T}",
        "sampler.eval_steps=4",
        "sampler.kernel=flow",
        "sampler.branch_window=[0,3]",
        "completion.method=null",
        "credit.scheme=outcome",
        "reward.name=jpeg_compressibility",
        "run.iterations=2",
        f"run.prompts_per_iteration={P}",
        f"run.group_size={G}",
        "run.eval_prompts=2",
        "run.eval_seeds=1",
        "optim.micro_batch=3",
        "optim.lr=1e-3",
        "scale.stage_retries=0",
        "scale.threads=1",  # the runs' bytes are compared
        "storage.branch_nodes=always",  # each node once, though the tiny model's states are small
    ]


@pytest.fixture(scope="module")
def clean(harness, branched, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("branched") / "run"
    _train(branched, run_dir)
    return run_dir


def test_each_group_branches_once_and_its_prefix_is_counted_once(clean):
    run = Run.open(clean)
    for i in range(2):
        data = run.stages.read_rollout(i)
        finite = torch.isfinite(torch.from_numpy(data.log_probs))
        assert bool((finite.sum(dim=1) == 1).all())  # one density a trajectory: its branch step
        at = finite.float().argmax(dim=1).reshape(P, G)
        assert bool((at == at[:, :1]).all())  # the group's members branch at the same step
        states = torch.from_numpy(data.states).reshape(P, G, T + 1, -1)
        for g in range(P):
            b = int(at[g, 0])
            assert bool((states[g, :, : b + 1] == states[g, :1, : b + 1]).all())  # the shared prefix
            assert len({tuple(m.tolist()) for m in states[g, :, b + 1]}) == G  # then each its own
        prefix_once = sum(int(at[g, 0]) + 1 + G * (T - int(at[g, 0]) - 1) for g in range(P))
        assert run.stage_manifest(i, "rollout")["inputs"]["nfe"] == prefix_once < P * G * T
        # each state stored once: a group's prefix x_0 .. x_b, then each member's own x_{b+1} .. x_T
        stored = len(list((run.stage_path(i, "rollout") / "states").glob("c.*")))
        assert stored == sum(int(at[g, 0]) + 1 + G * (T - int(at[g, 0])) for g in range(P)) < P * G * (T + 1)
        run.verify(i, "rollout")


def test_a_branched_run_killed_in_each_stage_resumes_bit_identical(clean, branched, tmp_path, monkeypatch):
    run_dir = tmp_path / "killed"
    train_killed_in_turn(branched, run_dir, [("rollout", 0), ("score", 0), ("update", 1)], tmp_path, monkeypatch)
    ours, theirs = checkpoints(run_dir), checkpoints(clean)
    assert ours.keys() == theirs.keys() and ours
    assert all(torch.equal(ours[k], theirs[k]) for k in ours), [k for k in ours if not torch.equal(ours[k], theirs[k])]
    a, b = Run.open(run_dir).stages.read_rollout(1), Run.open(clean).stages.read_rollout(1)
    assert (a.states == b.states).all()


def test_the_reference_loop_computes_what_the_pipeline_stores(clean):
    from stepgrpo.config import validate_config
    from stepgrpo.loops.reference import reference_loop

    run = Run.open(clean)
    cfg = validate_config(run.config)
    for i, rec in enumerate(reference_loop(cfg, cfg.run.iterations)):
        digest = run.tables.read_advantages(i).column("options_digest").to_pylist()[0]
        assert torch.equal(rec["advantages"].float(), run.tables.advantage_grid(i, "outcome", digest).float()), i


def test_a_stored_branched_run_rescores_without_a_transformer_call(clean, tmp_path):
    from stepgrpo.config import validate_config
    from stepgrpo.flows.rescore import rescore
    from stepgrpo.loops import workspace

    copy = tmp_path / "copy"
    shutil.copytree(clean, copy)
    pol = workspace.policy(validate_config(Run.open(copy).config))
    before = pol.nfe
    rescore(str(copy), "jpeg_incompressibility")
    assert pol.nfe == before
    names = set(Run.open(copy).tables.read_rewards(0).column("reward_name").to_pylist())
    assert names == {"jpeg_compressibility", "jpeg_incompressibility"}


@pytest.fixture(scope="module")
def tree_settings(branched) -> list[str]:
    # BranchGRPO's own tree: G = 4 leaves a group, two children at step 0, each two at step 1, every
    # other step stochastic too (T = 4), the trained transitions after the last split width-pruned
    sets = [s for s in branched if not s.startswith(("sampler.branch_window", "run.group_size", "credit.scheme"))]
    return [
        *sets, "sampler.branch_tree=[[0,2],[1,2]]", "sampler.tree_sde=[0,4]", "optim.width_pruning=extremes",
        "run.group_size=4", "credit.scheme=tree", "optim.micro_batch=4",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def tree_run(harness, tree_settings, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("tree") / "run"
    _train(tree_settings, run_dir)
    return run_dir


def test_credit_quality_continues_a_branched_run_under_its_own_policy(clean):
    """The check's continuations of a branched run take the kernel at each trajectory's branch step
    alone: every state after it is deterministic, its value the trajectory's own final reward, and the
    continuations cost the rows up to the branch steps only."""
    import numpy as np

    from stepgrpo.flows.quality import credit_quality

    run = Run.open(clean)
    data = run.stages.read_rollout(0)
    branch = np.isfinite(data.log_probs).argmax(axis=1)
    check = credit_quality(str(clean), iteration=0, continuations=2, schemes=["outcome"])
    values = np.asarray(check["values"])
    for b, row in enumerate(values):
        assert np.array_equal(row[branch[b] + 1 :], np.full(T - branch[b], row[T])), b  # V(x_T) = R_T
    assert len(np.unique(values[:, 0])) > 1  # before the branch: continued, not the final reward
    window_end = 3
    expected = sum(int((branch >= k).sum()) * 2 * (T - k) for k in range(window_end))
    assert check["nfe"] == expected


def test_a_tree_run_computes_each_node_once_and_credits_each_depth(tree_run):
    from stepgrpo_core.credit import assign

    run = Run.open(tree_run)
    data = run.stages.read_rollout(0)
    # a group: the root at step 0, its 2 children at step 1, the 4 leaves at steps 2 and 3
    assert run.stage_manifest(0, "rollout")["inputs"]["nfe"] == P * (1 + 2 + 4 * 2) < P * 4 * T
    finite = torch.isfinite(torch.from_numpy(data.log_probs))
    assert finite[:, 0].tolist() == [True, False, True, False] * P  # one density per child at step 0
    assert bool(finite[:, 1:].all()) and int(finite.sum()) == P * (2 + 4 * 3)  # a leaf's own from step 1
    # each node's states once: the root's x_0, 2 children's x_1, 4 leaves x (x_2, x_3, x_4), a group
    assert len(list((run.stage_path(0, "rollout") / "states").glob("c.*"))) == P * (1 + 2 + 4 * 3)
    digest = run.tables.read_advantages(0).column("options_digest").to_pylist()[0]
    stored = run.tables.advantage_grid(0, "tree", digest).float()
    final = run.tables.reward_grid(0, "jpeg_compressibility", "1")[:, -1:].float()  # a final-only run: R_T
    rewards = final.expand(P * 4, T + 1)
    nodes = [(0, 2), (1, 2), (2, 1), (3, 1)]  # the splits and the tree_sde steps between and after them
    by_hand = assign("tree", rewards, torch.arange(P).repeat_interleave(4), tree=nodes).advantages
    torch.testing.assert_close(stored, by_hand)
    # width pruning (extremes, half): of each group's 4 trained transitions after the last split (step 2),
    # the best and the worst go through the backward pass; the trained transitions are steps 0 to 2's
    for it in range(2):
        stats = run.checkpoint_state(it)["update"]
        assert stats["width_pruned"] == P * 2
        assert run.stage_manifest(it, "checkpoint")["inputs"]["backward"] == P * (2 + 4 + 4) - P * 2


def test_credit_quality_continues_a_tree_run_at_its_stochastic_steps(tree_run):
    """A tree run's states are continued with the kernel at its stochastic steps: its splits (0 and
    1) and the tree_sde steps after them (2 and 3), so every state before `x_T` is continued."""
    import numpy as np

    from stepgrpo.flows.quality import credit_quality

    check = credit_quality(str(tree_run), iteration=0, continuations=2, schemes=["tree"])
    values = np.asarray(check["values"])
    assert not np.array_equal(values[:, 2], values[:, T])  # after the last split: still continued
    assert check["nfe"] == sum(len(values) * 2 * (T - k) for k in range(T))


def test_a_branched_run_stores_each_node_once_where_its_states_are_large_enough(tmp_path):
    """`storage.branch_nodes: auto` stores a branched rollout by node where a state is at least
    16 KiB (a 256 px SD3 latent), whole where it is smaller (one file a state would fill a block
    each); an unbranched rollout is never stored by node."""
    from stepgrpo.config import validate_config
    from stepgrpo.tasks.rollout import by_node

    branched = validate_config({"sampler": {"branch_window": [0, 3], "sde_window_size": None}})
    plain = validate_config({})
    assert by_node(branched, (16, 32, 32)) and not by_node(branched, (4, 16, 16))  # float32: 64 KiB, 4 KiB
    assert not by_node(plain, (16, 128, 128))
    always = branched.model_copy(update={"storage": branched.storage.model_copy(update={"branch_nodes": "always"})})
    never = branched.model_copy(update={"storage": branched.storage.model_copy(update={"branch_nodes": "never"})})
    assert by_node(always, (4, 16, 16)) and not by_node(never, (16, 128, 128))


def test_a_tree_run_killed_in_each_stage_resumes_bit_identical(tree_run, tree_settings, tmp_path, monkeypatch):
    """A tree with stochastic steps between its splits and width pruning, killed in its rollout,
    scoring and update (the pruned update's second iteration), resumes to the uninterrupted bytes."""
    run_dir = tmp_path / "killed"
    train_killed_in_turn(tree_settings, run_dir, [("rollout", 0), ("score", 0), ("update", 1)], tmp_path, monkeypatch)
    ours, theirs = checkpoints(run_dir), checkpoints(tree_run)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.fixture(scope="module")
def anchor_settings(branched) -> list[str]:
    # G = 4 a group: 2 children off the anchor at step 0, 2 at step 2 (T = 4); G2RPO's two granularities
    drop = ("sampler.branch_window", "run.group_size", "credit.scheme", "completion.method")
    sets = [s for s in branched if not s.startswith(drop)]
    return [
        *sets, "sampler.branch_anchor=[0,2]", "run.group_size=4", "completion.method=rollout",
        "credit.scheme=granular", "optim.micro_batch=4",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def anchor_run(harness, anchor_settings, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("anchor") / "run"
    _train(anchor_settings, run_dir)
    return run_dir


def test_an_anchor_run_computes_its_anchor_once_and_credits_siblings_alone(anchor_run):
    """Each group's anchor once (rows at states 0-2), each child's step from the anchor's velocity,
    the ODE after it; the stored advantages are G2RPO's sum at each branch step alone, and `local`
    re-credited offline from the stored rewards (no model) equals its hand computation."""
    from stepgrpo.flows.credit import credit
    from stepgrpo_core.credit import assign

    run = Run.open(anchor_run)
    data = run.stages.read_rollout(0)
    # a group: the anchor's 3 rows, 2 children x 3 steps after step 0, 2 x 1 after step 2
    assert run.stage_manifest(0, "rollout")["inputs"]["nfe"] == P * (3 + 2 * 3 + 2 * 1) < P * 4 * T
    finite = torch.isfinite(torch.from_numpy(data.log_probs))
    branch = finite.float().argmax(dim=1)
    assert bool((finite.sum(dim=1) == 1).all()) and branch.tolist() == [0, 0, 2, 2] * P
    # each state stored once: the anchor's x_0 .. x_2, then each member's own states after its branch
    assert len(list((run.stage_path(0, "rollout") / "states").glob("c.*"))) == P * (3 + 2 * 4 + 2 * 2)
    states = torch.from_numpy(data.states)
    assert torch.equal(states[0, 0], states[2, 0]) and torch.equal(states[2, :3], states[3, :3])  # the anchor
    assert not torch.equal(states[0, 1], states[1, 1]) and not torch.equal(states[2, 3], states[3, 3])  # siblings
    rewards = run.tables.reward_grid(0, "jpeg_compressibility", "1").float()
    groups = torch.arange(P).repeat_interleave(4)
    digest = run.tables.read_advantages(0).column("options_digest").to_pylist()[0]
    stored = run.tables.advantage_grid(0, "granular", digest).float()
    torch.testing.assert_close(stored, assign("granular", rewards, groups, branch=branch).advantages)
    assert bool((stored[finite == 0] == 0).all())  # no density, no credit
    credit(str(anchor_run), "local")
    table = Run.open(anchor_run).tables.read_advantages(0)
    schemes, digests = table.column("scheme").to_pylist(), table.column("options_digest").to_pylist()
    local = next(d for s, d in zip(schemes, digests) if s == "local")
    redone = Run.open(anchor_run).tables.advantage_grid(0, "local", local).float()
    torch.testing.assert_close(redone, assign("local", rewards, groups, branch=branch).advantages)


def test_an_anchor_run_killed_in_each_stage_resumes_bit_identical(anchor_run, anchor_settings, tmp_path, monkeypatch):
    run_dir = tmp_path / "killed"
    stages = [("rollout", 0), ("complete", 0), ("score", 0), ("update", 1)]
    train_killed_in_turn(anchor_settings, run_dir, stages, tmp_path, monkeypatch)
    ours, theirs = checkpoints(run_dir), checkpoints(anchor_run)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_credit_quality_judges_the_sibling_schemes_on_an_anchor_run(anchor_run):
    """The check continues an anchor run's states with the kernel at each trajectory's branch step
    alone and judges G2RPO's and Step-GRPO's advantages beside outcome's."""
    import numpy as np

    from stepgrpo.flows.quality import credit_quality

    check = credit_quality(str(anchor_run), iteration=0, continuations=2, schemes=["outcome", "granular", "local"])
    assert {"outcome", "granular", "local"} <= set(check["schemes"])
    values = np.asarray(check["values"])
    branch = np.array([0, 0, 2, 2] * P)
    for b, row in enumerate(values):
        assert np.array_equal(row[branch[b] + 1 :], np.full(T - branch[b], row[T])), b
    assert check["nfe"] == sum(int((branch >= k).sum()) * 2 * (T - k) for k in range(3))
