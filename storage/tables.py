"""Long, append-only Parquet tables: prompts, rewards, advantages.

Rewards and advantages live in a directory each (`rewards/`, `advantages/`) as immutable files
`part-<digest>.parquet`, one per append, read together as one dataset. An append never rewrites a
file: a new reward version or credit scheme adds files. Appending rows whose key (see
`stepgrpo.storage.schema.REWARDS_KEY` / `ADVANTAGES_KEY`) is already stored is refused, except that
appending exactly the same rows again is a no-op (a stage re-run after a crash that happened
after its append). Appends take a short lock on the table directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from stepgrpo.storage.errors import CorruptChunkError
from stepgrpo.storage.publish import acquire_lock, canonical_json, check_json, release_lock, write_file_atomic
from stepgrpo.storage.schema import (
    ADVANTAGES_SCHEMA,
    PROMPTS_SCHEMA,
    REWARDS_SCHEMA,
    SCHEMA_VERSION,
)

APPEND_LOCK_WAIT_S = 60.0  # appends are short; a concurrent appender waits rather than fails
FOOTER_KEY = b"stepgrpo"  # Parquet key-value metadata: {"schema_version", "digest", "rows"}
MAX_ROWS_NAMED = 10  # how many offending rows an error message lists


def table_digest(table: pa.Table) -> str:
    """sha256 hex of a table's rows (canonical JSON, in the table's order)."""
    digest = hashlib.sha256(canonical_json(table.schema.names).encode())
    for batch in table.to_batches(max_chunksize=65536):
        digest.update(canonical_json(batch.to_pylist()).encode())
    return digest.hexdigest()


def _sort(table: pa.Table, key: Sequence[str]) -> pa.Table:
    return table.sort_by([(c, "ascending") for c in key])


def _rows_named(table: pa.Table, mask: np.ndarray, columns: Sequence[str]) -> str:
    rows = table.filter(pa.array(mask)).select(list(columns)).slice(0, MAX_ROWS_NAMED).to_pylist()
    more = int(mask.sum()) - len(rows)
    return ", ".join(str(r) for r in rows) + (f" and {more} more" if more > 0 else "")


def _files(table_dir: Path) -> list[str]:
    return sorted(str(p) for p in table_dir.glob("part-*.parquet"))


# Parts whose content was checked against the digest in their name, by (path, size, mtime, inode):
# a part is verified once per process, and again whenever its file changes.
_verified: set[tuple[str, int, int, int]] = set()


PARTS_FILE = "_parts.json"  # in a table's folder: the sha256 of each part's bytes, by name


def _bytes_index(table_dir: Path) -> dict[str, str]:
    """The recorded byte digests of a table's parts ({} if none, or if the index does not parse:
    it only adds a check, and the rows' digests are checked in any case)."""
    try:
        index = json.loads((table_dir / PARTS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return index if isinstance(index, dict) else {}


def _record_bytes(table_dir: Path, name: str, sha256: str) -> None:
    """Add a part's byte digest to the index (under the table's append lock)."""
    index = _bytes_index(table_dir) | {name: sha256}
    write_file_atomic(table_dir / PARTS_FILE, (json.dumps(index, indent=1, sort_keys=True) + "\n").encode())


def verify_part(path: Path, schema: pa.Schema, key: Sequence[str]) -> None:
    """Check a part: its bytes against the digest recorded when it was appended (any flipped byte),
    and its rows against the digest its name carries (parts appended before bytes were recorded).
    `CorruptChunkError` names the file when either differs (a flipped byte, a truncated or edited file)."""
    st = path.stat()
    ident = (str(path), st.st_size, st.st_mtime_ns, st.st_ino)
    if ident in _verified:
        return
    recorded = _bytes_index(path.parent).get(path.name)
    if recorded is not None and hashlib.sha256(path.read_bytes()).hexdigest() != recorded:
        raise CorruptChunkError(
            f"{path}: its bytes no longer match the digest recorded when it was appended (damaged or edited); "
            "restore it from a copy of the run, or move it out of the table and re-score the iteration"
        )
    expected = path.name.removeprefix("part-").removesuffix(".parquet")
    try:
        table = _sort(pq.read_table(path, schema=schema).replace_schema_metadata(None), key)
        found = table_digest(table)[: len(expected)]
    except (OSError, pa.ArrowException) as err:
        raise CorruptChunkError(
            f"{path}: not a readable Parquet part ({err}); restore it from a copy of the run"
        ) from None
    if found != expected:
        raise CorruptChunkError(
            f"{path}: its rows no longer match the digest in its name (damaged or edited); restore it from a copy "
            "of the run, or move it out of the table and re-score the iteration (`stepgrpo rescore`)"
        )
    _verified.add(ident)


# A part's (min, max) of an integer column from its Parquet statistics, by (path, size, mtime,
# inode) and column: a part is immutable, so a read of one iteration opens only the parts that
# may hold it (a run's table has a part per appended iteration: reading every part per iteration
# would make a run's reads quadratic in its length).
_ranges: dict[tuple[str, int, int, int, str], tuple[Any, Any] | None] = {}


def _may_hold(path: str, column: str, value: int) -> bool:
    st = os.stat(path)
    ident = (path, st.st_size, st.st_mtime_ns, st.st_ino, column)
    if ident not in _ranges:
        _ranges[ident] = _column_range(path, column)
    found = _ranges[ident]
    return found is None or found[0] <= value <= found[1]


def _column_range(path: str, column: str) -> tuple[Any, Any] | None:
    """(min, max) of `column` over the part's row groups, or None when a row group has no statistics."""
    meta = pq.ParquetFile(path).metadata
    index = meta.schema.to_arrow_schema().get_field_index(column)
    lo = hi = None
    for g in range(meta.num_row_groups):
        stats = meta.row_group(g).column(index).statistics
        if stats is None or not stats.has_min_max:
            return None
        lo = stats.min if lo is None else min(lo, stats.min)
        hi = stats.max if hi is None else max(hi, stats.max)
    return None if lo is None else (lo, hi)


def read_rows(table_dir: Path, schema: pa.Schema, key: Sequence[str], where: Mapping[str, Any]) -> pa.Table:
    """Rows of the table in `table_dir` whose columns equal the non-None values in `where`, sorted by
    key. Every part is checked against its name's digest (`verify_part`) before it is read."""
    files = _files(table_dir)
    if not files:
        return schema.empty_table()
    for f in files:
        verify_part(Path(f), schema, key)
    for column, value in where.items():  # skip the parts whose statistics rule the value out
        if value is not None and isinstance(value, int) and column in schema.names:
            files = [f for f in files if _may_hold(f, column, value)]
    if not files:
        return schema.empty_table()
    expr = None
    for column, value in where.items():
        if value is not None:
            term = ds.field(column) == value
            expr = term if expr is None else expr & term
    table = ds.dataset(files, schema=schema, format="parquet").to_table(filter=expr)
    return _sort(table, key)


def append_rows(
    table_dir: Path,
    schema: pa.Schema,
    key: Sequence[str],
    table: pa.Table,
    what: str,
    info: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Append `table` as one immutable file; refuse rows whose key is already stored. `info`
    (plain JSON, e.g. how long computing the rows took) goes in the part's footer, not its digest.

    Returns `{"file", "rows", "digest"}`; appending identical rows again returns the same record.
    """
    table = _sort(table.cast(schema), key)
    keys = table.select(list(key)).to_pylist()
    if len({tuple(r.values()) for r in keys}) != len(keys):
        raise ValueError(f"{what}: the rows to append repeat a key {tuple(key)}; each key must appear once")
    digest = table_digest(table)
    name = f"part-{digest[:32]}.parquet"
    record = {"file": name, "rows": table.num_rows, "digest": digest}
    table_dir.mkdir(parents=True, exist_ok=True)
    lock = table_dir / ".append.lock"
    token = acquire_lock(lock, f"{what} table", wait_s=APPEND_LOCK_WAIT_S)
    try:
        if (table_dir / name).exists():
            return record  # the very same rows were appended before
        # Only rows sharing the first key columns' values can collide (iteration + name/version).
        scope = {c: table.column(c)[0].as_py() for c in key if pc.count_distinct(table.column(c)).as_py() == 1}
        stored = read_rows(table_dir, schema, key, scope).select(list(key))
        if stored.num_rows:
            old = {tuple(r.values()) for r in stored.to_pylist()}
            clash = np.array([tuple(r.values()) in old for r in keys])
            if clash.any():
                raise ValueError(
                    f"{what}: rows already stored, tables are append-only: {_rows_named(table, clash, key)}. "
                    "Bump the version (reward) or change the options (scheme) to store new values."
                )
        tmp = table_dir / f".{name}.{secrets.token_hex(4)}.tmp"
        footer = {FOOTER_KEY: canonical_json(dict(info))} if info else None
        try:
            pq.write_table(table.replace_schema_metadata(footer) if footer else table, tmp)
            _record_bytes(table_dir, name, hashlib.sha256(tmp.read_bytes()).hexdigest())  # before it is visible
            os.rename(tmp, table_dir / name)
        except BaseException:  # a full disk (ENOSPC): no partial part is left beside the table
            tmp.unlink(missing_ok=True)
            raise
    finally:
        release_lock(lock, token)
    return record


def _column(values: Any, n: int, name: str, dtype: str) -> np.ndarray:
    if hasattr(values, "detach"):
        values = values.detach().cpu().double().numpy()
    arr = np.asarray(values, dtype=dtype).reshape(-1)
    if len(arr) != n:
        raise ValueError(f"{name} has {len(arr)} values, expected {n} (one per row)")
    return arr


def rewards_table(
    iteration: int,
    reward_name: str,
    reward_version: str,
    traj: Any,
    k: Any,
    value: Any,
    strict: Any | None = None,
    sub: Mapping[str, Any] | None = None,
) -> pa.Table:
    """Rows of one reward for one iteration; `traj`, `k`, `value` (and `strict`, each `sub[name]`) are `[N]`.

    Raises ValueError naming the rows (traj, k) whose value is NaN or infinite.
    """
    traj = _column(traj, len(np.asarray(traj).reshape(-1)), "traj", "int64")
    n = len(traj)
    k = _column(k, n, "k", "int64")
    value = _column(value, n, "value", "float64")
    bad = ~np.isfinite(value)
    if bad.any():
        rows = [(int(t), int(s), float(v)) for t, s, v in zip(traj[bad], k[bad], value[bad])][:MAX_ROWS_NAMED]
        raise ValueError(
            f"reward {reward_name!r} v{reward_version} iteration {iteration}: {int(bad.sum())} values are "
            f"NaN or infinite, (traj, k, value): {rows}. A reward must score every state it is given; "
            "fix the scorer or leave those states out."
        )
    strict_col = pa.nulls(n, pa.float64()) if strict is None else pa.array(_column(strict, n, "strict", "float64"))
    names = sorted(sub or {})
    subs = [_column(sub[s], n, f"sub[{s}]", "float64") for s in names] if sub else []
    sub_col = pa.array(
        [list(zip(names, (float(c[i]) for c in subs))) for i in range(n)], REWARDS_SCHEMA.field("sub").type
    )
    return pa.table(
        {
            "iteration": pa.array(np.full(n, iteration, "int64")),
            "traj": pa.array(traj),
            "k": pa.array(k),
            "reward_name": pa.array([reward_name] * n, pa.string()),
            "reward_version": pa.array([str(reward_version)] * n, pa.string()),
            "value": pa.array(value),
            "strict": strict_col,
            "sub": sub_col,
        },
        schema=REWARDS_SCHEMA,
    )


def advantages_table(iteration: int, scheme: str, options_digest: str, traj: Any, k: Any, value: Any) -> pa.Table:
    """Rows of one scheme's advantages for one iteration; `traj`, `k`, `value` are `[N]`.

    NaN is allowed (no credit at that step); infinities raise a ValueError naming the rows.
    """
    traj = _column(traj, len(np.asarray(traj).reshape(-1)), "traj", "int64")
    n = len(traj)
    k = _column(k, n, "k", "int64")
    value = _column(value, n, "value", "float64")
    bad = np.isinf(value)
    if bad.any():
        rows = [(int(t), int(s)) for t, s in zip(traj[bad], k[bad])][:MAX_ROWS_NAMED]
        raise ValueError(f"scheme {scheme!r} iteration {iteration}: infinite advantages at (traj, k): {rows}")
    return pa.table(
        {
            "iteration": pa.array(np.full(n, iteration, "int64")),
            "traj": pa.array(traj),
            "k": pa.array(k),
            "scheme": pa.array([scheme] * n, pa.string()),
            "options_digest": pa.array([options_digest] * n, pa.string()),
            "value": pa.array(value),
        },
        schema=ADVANTAGES_SCHEMA,
    )


def to_grid(table: pa.Table, rows: int, cols: int, values: np.ndarray) -> np.ndarray:
    """Scatter `values` `[N]` at (`traj`, `k`) of `table` into a `[rows, cols]` float32 grid, NaN elsewhere."""
    grid = np.full((rows, cols), np.nan, np.float32)
    traj = table.column("traj").to_numpy()
    k = table.column("k").to_numpy()
    outside = (traj < 0) | (traj >= rows) | (k < 0) | (k >= cols)
    if outside.any():
        raise ValueError(f"rows outside the [{rows}, {cols}] grid: {_rows_named(table, outside, ['traj', 'k'])}")
    grid[traj, k] = values
    return grid


# --- prompts ------------------------------------------------------------------------------------


def prompts_table(
    prompt_ids: Sequence[int],
    texts: Sequence[str],
    splits: Sequence[str],
    metadata: Sequence[Mapping[str, Any]] | None = None,
) -> pa.Table:
    """The prompts table, sorted by id; `metadata[i]` is a JSON object (may be empty)."""
    n = len(prompt_ids)
    metadata = metadata if metadata is not None else [{}] * n
    if not len(texts) == len(splits) == len(metadata) == n:
        raise ValueError(f"prompts: {n} ids, {len(texts)} texts, {len(splits)} splits, {len(metadata)} metadata")
    if len(set(prompt_ids)) != n:
        raise ValueError("prompts: prompt_id values must be unique")
    for i, m in enumerate(metadata):
        check_json(dict(m), f"metadata of prompt {prompt_ids[i]}")
    table = pa.table(
        {
            "prompt_id": pa.array(prompt_ids, pa.int64()),
            "text": pa.array(texts, pa.string()),
            "split": pa.array(splits, pa.string()),
            "metadata": pa.array([canonical_json(dict(m)) for m in metadata], pa.string()),
        },
        schema=PROMPTS_SCHEMA,
    )
    return table.sort_by("prompt_id")


def write_once(path: Path, table: pa.Table, what: str) -> dict[str, Any]:
    """Write `table` to `path` atomically, once; its manifest goes in the Parquet footer.

    Writing identical content again is a no-op; different content raises (the file is immutable).
    """
    digest = table_digest(table)
    record = {"schema_version": SCHEMA_VERSION, "digest": digest, "rows": table.num_rows}
    existing = read_footer(path)
    if existing is not None:
        if existing.get("digest") != digest:
            raise ValueError(
                f"{what} is already written with other content ({path.name} is immutable); start a new run"
            )
        return existing
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        pq.write_table(table.replace_schema_metadata({FOOTER_KEY: canonical_json(record)}), tmp)
        os.link(tmp, path)  # atomic and never replaces: a concurrent writer of other content loses
    except FileExistsError:
        return write_once(path, table, what)
    finally:
        tmp.unlink(missing_ok=True)
    return record


def part_info(table_dir: Path, digest: str) -> dict[str, Any]:
    """The `info` a part was appended with (`append_rows`), by the digest of its rows; {} if none."""
    meta = read_footer(table_dir / f"part-{digest[:32]}.parquet")
    return meta or {}


def read_footer(path: Path) -> dict[str, Any] | None:
    """The manifest stored in a Parquet file's footer by `write_once`, or None if there is no file."""
    try:
        meta = pq.read_schema(path).metadata or {}
        return json.loads(meta[FOOTER_KEY]) if FOOTER_KEY in meta else {}
    except FileNotFoundError:
        return None
    except (OSError, pa.ArrowException, ValueError) as err:
        raise CorruptChunkError(f"{path} cannot be read ({err}): the file is damaged") from None
