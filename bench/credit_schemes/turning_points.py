"""How many TP-GRPO turning points survive balancing, under the scheme's version 1 and version 2.

Random reward trajectories `R [16, 11]` (a Gaussian random walk, seeded): "one-signed" batches
have `R_T > R_0` for every trajectory, "mixed" ones are left as drawn. Version 1 (the earlier
rule, re-implemented here) split and ranked by each turning point's `R_T - R_k` and kept none of a
one-signed batch; version 2 (`stepgrpo_core.credit`, as the authors' code) splits and ranks by
the trajectory's `R_T - R_0` and keeps every turning point of a one-signed batch.

    python -m bench.credit_schemes.turning_points [--batches 10] [--seed 0]
"""

from __future__ import annotations

import argparse

import torch

from stepgrpo_core.credit import turning_point_rewards, turning_points


def version_1(turn: torch.Tensor, aggregated: torch.Tensor) -> torch.Tensor:
    flat_turn, flat_agg = turn.reshape(-1), aggregated.reshape(-1)
    pos, neg = flat_turn & (flat_agg > 0), flat_turn & (flat_agg < 0)
    n = int(min(pos.sum(), neg.sum()))
    kept = torch.zeros_like(flat_turn)
    for mask in (pos, neg):
        idx = mask.nonzero().reshape(-1)
        kept[idx[torch.sort(-flat_agg[idx].abs(), stable=True).indices[:n]]] = True
    return kept.reshape(turn.shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args()
    g = torch.Generator().manual_seed(a.seed)
    for kind in ("one-signed", "mixed"):
        counts = []
        for _ in range(a.batches):
            R = torch.randn(16, 11, generator=g).cumsum(1)
            if kind == "one-signed":
                R[:, -1] = R[:, 0] + 0.1 + torch.rand(16, generator=g) * 3 + R[:, :-1].max(1).values.abs()
            turn = turning_points(R, R[:, 1:] - R[:, :-1])
            v1 = int(version_1(turn, R[:, -1:] - R[:, :-1]).sum())
            counts.append((int(turn.sum()), v1, int(turning_point_rewards(R)[1].sum())))
        print(f"{kind} batches of 16 x 10 ({a.batches}): turning points before balancing / kept by v1 / kept by v2")
        for name, i in (("before", 0), ("v1", 1), ("v2", 2)):
            print(f"  {name:7s}", [c[i] for c in counts])


if __name__ == "__main__":
    main()
