"""Branched rollouts (stepgrpo_core.branching): a group's shared prefix is computed once and
counted once, its members branch at the group's step with their own noise, and every stored state
equals the same steps run one by one."""

from __future__ import annotations

import pytest
import torch

from stepgrpo_core.branching import branched_rollout, draw_branch_steps
from stepgrpo_core.calibration import initial_psi
from stepgrpo_core.rollout import rollout, step_log_prob

SIGMAS = torch.tensor([1.0, 0.95, 0.85, 0.7, 0.5, 0.3, 0.0])  # T = 6
P, G, T = 3, 4, 6


def velocity(x, sigma, cond):
    """A model-like field that reads its conditioning rows (a row mix-up would show)."""
    return torch.tanh(x) * cond["scale"].reshape(-1, 1, 1, 1) + sigma.reshape(-1, 1, 1, 1) * x


class Counted:
    def __init__(self) -> None:
        self.rows = 0

    def __call__(self, x, sigma, cond):
        self.rows += x.shape[0]
        return velocity(x, sigma, cond)


def make(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(P, 2, 3, 3, generator=g)
    cond = {"scale": torch.linspace(0.5, 1.5, P).repeat_interleave(G)}  # a group's members share it
    return x0, cond


@pytest.mark.parametrize("kernel", ["flow", "cps", "psi"])
def test_the_prefix_is_shared_and_counted_once_and_each_state_is_its_step_run_alone(kernel):
    x0, cond = make()
    branch = torch.tensor([0, 2, 4])
    noise = initial_psi(SIGMAS) if kernel == "psi" else 0.7
    counted = Counted()
    out = branched_rollout(counted, x0, SIGMAS, cond, G, branch, kernel, noise, torch.Generator().manual_seed(1))
    # the prefix once a group: b rows and the velocity at x_b, then G (T - b - 1)
    expected = sum(b + 1 + G * (T - b - 1) for b in branch.tolist())
    assert out.nfe == counted.rows == expected < P * G * T
    for g, b in enumerate(branch.tolist()):
        rows = slice(g * G, (g + 1) * G)
        members = out.states[rows]
        # before the branch every member holds the group's ODE path from its initial noise
        ode = rollout(velocity, x0[g : g + 1], SIGMAS, {"scale": cond["scale"][g * G : g * G + 1]}, kernel="ode")
        torch.testing.assert_close(members[:, : b + 1], ode.states[:, : b + 1].expand(G, -1, -1, -1, -1))
        # at the branch the members part (each its own noise) ...
        assert len({tuple(m.flatten().tolist()) for m in members[:, b + 1]}) == G
        # ... and after it each follows the ODE from its own x_{b+1}
        rest = rollout(velocity, members[:, b + 1], SIGMAS[b + 1 :], {"scale": cond["scale"][rows]}, kernel="ode")
        torch.testing.assert_close(members[:, b + 1 :], rest.states)
        # only the branch step has a density, and the stored transition reproduces it
        lp = out.log_probs[rows]
        assert bool(torch.isfinite(lp[:, b]).all()) and int(torch.isfinite(lp).sum()) == G
        again = step_log_prob(velocity, members, SIGMAS, {"scale": cond["scale"][rows]}, b, kernel, noise)
        torch.testing.assert_close(again.log_prob, lp[:, b])


def test_the_same_seed_gives_the_same_tree_and_another_another():
    x0, cond = make()
    branch = torch.tensor([1, 1, 3])
    a = branched_rollout(velocity, x0, SIGMAS, cond, G, branch, generator=torch.Generator().manual_seed(5))
    b = branched_rollout(velocity, x0, SIGMAS, cond, G, branch, generator=torch.Generator().manual_seed(5))
    c = branched_rollout(velocity, x0, SIGMAS, cond, G, branch, generator=torch.Generator().manual_seed(6))
    assert torch.equal(a.states, b.states) and not torch.equal(a.states, c.states)


def test_bad_branches_are_refused_with_the_fix():
    x0, cond = make()
    with pytest.raises(ValueError, match=r"\[0, T\) = \[0, 6\)"):
        branched_rollout(velocity, x0, SIGMAS, cond, G, torch.tensor([0, 6, 1]))
    with pytest.raises(ValueError, match="one step per group"):
        branched_rollout(velocity, x0, SIGMAS, cond, G, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="deterministic"):
        branched_rollout(velocity, x0, SIGMAS, cond, G, torch.tensor([0, 1, 2]), kernel="ode")
    with pytest.raises(ValueError, match="ode_solver: euler"):
        branched_rollout(velocity, x0, SIGMAS, cond, G, torch.tensor([0, 1, 2]), ode_step=lambda k, x, v: x)
    with pytest.raises(ValueError, match="empty"):
        draw_branch_steps((3, 3), 4, torch.Generator())


def test_branch_steps_are_drawn_uniformly_from_their_window():
    steps = draw_branch_steps((1, 4), 3000, torch.Generator().manual_seed(0))
    assert set(steps.tolist()) == {1, 2, 3}
    counts = torch.bincount(steps, minlength=4)[1:].float()
    assert float((counts / 3000 - 1 / 3).abs().max()) < 0.03


def test_a_tree_computes_each_node_once_and_stores_each_branch_transition_once():
    from stepgrpo_core.branching import tree_rollout

    x0, _ = make()
    tree = [(1, 2), (3, 2)]  # G = 4 leaves a group: 2 children at step 1, each 2 at step 3
    cond = {"scale": torch.linspace(0.5, 1.5, P).repeat_interleave(4)}
    counted = Counted()
    out = tree_rollout(counted, x0, SIGMAS, cond, tree, generator=torch.Generator().manual_seed(2))
    # each node's velocity once (a split's children share their parent's): the root at steps 0-1,
    # the 2 children at steps 2-3, the 4 leaves at steps 4-5, a group
    assert out.nfe == counted.rows == P * (1 * 2 + 2 * 2 + 4 * 2)
    for g in range(P):
        leaves = out.states[g * 4 : (g + 1) * 4]
        assert bool((leaves[:, :2] == leaves[:1, :2]).all())  # the root's path, to x_1
        assert torch.equal(leaves[0, :4], leaves[1, :4]) and torch.equal(leaves[2, :4], leaves[3, :4])  # siblings
        assert not torch.equal(leaves[0, 2], leaves[2, 2])  # the two children of the first branch part
        assert not torch.equal(leaves[0, 4], leaves[1, 4])  # and each child's two at the second
        lp = out.log_probs[g * 4 : (g + 1) * 4]
        # step 1: one transition per child (leaves 0 and 2); step 3: one per leaf
        assert torch.isfinite(lp[:, 1]).tolist() == [True, False, True, False]
        assert torch.isfinite(lp[:, 3]).tolist() == [True] * 4
        assert int(torch.isfinite(lp).sum()) == 6
        rows = slice(g * 4, (g + 1) * 4)
        again = step_log_prob(velocity, leaves, SIGMAS, {"scale": cond["scale"][rows]}, 3, "flow", 0.7)
        torch.testing.assert_close(again.log_prob, lp[:, 3])
        rest = rollout(velocity, leaves[:, 4], SIGMAS[4:], {"scale": cond["scale"][rows]}, kernel="ode")
        torch.testing.assert_close(leaves[:, 4:], rest.states)
    with pytest.raises(ValueError, match="steps increasing"):
        tree_rollout(velocity, x0, SIGMAS, cond, [(3, 2), (1, 2)])


def test_the_tree_advantage_is_each_node_s_mean_leaf_reward_normalized_over_its_depth():
    """BranchGRPO's estimator by hand on one group of 4 leaves, split at steps 1 and 3 (T = 4)."""
    from stepgrpo_core.credit import STD_EPS, assign

    R = torch.tensor([1.0, 2.0, 3.0, 5.0])
    rewards = torch.zeros(4, 5)
    rewards[:, -1] = R
    out = assign("tree", rewards, torch.zeros(4, dtype=torch.long), tree=[(1, 2), (3, 2)])
    # depth 1: the two children hold leaves (1, 2) and (3, 5): means 1.5 and 4, normalized -1 and +1
    d1 = torch.tensor([1.5, 1.5, 4.0, 4.0])
    torch.testing.assert_close(out.advantages[:, 1], (d1 - 2.75) / (1.25 + STD_EPS))
    # depth 2: the leaves themselves, normalized over the group's 4
    std = float(R.std(correction=0))
    torch.testing.assert_close(out.advantages[:, 3], (R - 2.75) / (std + STD_EPS))
    assert bool((out.advantages[:, [0, 2]] == 0).all())  # no branch there, no density, no credit
    with pytest.raises(ValueError, match="sampler.branch_tree"):
        assign("tree", rewards, torch.zeros(4, dtype=torch.long))


def test_a_tree_s_other_stochastic_steps_are_each_node_s_one_child():
    """`sampler.tree_sde` (BranchGRPO's own rollouts, stochastic at every step): a factor-1 step is
    each node's kernel step, its density stored once at the node's first leaf; the nodes are still
    computed once, and the tree advantage there is the node's, 0 before the first split (one node)."""
    from stepgrpo.config import validate_config
    from stepgrpo_core.branching import tree_rollout
    from stepgrpo_core.credit import assign

    cfg = validate_config({"sampler": {"steps": T, "branch_tree": [[1, 2], [3, 2]], "tree_sde": [0, T]}})
    tree = cfg.sampler.tree()
    assert tree == [(0, 1), (1, 2), (2, 1), (3, 2), (4, 1), (5, 1)] and cfg.sampler.window() == (0, T)
    x0, _ = make()
    cond = {"scale": torch.linspace(0.5, 1.5, P).repeat_interleave(4)}
    counted = Counted()
    out = tree_rollout(counted, x0, SIGMAS, cond, tree, generator=torch.Generator().manual_seed(2))
    assert out.nfe == counted.rows == P * (1 * 2 + 2 * 2 + 4 * 2)  # as the ODE between the splits costs
    for g in range(P):
        rows = slice(g * 4, (g + 1) * 4)
        leaves, lp = out.states[rows], out.log_probs[rows]
        assert torch.isfinite(lp).tolist() == [
            [True, True, True, True, True, True],
            [False, False, False, True, True, True],
            [False, True, True, True, True, True],
            [False, False, False, True, True, True],
        ]  # the root's steps at leaf 0, a child's at its first leaf, a leaf's own from step 3
        for k in range(T):
            again = step_log_prob(velocity, leaves, SIGMAS, {"scale": cond["scale"][rows]}, k, "flow", 0.7)
            has = torch.isfinite(lp[:, k])
            torch.testing.assert_close(again.log_prob[has], lp[has, k])
    R = torch.tensor([1.0, 2.0, 3.0, 5.0])
    rewards = torch.zeros(4, T + 1)
    rewards[:, -1] = R
    adv = assign("tree", rewards, torch.zeros(4, dtype=torch.long), tree=tree).advantages
    assert bool((adv[:, 0] == 0).all())  # the root alone at its depth
    torch.testing.assert_close(adv[:, 2], adv[:, 1])  # the children's values again
    torch.testing.assert_close(adv[:, 4], adv[:, 3])  # the leaves' values after the last split
    torch.testing.assert_close(adv[:, 5], adv[:, 3])


def test_width_pruning_by_hand():
    """BranchGRPO's width pruning on a group of 4 leaves whose last split is at step 1 (T = 4):
    the trained transitions after it (steps 2 and 3 of every leaf) are cut; those up to it stay."""
    from stepgrpo_core.branching import width_pruned

    tree = [(0, 2), (1, 2), (2, 1), (3, 1)]
    has = torch.ones(4, 4, dtype=torch.bool)
    has[[1, 3], 0] = False  # step 0's two children live at leaves 0 and 2
    adv = torch.tensor(
        [
            [9.0, 9.0, 0.5, 0.7],
            [0.0, 9.0, -1.0, 2.0],
            [9.0, 9.0, 0.1, 0.1],
            [0.0, 9.0, -3.0, 1.0],
        ]
    )
    one = torch.zeros(4, dtype=torch.long)
    # per_branch, half: each leaf keeps its better step of 2 (leaf 2's tie: the earlier step)
    kept = width_pruned(has, adv, one, tree, "per_branch", 0.5)
    assert kept[:, 2:].tolist() == [[False, True], [False, True], [True, False], [False, True]]
    assert torch.equal(kept[:, :2], has[:, :2])
    # extremes, half: of the 8, the best 2 (2.0, 1.0) and the worst 2 (-3.0, -1.0)
    kept = width_pruned(has, adv, one, tree, "extremes", 0.5)
    assert kept[:, 2:].tolist() == [[False, False], [True, True], [False, False], [True, True]]
    # extremes keeps at least 2; a share of 1 keeps every one; groups are pruned apart
    assert int(width_pruned(has, adv, one, tree, "extremes", 0.01)[:, 2:].sum()) == 2
    assert torch.equal(width_pruned(has, adv, one, tree, "extremes", 1.0), has)
    two = torch.cat([has, has]), torch.cat([adv, adv]), torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    both = width_pruned(*two[:2], two[2], tree, "extremes", 0.5)
    assert torch.equal(both[:4], kept) and torch.equal(both[4:], kept)
    with pytest.raises(ValueError, match="per_branch or extremes"):
        width_pruned(has, adv, one, tree, "widest", 0.5)


@pytest.mark.parametrize("kernel", ["flow", "psi"])
def test_an_anchor_is_computed_once_and_its_children_are_its_steps_run_one_by_one(kernel):
    """G2RPO's / Step-GRPO's sampling: each group's ODE anchor once, through the velocity at its last
    branch state; 2 children at each of steps 1 and 3, each the kernel's step from the anchor's
    state with the anchor's velocity, then the ODE."""
    from stepgrpo_core.branching import anchor_rollout, branch_steps_of

    x0, _ = make()
    steps, k = [1, 3], 2  # G = 4 a group
    cond = {"scale": torch.linspace(0.5, 1.5, P).repeat_interleave(4)}
    noise = initial_psi(SIGMAS) if kernel == "psi" else 0.7
    counted = Counted()
    out = anchor_rollout(counted, x0, SIGMAS, cond, steps, k, kernel, noise, torch.Generator().manual_seed(3))
    # the anchor: rows at states 0..3 (4); children: 2 x (T - 2) after step 1, 2 x (T - 4) after step 3
    assert out.nfe == counted.rows == P * (4 + k * (T - 2) + k * (T - 4))
    assert branch_steps_of(out.log_probs).reshape(P, 4).tolist() == [[1, 1, 3, 3]] * P
    for g in range(P):
        one = {"scale": cond["scale"][g * 4 : g * 4 + 1]}
        anchor = rollout(velocity, x0[g : g + 1], SIGMAS, one, kernel="ode")
        members = out.states[g * 4 : (g + 1) * 4]
        for j, b in enumerate([1, 1, 3, 3]):
            torch.testing.assert_close(members[j, : b + 1], anchor.states[0, : b + 1])  # the anchor's path
            rows = {"scale": cond["scale"][g * 4 + j : g * 4 + j + 1]}
            rest = rollout(velocity, members[j : j + 1, b + 1], SIGMAS[b + 1 :], rows, kernel="ode")
            torch.testing.assert_close(members[j : j + 1, b + 1 :], rest.states)  # the ODE after the branch
            again = step_log_prob(velocity, members[j : j + 1], SIGMAS, rows, b, kernel, noise)
            torch.testing.assert_close(again.log_prob, out.log_probs[g * 4 + j, b : b + 1])
        assert not torch.equal(members[0, 2], members[1, 2]) and not torch.equal(members[2, 4], members[3, 4])
    with pytest.raises(ValueError, match="increasing within"):
        anchor_rollout(velocity, x0, SIGMAS, cond, [3, 1], k)
    with pytest.raises(ValueError, match="deterministic"):
        anchor_rollout(velocity, x0, SIGMAS, cond, [1, 3], k, kernel="ode")


def test_the_sibling_schemes_by_hand():
    """G2RPO's multi-granularity sum and Step-GRPO's local advantage on one group of 4: two siblings
    branching at step 0, two at step 2 (T = 4), each z-scored among its own siblings alone."""
    from stepgrpo_core.credit import STD_EPS, assign

    rewards = torch.tensor(
        [
            [0.0, 1.0, 9.0, 9.0, 2.0],  # branch 0: R_1 = 1, R_T = 2
            [0.0, 3.0, 9.0, 9.0, 1.0],  # branch 0: R_1 = 3, R_T = 1
            [0.0, 0.0, 0.0, 5.0, 4.0],  # branch 2: R_3 = 5, R_T = 4
            [0.0, 0.0, 0.0, 5.0, 8.0],  # branch 2: R_3 = 5 (a tie), R_T = 8
        ]
    )
    groups, branch = torch.zeros(4, dtype=torch.long), torch.tensor([0, 0, 2, 2])

    def z(lo: float, hi: float) -> float:
        """Two siblings z-score to -z and +z: half their gap over the population std (that half) + eps."""
        half = (hi - lo) / 2
        return half / (half + STD_EPS)

    local = assign("local", rewards, groups, branch=branch).advantages
    expected = torch.zeros(4, 4)
    expected[0, 0], expected[1, 0] = -z(1, 3), z(1, 3)  # R_1: 1 < 3
    torch.testing.assert_close(local, expected)  # step 2's siblings tie on R_3: 0
    granular = assign("granular", rewards, groups, branch=branch).advantages
    expected[0, 0], expected[1, 0] = -z(1, 3) + z(1, 2), z(1, 3) - z(1, 2)  # R_T: 2 > 1 against R_1's order
    expected[2, 2], expected[3, 2] = -z(4, 8), z(4, 8)  # R_3 ties, R_T: 4 < 8
    torch.testing.assert_close(granular, expected)
    with pytest.raises(ValueError, match="sampler.branch_anchor"):
        assign("local", rewards, groups)
