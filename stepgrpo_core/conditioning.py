"""Row selection on conditioning pytrees.

The core never looks inside `cond` (ARCHITECTURE.md, "the model interface"): it is a pytree of
dicts, tuples, lists and tensors whose tensor leaves all have the batch as leading dimension `B`.
When the core batches states of several trajectories together (completions, the policy update)
it needs the conditioning rows of those trajectories, in that order; `take` builds them.

Non-tensor leaves (`None`, python numbers, strings) carry no batch dimension and are returned
unchanged, so a policy may keep e.g. a guidance scale inside `cond`.
"""

from __future__ import annotations

from typing import Any

import torch

Cond = Any  # a pytree: dict / tuple / list / NamedTuple of tensors with leading dim B, or None

_SCALAR_LEAVES = (type(None), bool, int, float, complex, str, bytes)


def _map(cond: Cond, fn, path: str = "cond") -> Cond:
    """Apply `fn(tensor, path)` to every tensor leaf, keeping the container types."""
    if isinstance(cond, torch.Tensor):
        return fn(cond, path)
    if isinstance(cond, _SCALAR_LEAVES):
        return cond
    if isinstance(cond, dict):
        return type(cond)((k, _map(v, fn, f"{path}[{k!r}]")) for k, v in cond.items())
    if isinstance(cond, tuple) and hasattr(cond, "_fields"):  # NamedTuple: rebuild by field
        return type(cond)(*(_map(v, fn, f"{path}.{f}") for f, v in zip(cond._fields, cond)))
    if isinstance(cond, (tuple, list)):
        return type(cond)(_map(v, fn, f"{path}[{i}]") for i, v in enumerate(cond))
    raise TypeError(
        f"{path} has type {type(cond).__name__}; conditioning must be a pytree of dict / tuple / "
        "list / tensor (None and python scalars pass through). Wrap other objects in a tensor."
    )


def batch_size(cond: Cond) -> int | None:
    """The common leading dimension of the tensor leaves of `cond`, or None if it has none.

    Raises ValueError when two leaves disagree (the pytree is not batched consistently).
    """
    sizes: dict[str, int] = {}

    def record(t: torch.Tensor, path: str) -> torch.Tensor:
        if t.dim() == 0:
            raise ValueError(f"{path} is a 0-d tensor; every tensor leaf needs a leading batch dim B")
        sizes[path] = t.shape[0]
        return t

    _map(cond, record)
    if not sizes:
        return None
    if len(set(sizes.values())) > 1:
        raise ValueError(f"conditioning leaves disagree on the batch size: {sizes}")
    return next(iter(sizes.values()))


def take(cond: Cond, index: torch.Tensor) -> Cond:
    """Select batch rows `index` (LongTensor `[N]`, repeats allowed) of every tensor leaf.

    `cond` leaves `[B, ...]` -> `[N, ...]`, in the order of `index`. The index is moved to each
    leaf's device, so a CPU index works for CUDA conditioning.
    """
    if not isinstance(index, torch.Tensor) or index.dtype != torch.long or index.dim() != 1:
        raise TypeError("take(cond, index): index must be a 1-d LongTensor of row numbers")

    def select(t: torch.Tensor, path: str) -> torch.Tensor:
        if t.dim() == 0:
            raise ValueError(f"{path} is a 0-d tensor; every tensor leaf needs a leading batch dim B")
        return t.index_select(0, index.to(t.device))

    return _map(cond, select)


def repeat_interleave(cond: Cond, repeats: int) -> Cond:
    """Repeat every row `repeats` times in place (`[B, ...]` -> `[B * repeats, ...]`).

    Row `b` becomes rows `b * repeats .. b * repeats + repeats - 1`: the layout of a group of `G`
    trajectories per prompt (prompt embeddings `[P, ...]` -> conditioning `[P * G, ...]`).
    """
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    return _map(cond, lambda t, path: t.repeat_interleave(repeats, dim=0))


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The bytes of `t` (on the CPU; bf16, which NumPy lacks, as its bits)."""
    t = t.detach().cpu().contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()


def row_digests(cond: Cond, batch: int) -> list[bytes]:
    """A digest of each row `b < batch` of `cond` (its bytes in every tensor leaf): rows with equal
    digests condition a model identically."""
    import hashlib

    hashes = [hashlib.blake2b(digest_size=16) for _ in range(batch)]

    def feed(t: torch.Tensor, path: str) -> torch.Tensor:
        for b in range(batch):
            hashes[b].update(path.encode())
            hashes[b].update(tensor_bytes(t[b]))
        return t

    _map(cond, feed)
    return [h.digest() for h in hashes]
