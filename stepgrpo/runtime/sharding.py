"""How a stage splits into shards of whole blocks.

A stage's work is a sequence of *blocks*: the rows one batched model call computes together
(`block_rows`). Batched kernels are not batch-invariant on CPU or GPU (a row's output moves in the
last bits with the rows beside it), so a shard holds whole blocks and every block is computed
alone, exactly as the in-process stage computes it: a shard's bytes never depend on how many
shards there are. Seeds are per group and per model call (`stepgrpo.loops.sampling`), never a stream
that runs across shards.

A shard that finished records it in its stage's ledger (`stepgrpo.storage.ledger`), so a stage interrupted
half-way resumes with only the unfinished shards.
"""

from __future__ import annotations

import math

from stepgrpo.config import Config


def groups_per_call(cfg: Config) -> int:
    """Prompt groups the rollout samples in one model call (`model.max_batch` rows, whole groups)."""
    return max(1, cfg.model.max_batch // cfg.run.group_size)


def block_rows(cfg: Config) -> int:
    """Trajectories of one block: whole rollout calls and whole `max_batch` completion/score calls."""
    return math.lcm(groups_per_call(cfg) * cfg.run.group_size, max(1, cfg.model.max_batch))


def check_shards(cfg: Config) -> None:
    """`scale.groups_per_shard` must hold whole blocks (a ValueError naming the valid sizes)."""
    n = cfg.scale.groups_per_shard
    unit = block_rows(cfg) // cfg.run.group_size
    if n and n % unit:
        raise ValueError(
            f"scale.groups_per_shard={n} would split a model call: one call takes {unit} group(s) "
            f"(model.max_batch={cfg.model.max_batch} rows of run.group_size={cfg.run.group_size}); use a multiple "
            f"of {unit}, or lower model.max_batch"
        )


def shard_ranges(cfg: Config, rows: int, block: int | None = None) -> list[range]:
    """The shards of a stage of `rows` trajectories (`block` rows a block): ranges of whole blocks.

    `scale.groups_per_shard` groups a shard; else in-process one shard, on Ray one a worker."""
    block = block or block_rows(cfg)
    size = blocks_per_shard(cfg, math.ceil(rows / block), block) * block
    return [range(s, min(rows, s + size)) for s in range(0, rows, size)]


def blocks_per_shard(cfg: Config, n_blocks: int, block: int) -> int:
    """How many of a stage's `n_blocks` blocks of `block` rows go in one shard."""
    if cfg.scale.groups_per_shard:
        return max(1, cfg.scale.groups_per_shard * cfg.run.group_size // block)
    if cfg.scale.workers == "process":
        return max(1, n_blocks)
    return max(1, math.ceil(n_blocks / cfg.scale.num_workers))


def blocks(shard: range, block: int) -> list[range]:
    """The blocks of `shard` (its first row is a block boundary)."""
    return [range(s, min(shard.stop, s + block)) for s in range(shard.start, shard.stop, block)]
