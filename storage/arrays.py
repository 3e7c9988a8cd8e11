"""Zarr v3 stage stores: create, write trajectory slices, verify + digest, read.

Zarr itself writes the metadata (`zarr.json`), so every store opens with `zarr.open_group`. The
chunks are written and read here, in exactly the encoding declared in `stepgrpo.storage.schema` (raw
little-endian bytes + crc32c): one `os.writev` per trajectory chunk instead of zarr's codec
pipeline, which copies every chunk twice and is about 4x slower for latents (see bench/storage/storage.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
import zarr
import zarr.api.asynchronous
from zarr.codecs import Crc32cCodec
from zarr.core.sync import sync

from stepgrpo.storage.errors import CorruptChunkError, IncompleteStageError
from stepgrpo.storage.publish import canonical_json, check_json
from stepgrpo.storage.schema import (
    BY_NODE,
    CHECKSUM_BYTES,
    CHUNK_KEY_SEPARATOR,
    DIGEST_FORMAT,
    DIGEST_FORMATS,
    NODE_ROWS,
    ArraySpec,
    StoreSpec,
    array_shape,
    chunk_shape,
    known_digest_format,
    storage_dtype,
    store_sizes,
)

# Chunk writes and reads release the GIL (file I/O, crc32c); a few threads overlap them. Chunks
# smaller than THREAD_MIN_BYTES are done in the calling thread: handing them to a pool costs more.
IO_THREADS = 4
THREAD_MIN_BYTES = 256 * 1024


def _each(fn: Callable[[int], None], n: int, chunk_bytes: int) -> None:
    """Call `fn(0) .. fn(n-1)`, on a thread pool when the chunks are large enough to pay for it."""
    if n > 1 and chunk_bytes >= THREAD_MIN_BYTES:
        with ThreadPoolExecutor(min(IO_THREADS, n)) as pool:
            list(pool.map(fn, range(n)))
    else:
        for i in range(n):
            fn(i)


def _le(dtype: str) -> np.dtype:
    return np.dtype(dtype).newbyteorder("<")


def chunk_file(store: Path, name: str, coords: Sequence[int]) -> Path:
    """Path of one chunk file: `<store>/<array>/c.<i>.<j>...` (default key encoding, '.')."""
    return store / name / CHUNK_KEY_SEPARATOR.join(["c", *map(str, coords)])


def bf16_bits(value: Any, what: str) -> np.ndarray:
    """The bfloat16 bits (`uint16`) of `value` (a torch tensor or a float array) whose values are
    bf16 already: a latent sampled in bf16 is stored as it is; any other value is refused, since
    rounding it would store a tensor other than the one whose log-prob was taken."""
    import torch

    t = value.detach().cpu() if hasattr(value, "detach") else torch.from_numpy(np.asarray(value, dtype=np.float32))
    bf = t.to(torch.bfloat16)
    if t.dtype != torch.bfloat16 and not torch.equal(bf.to(t.dtype), t):
        raise ValueError(f"{what}: the store holds bfloat16 latents, and these values are not bfloat16 ({t.dtype})")
    return bf.view(torch.int16).numpy().view(np.dtype("<u2"))


def bf16_values(bits: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 `bits` (`uint16`): exact, the bits are the top half of a float32."""
    return (bits.astype("<u4") << 16).view("<f4")


class StageStore:
    """One Zarr stage store on disk (published or `.partial`), described by its attrs.

    `attrs` holds the dims (`spec.dims`: `B, T, C, H, W` for latent stores), `latent_dtype`
    (storage dtype, latent stores) and the stage's own attrs (kernel, method, nfe, ...).
    """

    def __init__(
        self,
        path: Path,
        spec: StoreSpec,
        attrs: Mapping[str, Any],
        removed: Mapping[str, str] | None = None,
        limits: Mapping[str, int] | None = None,
    ) -> None:
        self.path = path
        self.removed = dict(removed or {})  # arrays retention pruned -> why (`stepgrpo.storage.retention`)
        self.spec = spec
        self.attrs = dict(attrs)
        try:  # bounded before anything is allocated (`limits`: the run's, `Run.dim_limits`)
            self.sizes = store_sizes(spec, self.attrs, limits)
        except ValueError as err:
            raise CorruptChunkError(f"{path}: {err} (damaged or edited metadata)") from None
        self.B = self.sizes["B"]

    @classmethod
    def open(cls, path: Path, spec: StoreSpec, limits: Mapping[str, int] | None = None) -> StageStore:
        """Attach to an existing store (reads only the group metadata)."""
        group = zarr.open_group(str(path), mode="r", zarr_format=3)
        return cls(path, spec, dict(group.attrs), limits=limits)

    # --- layout -------------------------------------------------------------------------------

    def arrays(self) -> tuple[ArraySpec, ...]:
        """The arrays this store holds: its spec's, less the optional ones it was made without."""
        return tuple(a for a in self.spec.arrays if self.has(a.name))

    def has(self, name: str) -> bool:
        """Whether the store holds array `name` (an optional array is absent from older stores)."""
        spec = self.spec.array(name)
        return not spec.optional or (self.path / name / "zarr.json").is_file()

    def drop_unwritten_optional(self) -> None:
        """Before a publish: an optional array whose writers wrote no chunk at all leaves the store
        (the stage is published without it, as older stores are); one written in part stays, and
        the publish refuses it as incomplete."""
        import shutil

        for spec in self.arrays():
            if spec.optional and spec.per_trajectory:
                if not any(chunk_file(self.path, spec.name, c).exists() for c in self.chunks(spec)):
                    shutil.rmtree(self.path / spec.name)

    def shape(self, name: str) -> tuple[int, ...]:
        return array_shape(self.spec.array(name), self.sizes)

    def dtype(self, name: str) -> np.dtype:
        return _le(storage_dtype(self.spec.array(name), self.attrs.get("latent_dtype", "")))

    def chunks(self, spec: ArraySpec, trajectories: Iterable[int] | None = None) -> list[tuple[int, ...]]:
        """Chunk coordinates of `spec` (only those of `trajectories` for per-trajectory arrays); for
        an array stored by node, the states (velocities) each trajectory owns (none for a
        trajectory whose row table was not written yet)."""
        ndim = len(spec.axes)
        if not spec.per_trajectory:
            return [(0,) * ndim]
        rows = range(self.B) if trajectories is None else trajectories
        if self.by_node(spec):
            table, owned = NODE_ROWS[spec.name], []
            for b in rows:
                if chunk_file(self.path, table, (b, 0)).exists():
                    mine = np.flatnonzero(self._node_rows(spec, [b])[0] == b)
                    owned += [(b, int(k)) + (0,) * (ndim - 2) for k in mine]
            return owned
        return [(b,) + (0,) * (ndim - 1) for b in rows]

    def by_node(self, spec: ArraySpec) -> bool:
        """Whether `spec` is stored by node in this store (`BY_NODE`): one state (velocity) a chunk."""
        return spec.name in NODE_ROWS and self.attrs.get(BY_NODE) is True

    def chunk_shape(self, spec: ArraySpec) -> tuple[int, ...]:
        shape = self.shape(spec.name)
        return (1, 1, *shape[2:]) if self.by_node(spec) else chunk_shape(spec, shape)

    def _node_rows(self, spec: ArraySpec, rows: Sequence[int]) -> np.ndarray:
        """`spec`'s row table for `rows` `[n, T+1]` (`[n, T]`), each entry checked to name a
        trajectory at or before its own."""
        table = self.spec.array(NODE_ROWS[spec.name])
        out = np.empty((len(rows), self.shape(spec.name)[1]), self.dtype(table.name))
        for i, b in enumerate(rows):
            self._read_chunk(table, (b, 0), out[i : i + 1])
        bad = (out < 0) | (out > np.asarray(rows, dtype=np.int64)[:, None])
        if bad.any():
            i = int(np.argwhere(bad)[0][0])
            raise CorruptChunkError(
                f"{self.path.name}/{table.name} of trajectory {rows[i]} names {out[i].tolist()}: each entry must be "
                "a trajectory at or before its own; the stage is damaged: delete it and re-run it"
            )
        return out

    # --- create / write -----------------------------------------------------------------------

    def create(self, whole: Mapping[str, np.ndarray], omit: Sequence[str] = ()) -> None:
        """Write the zarr metadata of every array (less the optional ones in `omit`: the stage is
        made without them) and the one-chunk arrays given in `whole`."""
        check_json(self.attrs, f"{self.spec.kind} attrs")
        if bad := [n for n in omit if not self.spec.array(n).optional]:
            raise ValueError(f"{self.spec.kind}: arrays {bad} are not optional; a stage cannot be made without them")
        # Zarr writes every metadata document; all of them in one call into zarr's event loop (the
        # group with its attrs in one write, the arrays concurrently): one synchronous round trip
        # per array plus one per attribute cost ~2/3 of a small stage's write time.
        sync(self._create_metadata(omit))
        missing = [s.name for s in self.arrays() if not s.per_trajectory and s.name not in whole]
        if missing:
            raise ValueError(f"{self.spec.kind}: arrays {missing} must be given when the stage begins")
        for name, value in whole.items():
            spec = self.spec.array(name)
            if spec.per_trajectory:
                raise ValueError(f"{self.spec.kind}: {name} is written per trajectory, not at begin")
            self._write_chunk(spec, (0,) * len(spec.axes), self._as_stored(name, value, self.shape(name)))

    async def _create_metadata(self, omit: Sequence[str] = ()) -> None:
        group = await zarr.api.asynchronous.open_group(
            store=str(self.path), mode="w", zarr_format=3, attributes=dict(self.attrs)
        )
        await asyncio.gather(
            *(
                group.create_array(
                    spec.name,
                    shape=self.shape(spec.name),
                    dtype=self.dtype(spec.name),
                    chunks=self.chunk_shape(spec),
                    compressors=[Crc32cCodec()],
                    filters=None,
                    fill_value=np.nan if self.dtype(spec.name).kind == "f" else 0,
                    chunk_key_encoding={"name": "default", "separator": CHUNK_KEY_SEPARATOR},
                    dimension_names=list(spec.axes),
                    attributes={"doc": spec.doc},
                    write_data=False,
                )
                for spec in self.spec.arrays
                if spec.name not in omit
            )
        )

    def _bf16(self, name: str) -> bool:
        return self.spec.array(name).dtype == "latent" and self.attrs.get("latent_dtype") == "bfloat16"

    def _as_stored(self, name: str, value: Any, shape: tuple[int, ...]) -> np.ndarray:
        """`value` (NumPy or torch) as a C-contiguous little-endian array of the stored dtype."""
        if self._bf16(name):
            return self._check_shape(name, np.ascontiguousarray(bf16_bits(value, f"{self.spec.kind}.{name}")), shape)
        if hasattr(value, "detach"):  # torch: bf16 has no NumPy dtype, upcast exactly to fp32
            value = value.detach().cpu()
            if str(value.dtype) == "torch.bfloat16":
                value = value.float()
            value = value.numpy()
        return self._check_shape(name, np.ascontiguousarray(np.asarray(value), dtype=self.dtype(name)), shape)

    def _check_shape(self, name: str, arr: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        if arr.shape != shape:
            axes = self.spec.array(name).axes
            raise ValueError(f"{self.spec.kind}.{name}: expected shape {shape} {axes}, got {arr.shape}")
        return arr

    def _write_chunk(self, spec: ArraySpec, coords: tuple[int, ...], chunk: np.ndarray) -> None:
        payload = memoryview(chunk).cast("B")
        checksum = crc32c.crc32c(payload).to_bytes(CHECKSUM_BYTES, "little")
        path = chunk_file(self.path, spec.name, coords)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.writev(fd, [payload, checksum])
        finally:
            os.close(fd)

    def write(self, start: int, arrays: Mapping[str, Any]) -> None:
        """Write trajectories `start .. start+n` of the per-trajectory arrays given.

        Each value has shape `[n, ...]` (the array's shape with `B` replaced by `n`); every chunk
        written is a whole trajectory (or, stored by node, one state of one of them), so writers of
        disjoint ranges never share a chunk.
        """
        jobs: list[tuple[ArraySpec, tuple[int, ...], np.ndarray]] = []
        if tables := set(NODE_ROWS.values()) & set(arrays):
            raise ValueError(f"{self.spec.kind}: {sorted(tables)} are written with their arrays, from their bytes")
        for name, value in arrays.items():
            spec = self.spec.array(name)
            if not spec.per_trajectory:
                raise ValueError(f"{self.spec.kind}.{name} is written when the stage begins, not per trajectory")
            if not self.has(name):
                raise ValueError(f"{self.spec.kind}.{name}: this stage was made without it (an optional array)")
            n = len(value)
            if start < 0 or start + n > self.B:
                raise ValueError(f"{self.spec.kind}.{name}: trajectories {start}..{start + n} outside [0, {self.B})")
            arr = self._as_stored(name, value, (n, *self.shape(name)[1:]))
            if self.by_node(spec):
                jobs += self._node_jobs(spec, start, arr)
                continue
            for i in range(n):
                jobs.append((spec, (start + i,) + (0,) * (arr.ndim - 1), arr[i : i + 1]))
        for spec in {job[0] for job in jobs}:  # per array: chunk sizes differ between arrays
            mine = [job for job in jobs if job[0] is spec]
            _each(lambda i: self._write_chunk(*mine[i]), len(mine), mine[0][2].nbytes)

    def _node_jobs(
        self, spec: ArraySpec, start: int, arr: np.ndarray
    ) -> list[tuple[ArraySpec, tuple[int, ...], np.ndarray]]:
        """`arr [n, T(+1), ...]` of trajectories `start ..` stored by node: each state (velocity)
        that is the same bytes as one before it in this call, at the same step, points to that
        one's chunk in the row table; the others are written, one chunk each. Writers of disjoint
        ranges still never share a chunk: an entry points only into its own call's trajectories."""
        n, K = arr.shape[:2]
        rows = np.empty((n, K), np.int64)
        first: dict[tuple[int, bytes], int] = {}
        jobs = []
        for i in range(n):
            for k in range(K):
                key = (k, hashlib.blake2b(memoryview(arr[i, k]).cast("B"), digest_size=16).digest())
                rows[i, k] = owner = first.setdefault(key, start + i)
                if owner == start + i:
                    jobs.append((spec, (start + i, k) + (0,) * (arr.ndim - 2), arr[i : i + 1, k : k + 1]))
        table = self.spec.array(NODE_ROWS[spec.name])
        return jobs + [(table, (start + i, 0), rows[i : i + 1]) for i in range(n)]

    # --- verify / read ------------------------------------------------------------------------

    def _read_chunk(self, spec: ArraySpec, coords: tuple[int, ...], out: np.ndarray) -> None:
        """Read one chunk into `out` (a C-contiguous view), checking size and crc32c."""
        path = chunk_file(self.path, spec.name, coords)
        where = f"{self.path.name}/{spec.name} chunk {coords}" + (
            f" (trajectory {coords[0]})" if spec.per_trajectory else ""
        )
        buf = memoryview(out).cast("B")
        try:
            with open(path, "rb") as f:
                n = f.readinto(buf)
                checksum = f.read()
        except FileNotFoundError:
            raise CorruptChunkError(f"{where} is missing ({path.name}); re-run the stage") from None
        if n != len(buf) or len(checksum) != CHECKSUM_BYTES:
            raise CorruptChunkError(
                f"{where} has the wrong size ({n + len(checksum)} bytes, expected "
                f"{len(buf) + CHECKSUM_BYTES}): the file is damaged; delete the stage and re-run it"
            )
        if crc32c.crc32c(buf).to_bytes(CHECKSUM_BYTES, "little") != checksum:
            raise CorruptChunkError(
                f"{where} failed its crc32c check: the file is damaged; delete the stage and re-run it"
            )

    def read(self, name: str, trajectories: slice | Sequence[int] | None = None) -> np.ndarray:
        """Read array `name`, all of it or the trajectories selected (per-trajectory arrays only).

        Returns a NumPy array of the stored dtype, e.g. `states` `[n, T+1, C, H, W]` (bf16
        latents as float32, exactly).
        Raises `CorruptChunkError` naming the array and chunk if a checksum fails.
        """
        spec = self.spec.array(name)
        shape = self.shape(name)
        if name in self.removed:
            from stepgrpo.storage.pruned import PrunedError

            raise PrunedError(
                f"{self.path.parent.name}/{self.path.name}: {name} was pruned ({self.removed[name]}); this needs it. "
                "A pruned run still resumes and recomputes advantages (`stepgrpo credit`); to re-score or complete "
                "it again, keep its latents (storage.keep: all) in a new run"
            )
        if not spec.per_trajectory:
            if trajectories is not None:
                raise ValueError(f"{self.spec.kind}.{name} has no trajectory axis to select")
            out = np.empty(shape, self.dtype(name))
            self._read_chunk(spec, (0,) * len(shape), out)
            return out
        rows = (
            list(range(self.B)[trajectories])
            if isinstance(trajectories, slice)
            else (list(range(self.B)) if trajectories is None else [int(b) for b in trajectories])
        )
        bad = [b for b in rows if not 0 <= b < self.B]
        if bad:
            raise IndexError(f"{self.spec.kind}.{name}: trajectories {bad} outside [0, {self.B})")
        out = np.empty((len(rows), *shape[1:]), self.dtype(name))
        if self.by_node(spec):  # each state from the chunk of the trajectory that holds it
            owners = self._node_rows(spec, rows)
            cells = [(i, k) for i in range(len(rows)) for k in range(shape[1])]
            rest = (0,) * (len(shape) - 2)
            _each(
                lambda j: self._read_chunk(
                    spec,
                    (int(owners[cells[j]]), cells[j][1], *rest),
                    out[cells[j][0] : cells[j][0] + 1, cells[j][1] : cells[j][1] + 1],
                ),
                len(cells),
                out[:1, :1].nbytes,
            )
        else:
            coords = self.chunks(spec, rows)
            _each(lambda i: self._read_chunk(spec, coords[i], out[i : i + 1]), len(rows), out[:1].nbytes)
        return bf16_values(out) if self._bf16(name) else out

    def rows_intact(self, rows: range) -> bool:
        """Whether every per-trajectory chunk of `rows` is there and passes its checksum."""
        try:
            for spec in self.arrays():
                if spec.per_trajectory:
                    self.read(spec.name, list(rows))
        except CorruptChunkError:
            return False
        return True

    def missing_trajectories(self) -> dict[str, list[int]]:
        """Per-trajectory arrays -> trajectories whose chunk was never written."""
        missing: dict[str, list[int]] = {}
        for spec in self.arrays():
            if spec.per_trajectory:
                gone = [c[0] for c in self.chunks(spec) if not chunk_file(self.path, spec.name, c).exists()]
                if gone:
                    missing[spec.name] = gone
        return missing

    def verify_and_digest(self, digest_format: int = DIGEST_FORMAT) -> tuple[str, int]:
        """Check every chunk's size and crc32c; return (sha256 hex digest, payload bytes).

        The digest covers, in schema order, each array's name, dtype and shape and its chunks in
        chunk order, then the canonical JSON of the store's attrs. A chunk enters it as its stored
        bytes (`digest_format` 1) or as the sha256 of them (2, the default: the reading threads hash
        their chunks in parallel, where format 1 hashes every byte in one thread). Equal content
        under one schema version and format gives an equal digest (timestamps are not included).
        """
        if not known_digest_format(digest_format):
            raise ValueError(
                f"{self.path.name}: digest format {digest_format} is not one this version reads {DIGEST_FORMATS}; "
                "open the run with the stepgrpo version that wrote it"
            )
        missing = self.missing_trajectories()
        if missing:
            raise IncompleteStageError(
                f"{self.path.name}: trajectories not written yet: "
                + "; ".join(f"{k}: {v[:20]}{'...' if len(v) > 20 else ''}" for k, v in missing.items())
                + ". Write them (StageWriter.write) before publishing."
            )
        digest = hashlib.sha256()
        total = 0
        for spec in self.arrays():
            dtype, shape = self.dtype(spec.name), self.shape(spec.name)
            digest.update(canonical_json([spec.name, dtype.str, list(shape)]).encode())
            coords = self.chunks(spec)
            bufs = [np.empty(self.chunk_shape(spec), dtype) for _ in range(min(len(coords), 2 * IO_THREADS))]
            hashes: list[bytes] = [b""] * len(bufs)

            def check(i: int, window: list[tuple[int, ...]]) -> None:
                self._read_chunk(spec, window[i], bufs[i])
                if digest_format == 2:  # hashlib lets go of the GIL: the threads hash side by side
                    hashes[i] = hashlib.sha256(memoryview(bufs[i]).cast("B")).digest()

            # Read (and in format 2 hash) a window of chunks in parallel, then digest them in order.
            for lo in range(0, len(coords), len(bufs)):
                window = coords[lo : lo + len(bufs)]
                _each(lambda i, w=window: check(i, w), len(window), bufs[0].nbytes)
                for i, buf in enumerate(bufs[: len(window)]):
                    digest.update(hashes[i] if digest_format == 2 else memoryview(buf).cast("B"))
                    total += buf.nbytes
        digest.update(canonical_json(self.attrs).encode())
        return digest.hexdigest(), total
