"""Credit schemes (METHODS.md, "Credit schemes"): invariants, hand-worked turning points, and
every vectorized scheme against a plain-loop reference written out below."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stepgrpo_core.credit import SCHEMES, STD_EPS, assign, scheme_options, turning_point_rewards, turning_points

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)


# --- plain-loop references (python floats, one value at a time) ------------------------------


def sign(x):
    return (x > 0) - (x < 0)


def ref_normalize(values):
    """Population-std normalization; a constant list is exactly 0 (no signal)."""
    if all(v == values[0] for v in values):
        return [0.0] * len(values)
    m = sum(values) / len(values)
    sd = (sum((v - m) ** 2 for v in values) / len(values)) ** 0.5
    return [(v - m) / (sd + STD_EPS) for v in values]


def ref_groups(gids):
    groups = {}
    for b, gid in enumerate(gids):
        groups.setdefault(gid, []).append(b)
    return list(groups.values())


def ref_per_group_step(values, gids):
    """Normalize each column k within each group."""
    out = [[0.0] * len(values[0]) for _ in values]
    for rows in ref_groups(gids):
        for k in range(len(values[0])):
            for b, a in zip(rows, ref_normalize([values[b][k] for b in rows])):
                out[b][k] = a
    return out


def ref_turning(R, consistency=True, first_step=True, balance=True, balance_over=9):
    B, T = len(R), len(R[0]) - 1
    step = [[R[b][k + 1] - R[b][k] for k in range(T)] for b in range(B)]
    turn = [[False] * T for _ in range(B)]
    for b in range(B):
        delta = R[b][T] - R[b][0]
        s = [sign(step[b][k]) * sign(delta) for k in range(T)]
        for k in range(T):
            if k == 0:
                ok = first_step and s[0] > 0
            else:
                ok = s[k - 1] < 0 and s[k] > 0
            if ok and consistency:
                ok = sign(step[b][k]) * sign(R[b][T] - R[b][k + 1]) > 0
            turn[b][k] = ok
    if balance:  # by the trajectory's delta, per sampling mini-batch; a one-signed batch keeps all
        size = B if balance_over == "iteration" else balance_over
        for lo in range(0, B, size):
            batch = range(lo, min(B, lo + size))
            points = [(R[b][T] - R[b][0], b * T + k) for b in batch for k in range(T) if turn[b][k]]
            pos = sorted((-abs(d), i) for d, i in points if d > 0)
            neg = sorted((-abs(d), i) for d, i in points if d < 0)
            if pos and neg:
                n = min(len(pos), len(neg))
                kept = {i for _, i in pos[:n]} | {i for _, i in neg[:n]}
                for b in batch:
                    turn[b] = [b * T + k in kept for k in range(T)]
    for b in range(B):
        for k in range(T):
            if turn[b][k]:
                step[b][k] = R[b][T] - R[b][k]
    return step, turn


def ref_assign(scheme, R, gids, **opts):
    """Returns (advantages, turning mask, keep, zero_std_groups)."""
    B, T = len(R), len(R[0]) - 1
    gains = [[R[b][k + 1] - R[b][k] for k in range(T)] for b in range(B)]
    turn = [[False] * T for _ in range(B)]
    if scheme == "outcome":
        final = [R[b][T] for b in range(B)]
        adv = [0.0] * B
        for rows in ref_groups(gids):
            if opts.get("global_std", True):
                m = sum(final[b] for b in rows) / len(rows)
                sd = (sum((f - sum(final) / B) ** 2 for f in final) / B) ** 0.5
                same = all(final[b] == final[rows[0]] for b in rows)
                for b in rows:
                    adv[b] = 0.0 if same else (final[b] - m) / (sd + STD_EPS)
            else:
                for b, a in zip(rows, ref_normalize([final[b] for b in rows])):
                    adv[b] = a
        A = [[adv[b]] * T for b in range(B)]
    elif scheme == "stepwise":
        trained = opts.get("trained", [True] * T)
        cols = [k for k in range(T) if trained[k]]
        values = [[gains[b][k] for k in cols] for b in range(B)]
        if opts.get("baseline", False):  # each group's mean gain per step subtracted first
            for rows in ref_groups(gids):
                for j in range(len(cols)):
                    m = sum(values[b][j] for b in rows) / len(rows)
                    for b in rows:
                        values[b][j] -= m
        flat = ref_normalize([v for row in values for v in row])
        A = [[0.0] * T for _ in range(B)]
        for b in range(B):
            for j, k in enumerate(cols):
                A[b][k] = flat[b * len(cols) + j]
    elif scheme == "dense":
        A = ref_per_group_step(gains, gids)
    else:
        step, turn = ref_turning(R, **opts)
        A = ref_per_group_step(step, gids)
    keep = [True] * B
    dropped = 0
    for rows in ref_groups(gids):
        if all(A[b][k] == 0 for b in rows for k in range(T)):
            dropped += 1
            for b in rows:
                keep[b] = False
    return A, turn, keep, dropped


# --- random inputs ---------------------------------------------------------------------------


@st.composite
def batches(draw, dyadic=True):
    """Rewards [B, T+1] and shuffled, non-contiguous group ids; dyadic rewards (k / 8) make
    every gain exact in fp32 and fp64 and produce ties (sign(0), constant groups)."""
    sizes = draw(st.lists(st.integers(1, 5), min_size=1, max_size=4))
    T = draw(st.integers(1, 6))
    gids = [10 * g + 3 for g, n in enumerate(sizes) for _ in range(n)]
    gids = draw(st.permutations(gids))
    B = len(gids)
    if dyadic:
        R = [[draw(st.integers(-8, 8)) / 8 for _ in range(T + 1)] for _ in range(B)]
    else:
        seed = draw(st.integers(0, 2**16))
        R = torch.rand(B, T + 1, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).tolist()
    return R, gids


OPTIONS = [
    ("outcome", {}),
    ("outcome", {"global_std": False}),
    ("stepwise", {}),
    ("stepwise", {"baseline": True}),
    ("dense", {}),
    ("turning_point", {}),
    ("turning_point", {"balance_over": 2}),
    ("turning_point", {"balance_over": "iteration"}),
    ("turning_point", {"consistency": False}),
    ("turning_point", {"first_step": False}),
    ("turning_point", {"balance": False}),
    ("turning_point", {"consistency": False, "first_step": False, "balance": False}),
]


def check_against_reference(R, gids, scheme, opts, exact_masks=True):
    rewards = torch.tensor(R, dtype=torch.float32)
    credit = assign(scheme, rewards, torch.tensor(gids), **opts)
    # the reference sees the same fp32 values
    A, turn, keep, dropped = ref_assign(scheme, rewards.double().tolist(), gids, **opts)
    torch.testing.assert_close(credit.advantages, torch.tensor(A, dtype=torch.float32), atol=2e-4, rtol=1e-4)
    if exact_masks:
        assert credit.turning_mask.tolist() == turn
        assert credit.keep.tolist() == keep and credit.zero_std_groups == dropped
        assert credit.zero_std_ratio == pytest.approx(dropped / len(set(gids)))


@SETTINGS
@given(batches(), st.sampled_from(OPTIONS))
def test_vectorized_equals_loop_on_tied_rewards(batch, scheme_opts):
    check_against_reference(*batch, *scheme_opts)


@SETTINGS
@given(batches(dyadic=False), st.sampled_from(OPTIONS))
def test_vectorized_equals_loop_on_continuous_rewards(batch, scheme_opts):
    check_against_reference(*batch, *scheme_opts)


# --- invariants -------------------------------------------------------------------------------


@SETTINGS
@given(batches(dyadic=False))
def test_gains_telescope(batch):
    R, gids = batch
    rewards = torch.tensor(R)
    credit = assign("dense", rewards, torch.tensor(gids))
    torch.testing.assert_close(credit.gains.sum(1), rewards[:, -1] - rewards[:, 0], atol=1e-5, rtol=0)


def random_batch(groups=4, size=6, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(groups * size, T + 1, generator=g), torch.arange(groups).repeat_interleave(size)


def test_stepwise_zero_mean_unit_std_over_all_entries():
    rewards, gids = random_batch()
    A = assign("stepwise", rewards, gids).advantages
    assert abs(A.mean().item()) < 1e-6
    # std / (std + 1e-4) with std ~ 1.4: 1 within 1e-4
    assert A.std(correction=0).item() == pytest.approx(1.0, abs=1e-3)
    # not per step: columns need not be standardized
    assert A.mean(0).abs().max() > 1e-2


def test_dense_zero_mean_per_group_and_step():
    rewards, gids = random_batch()
    A = assign("dense", rewards, gids).advantages
    for grp in range(4):
        torch.testing.assert_close(A[gids == grp].mean(0), torch.zeros(5), atol=1e-6, rtol=0)
        torch.testing.assert_close(A[gids == grp].std(0, correction=0), torch.ones(5), atol=1e-3, rtol=0)


def test_outcome_constant_along_steps():
    rewards, gids = random_batch()
    for global_std in (True, False):
        A = assign("outcome", rewards, gids, global_std=global_std).advantages
        assert torch.equal(A, A[:, :1].expand_as(A))
        for grp in range(4):
            assert abs(A[gids == grp, 0].mean().item()) < 1e-6
    # global std: divided by the std of all final rewards of the batch
    final = rewards[:, -1]
    group_mean = final.reshape(4, 6).mean(1).repeat_interleave(6)
    expected = (final - group_mean) / (final.std(correction=0) + STD_EPS)
    torch.testing.assert_close(assign("outcome", rewards, gids).advantages[:, 0], expected)


def test_zero_std_groups_are_dropped_and_counted():
    rewards, gids = random_batch(groups=3, size=4)
    rewards[gids == 1] = rewards[gids == 1][0]  # group 1: identical trajectories
    # stepwise normalizes over the whole batch, so a constant group still has nonzero gains
    # relative to the batch and is kept; every group-relative scheme drops it.
    assert assign("stepwise", rewards, gids).zero_std_groups == 0
    for scheme in ("outcome", "dense", "turning_point"):
        credit = assign(scheme, rewards, gids)
        assert credit.keep.tolist() == [True] * 4 + [False] * 4 + [True] * 4, scheme
        assert credit.zero_std_groups == 1 and credit.zero_std_ratio == pytest.approx(1 / 3)
        assert (credit.advantages[gids == 1] == 0).all()
    # outcome also drops a group whose final rewards tie, even if the intermediate ones differ
    rewards[gids == 2, -1] = 0.25
    assert assign("outcome", rewards, gids).zero_std_groups == 2
    assert assign("dense", rewards, gids).zero_std_groups == 1


# --- turning points, worked by hand (T = 4, rewards R_0 .. R_4) -------------------------------
# g = R_{k+1} - R_k, delta = R_4 - R_0, s_k = sign(g_k) sign(delta).

A_ = [0, -1, 1, 2, 3]  # g = [-1, 2, 1, 1], s = [-, +, +, +]: step 1 turns; R_4 - R_2 = 2 > 0 agrees
B_ = [0, -1, 2, 3, 1]  # g = [-1, 3, 1, -2]: step 1 flips but R_4 - R_2 = -1 disagrees (consistency)
C_ = [0, 1, 0.5, 2, 3]  # g = [1, -0.5, 1.5, 1], s = [+, -, +, +]: step 0 (first-step rule) and step 2
D_ = [0, -1, 3, 3, 3]  # g = [-1, 4, 0, 0]: step 1 flips but R_4 - R_2 = 0, sign(0) = 0: a tie
E_ = [1, 0, 2, 1, 1]  # delta = 0: every s_k = 0, nothing ever turns
F_ = [0, 1, -1, -2, -3]  # delta < 0, g = [1, -2, -1, -1], s = [-, +, +, +]: step 1 turns, R_4 - R_1 = -4


def tp(rows, **opts):
    step, turn = turning_point_rewards(torch.tensor(rows, dtype=torch.float32), **opts)
    return step.tolist(), turn.tolist()


def test_turning_point_and_aggregated_reward():
    step, turn = tp([A_], balance=False)
    assert turn == [[False, True, False, False]]
    assert step == [[-1, 4, 1, 1]]  # step 1: R_4 - R_1 = 3 - (-1) = 4 replaces g_1 = 2


def test_consistency_rule():
    assert tp([B_], balance=False)[1] == [[False] * 4]
    step, turn = tp([B_], balance=False, consistency=False)
    assert turn == [[False, True, False, False]] and step == [[-1, 2, 1, -2]]  # R_4 - R_1 = 2


def test_first_step_rule():
    step, turn = tp([C_], balance=False)
    assert turn == [[True, False, True, False]]
    assert step == [[3, -0.5, 2.5, 1]]  # R_4 - R_0 = 3, R_4 - R_2 = 2.5
    assert tp([C_], balance=False, first_step=False)[1] == [[False, False, True, False]]


def test_ties_never_qualify():
    assert tp([D_], balance=False)[1] == [[False] * 4]  # sign(R_4 - R_2) = sign(0) = 0
    assert tp([D_], balance=False, consistency=False)[1] == [[False, True, False, False]]
    assert tp([E_], balance=False, consistency=False)[1] == [[False] * 4]  # sign(delta) = 0


def test_negative_trend():
    step, turn = tp([F_], balance=False)
    assert turn == [[False, True, False, False]] and step[0][1] == -4


Y_ = [0, 2, 1, 3, 4]  # delta = 4, g = [2, -1, 2, 1], s = [+, -, +, +]: steps 0 and 2 turn (R_4 - R_k = 4, 3)


def test_balancing_keeps_equal_numbers_of_each_sign_ranked_by_the_trajectory_delta():
    # Turning points: A_ step 1 (delta +3), C_ steps 0 and 2 (delta +3), F_ step 1 (delta -3).
    # 3 positive, 1 negative: one of each is kept; equal |delta|: the earlier position wins (A_).
    step, turn = tp([A_, C_, F_])
    assert turn == [[False, True, False, False], [False] * 4, [False, True, False, False]]
    assert step[0] == [-1, 4, 1, 1] and step[1] == [1, -0.5, 1.5, 1]  # C_'s revert to their gains
    # Ranked by the trajectory's R_T - R_0, not the turning point's R_T - R_k: A_ step 1 and Y_
    # step 0 both aggregate to +4, but Y_'s delta (4) beats A_'s (3), so Y_ step 0 is the one kept.
    step, turn = tp([A_, Y_, F_])
    assert turn == [[False] * 4, [True, False, False, False], [False, True, False, False]]
    assert step[1] == [4, -1, 2, 1] and step[2] == [1, -4, -1, -1]


def test_a_one_signed_batch_keeps_every_turning_point():
    # Every turning point's trajectory improves (delta > 0): nothing to balance, all kept, as the
    # authors' code does (version 1 of the scheme kept none here).
    step, turn = tp([A_, C_])
    assert turn == [[False, True, False, False], [True, False, True, False]]
    assert step == [[-1, 4, 1, 1], [3, -0.5, 2.5, 1]]
    assert tp([F_, F_])[1] == [[False, True, False, False]] * 2  # all negative: all kept too
    assert tp([B_, E_])[1] == [[False] * 4] * 2  # no turning point at all
    # random one-signed batches of 16 x 10: turning points survive balancing
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        R = torch.randn(16, 11, generator=g).cumsum(1)
        R[:, -1] = R[:, 0] + 0.1 + torch.rand(16, generator=g) * 3 + R[:, :-1].max(1).values.abs()
        before = turning_points(R, R[:, 1:] - R[:, :-1]).sum()
        assert before > 0 and turning_point_rewards(R)[1].sum() == before


def test_turning_point_advantages_are_stored_under_the_scheme_version():
    from stepgrpo.config import load_config
    from stepgrpo.tasks.credit import stored_options

    tp_cfg = load_config(None, ["credit.scheme=turning_point", "completion.method=remaining"])
    assert stored_options(tp_cfg, "shapes", "1")["scheme_version"] == "3"
    dense = load_config(None, ["credit.scheme=dense", "completion.method=remaining"])
    assert "scheme_version" not in stored_options(dense, "shapes", "1")  # version 1: the digest runs made before


def test_turning_point_scheme_normalizes_per_group_and_step():
    rewards = torch.tensor([A_, C_, F_, B_], dtype=torch.float32)
    gids = torch.tensor([0, 0, 1, 1])
    credit = assign("turning_point", rewards, gids)
    step, turn = turning_point_rewards(rewards)
    assert torch.equal(credit.turning_mask, turn)
    for grp in (0, 1):
        rows = step[gids == grp]
        centered = rows - rows.mean(0)
        expected = centered / (rows.std(0, correction=0) + STD_EPS)
        torch.testing.assert_close(credit.advantages[gids == grp], expected)


# --- options and validation -------------------------------------------------------------------


def test_options_are_validated():
    assert scheme_options("turning_point") == {
        "consistency": True,
        "first_step": True,
        "balance": True,
        "balance_over": 9,
    }
    assert scheme_options("stepwise") == {"baseline": False}  # `trained` is context, not an option
    assert scheme_options("outcome") == {"global_std": True}
    rewards, gids = random_batch()
    with pytest.raises(
        TypeError,
        match=r"no option\(s\) \['balanced'\]; valid options: "
        r"\['balance', 'balance_over', 'consistency', 'first_step'\]",
    ):
        assign("turning_point", rewards, gids, balanced=True)
    with pytest.raises(TypeError, match=r"valid options: \['baseline'\]"):
        assign("stepwise", rewards, gids, global_std=True)
    with pytest.raises(KeyError, match=f"known credit schemes: {', '.join(SCHEMES.names())}"):
        assign("grpo", rewards, gids)


def test_inputs_are_validated():
    rewards, gids = random_batch()
    with pytest.raises(ValueError, match=r"\[B, T\+1\]"):
        assign("dense", rewards[:, 0], gids)
    with pytest.raises(ValueError, match="group_ids"):
        assign("dense", rewards, gids[:-1])
    rewards[0, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        assign("dense", rewards, gids)


def test_the_turning_point_count_benchmark_runs():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "credit_schemes" / "turning_points.py"
    done = subprocess.run([sys.executable, str(script), "--batches", "2"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("one-signed") and "v1      [0, 0]" in done.stdout
    before, v2 = lines[1].split(None, 1)[1], lines[3].split(None, 1)[1]
    assert before == v2  # a one-signed batch keeps every turning point


# --- in context: the trained steps, the sampling mini-batch -----------------------------------


def test_stepwise_normalizes_over_the_trained_steps_only():
    # T = 4, steps 0-1 trained (an SDE window of 2): gains [[1, 0, 0, 0], [-1, 0, 0, 0]].
    # Over the 2 x 2 trained entries [1, 0, -1, 0]: mean 0, std sqrt(1/2), so A_0 = +-1 / (0.7071 + 1e-4);
    # over all 2 x 4 entries (version 1) the untrained zeros would shrink the std to 1/2 and give +-2.
    rewards = torch.tensor([[0, 1, 1, 1, 1], [0, -1, -1, -1, -1]], dtype=torch.float32)
    trained = torch.tensor([True, True, False, False])
    A = assign("stepwise", rewards, torch.tensor([0, 1]), trained).advantages
    a = 1 / (0.5**0.5 + STD_EPS)
    torch.testing.assert_close(A, torch.tensor([[a, 0, 0, 0], [-a, 0, 0, 0]]))
    assert assign("stepwise", rewards, torch.tensor([0, 1])).advantages[0, 0] == pytest.approx(1 / (0.5 + STD_EPS))
    # schemes that do not declare `trained` ignore it
    torch.testing.assert_close(
        assign("dense", rewards, torch.tensor([0, 0]), trained).advantages,
        assign("dense", rewards, torch.tensor([0, 0])).advantages,
    )


def test_stepwise_baseline_subtracts_each_groups_mean_gain_per_step():
    # one group of 2: gains [[2, 0], [0, 0]] -> minus the group mean [1, 0] -> [[1, 0], [-1, 0]]
    rewards = torch.tensor([[0, 2, 2], [0, 0, 0]], dtype=torch.float32)
    A = assign("stepwise", rewards, torch.tensor([0, 0]), baseline=True).advantages
    a = 1 / (0.5**0.5 + STD_EPS)  # [1, 0, -1, 0]: std sqrt(1/2)
    torch.testing.assert_close(A, torch.tensor([[a, 0], [-a, 0]]))


def test_turning_points_are_balanced_per_sampling_mini_batch():
    # A_ (delta +3, step 1), C_ (delta +3, steps 0 and 2), F_ (delta -3, step 1).
    # Over the iteration: 3 positive, 1 negative -> one of each kept (A_ and F_).
    assert tp([A_, C_, F_], balance_over="iteration")[1] == [
        [False, True, False, False],
        [False] * 4,
        [False, True, False, False],
    ]
    # Mini-batches of 2 (the authors balance each sampling batch): [A_, C_] is one-signed, so all
    # of its turning points stay; [F_] alone stays too.
    assert tp([A_, C_, F_], balance_over=2)[1] == [
        [False, True, False, False],
        [True, False, True, False],
        [False, True, False, False],
    ]
    # the default mini-batch is the authors' 9 images: 3 rows are one batch
    assert tp([A_, C_, F_])[1] == tp([A_, C_, F_], balance_over="iteration")[1]
    with pytest.raises(ValueError, match="balance_over"):
        tp([A_], balance_over=0)
