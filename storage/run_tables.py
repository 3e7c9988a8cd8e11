"""The Parquet tables of a run: its prompts, and the append-only rewards and advantages.

`RunTables` is a part of `stepgrpo.storage.run.Run`; see `storage` for the API.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from stepgrpo.storage import tables
from stepgrpo.storage.errors import CorruptChunkError, NotPublishedError
from stepgrpo.storage.publish import canonical_json, check_json, options_digest, write_file_atomic
from stepgrpo.storage.schema import ADVANTAGES_KEY, ADVANTAGES_SCHEMA, REWARDS_KEY, REWARDS_SCHEMA

if TYPE_CHECKING:
    import torch

    from stepgrpo.storage.owner import RunDir


TABLES = {"rewards": (REWARDS_SCHEMA, REWARDS_KEY), "advantages": (ADVANTAGES_SCHEMA, ADVANTAGES_KEY)}


class RunTables:
    """A run's Parquet tables: prompts, rewards, advantages (`Run.tables`)."""

    def __init__(self, run: RunDir) -> None:
        self.run = run

    # --- prompts --------------------------------------------------------------------------------

    def write_prompts(
        self,
        prompt_ids: Sequence[int],
        texts: Sequence[str],
        splits: Sequence[str],
        metadata: Sequence[Mapping[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """Write the run's prompts once; returns `{"digest", "rows", "schema_version"}`."""
        table = tables.prompts_table(prompt_ids, texts, splits, metadata)
        return tables.write_once(
            self.run.inside(self.run.path / "prompts.parquet"), table, f"run {self.run.run_id} prompts"
        )

    def prompts_manifest(self) -> dict[str, Any] | None:
        """The prompts' `{"digest", "rows", "schema_version"}`, or None if not written."""
        return tables.read_footer(self.run.path / "prompts.parquet")

    def read_prompts(self) -> pa.Table:
        """The prompts table (`stepgrpo.storage.schema.PROMPTS_SCHEMA`; `metadata` is a JSON string),
        checked against the digest in its footer (`CorruptChunkError` if it does not match)."""
        import pyarrow.parquet as pq

        path = self.run.path / "prompts.parquet"
        try:
            manifest = self.prompts_manifest()
            if manifest is None:
                raise NotPublishedError(f"run {self.run.run_id} has no prompts yet; write them with write_prompts")
            table = pq.read_table(path).replace_schema_metadata(None)
        except (OSError, pa.ArrowException, ValueError) as err:
            raise CorruptChunkError(f"{path} cannot be read ({err}): the prompt table is damaged") from None
        if tables.table_digest(table) != manifest.get("digest"):
            raise CorruptChunkError(f"{path} no longer matches its digest: the prompt table is damaged")
        return table

    def damaged_parts(self, table: str) -> list[Path]:
        """The parts of `table` ("rewards", "advantages") whose rows do not match their name's digest."""
        schema, key = TABLES[table]
        bad = []
        for part in sorted((self.run.path / table).glob("part-*.parquet")):
            try:
                tables.verify_part(part, schema, key)
            except CorruptChunkError:
                bad.append(part)
        return bad

    # --- rewards --------------------------------------------------------------------------------

    def append_rewards(
        self,
        iteration: int,
        reward_name: str,
        reward_version: str,
        traj: Any,
        k: Any,
        value: Any,
        strict: Any | None = None,
        sub: Mapping[str, Any] | None = None,
        info: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Append one reward's scores: `traj, k, value` (`strict`, each `sub[name]`) are `[N]`;
        `info` (JSON) is kept in the part's footer (`rows_info`).

        Raises ValueError naming the rows if a value is NaN/inf or a row is already stored.
        Returns `{"file", "rows", "digest"}`.
        """
        table = tables.rewards_table(iteration, reward_name, reward_version, traj, k, value, strict, sub)
        return tables.append_rows(
            self.run.inside(self.run.path / "rewards"),
            REWARDS_SCHEMA,
            REWARDS_KEY,
            table,
            f"run {self.run.run_id} rewards",
            info,
        )

    def rows_info(self, table: str, digest: str) -> dict[str, Any]:
        """The `info` the rows of `digest` in `table` ("rewards", "advantages") were appended with."""
        return tables.part_info(self.run.path / table, digest)

    def read_rewards(
        self,
        iteration: int | None = None,
        reward_name: str | None = None,
        reward_version: str | None = None,
        as_pandas: bool = False,
    ) -> Any:
        """Reward rows matching the non-None selectors, sorted by key (pyarrow.Table or pandas)."""
        table = tables.read_rows(
            self.run.path / "rewards",
            REWARDS_SCHEMA,
            REWARDS_KEY,
            {"iteration": iteration, "reward_name": reward_name, "reward_version": reward_version},
        )
        return table.to_pandas() if as_pandas else table

    def _one_version(self, table: pa.Table, column: str, what: str) -> pa.Table:
        versions = sorted(set(table.column(column).to_pylist()))
        if len(versions) > 1:
            raise ValueError(f"{what} has several {column} values {versions}; pass one")
        if not versions:
            raise NotPublishedError(f"{what}: no rows stored")
        return table

    def reward_grid(
        self, iteration: int, reward_name: str, reward_version: str | None = None, field: str = "value"
    ) -> torch.Tensor:
        """Rewards of `iteration` as a `[B, T+1]` float32 tensor, NaN where a state has no row.

        `field` is "value", "strict" or a sub-score name. `reward_version` may be omitted when
        only one version is stored.
        """
        import torch

        what = f"run {self.run.run_id} iteration {iteration} reward {reward_name!r}"
        table = self._one_version(self.read_rewards(iteration, reward_name, reward_version), "reward_version", what)
        if field in ("value", "strict"):
            values = table.column(field).to_numpy(zero_copy_only=False).astype(np.float64)
        else:
            values = np.array([dict(s).get(field, np.nan) for s in table.column("sub").to_pylist()], np.float64)
        B, T = self._dims(iteration)
        return torch.from_numpy(tables.to_grid(table, B, T + 1, values))

    def reward_grids(
        self, iterations: Sequence[int], reward_name: str, reward_version: str
    ) -> tuple[dict[int, torch.Tensor], str]:
        """`reward_grid` ("value") of several iterations from one read of the table (each read
        verifies every part), and the digest of those iterations' rows."""
        import pyarrow.compute as pc
        import torch

        table = self.read_rewards(None, reward_name, reward_version)
        wanted = pa.array(list(iterations), table.schema.field("iteration").type)
        table = table.filter(pc.is_in(table.column("iteration"), value_set=wanted))
        of_row = table.column("iteration").to_numpy()
        grids = {}
        for i in iterations:
            rows = table.filter(pa.array(of_row == i))
            if rows.num_rows == 0:
                raise NotPublishedError(f"run {self.run.run_id} iteration {i} reward {reward_name!r}: no rows stored")
            B, T = self._dims(i)
            values = rows.column("value").to_numpy(zero_copy_only=False).astype(np.float64)
            grids[i] = torch.from_numpy(tables.to_grid(rows, B, T + 1, values))
        return grids, tables.table_digest(table)

    def rewards_digest(self, iteration: int, reward_name: str, reward_version: str) -> str:
        """Digest of the stored rows of one reward version (credit's cache-key input)."""
        return tables.table_digest(self.read_rewards(iteration, reward_name, reward_version))

    # --- advantages -----------------------------------------------------------------------------

    def append_advantages(
        self,
        iteration: int,
        scheme: str,
        options: Mapping[str, Any],
        traj: Any,
        k: Any,
        value: Any,
        info: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Append one scheme's advantages (`traj, k, value` `[N]`); rows carry `options_digest(options)`.

        The options themselves are kept in `advantages/options-<digest>.json` (see `scheme_options`).
        Returns `{"file", "rows", "digest", "options_digest"}`.
        """
        check_json(dict(options), f"scheme {scheme} options")
        digest = options_digest(options)
        folder = self.run.inside(self.run.path / "advantages")
        folder.mkdir(parents=True, exist_ok=True)
        sidecar = folder / f"options-{digest}.json"
        if not sidecar.exists():
            write_file_atomic(sidecar, canonical_json({"scheme": scheme, "options": dict(options)}).encode())
        table = tables.advantages_table(iteration, scheme, digest, traj, k, value)
        record = tables.append_rows(
            folder, ADVANTAGES_SCHEMA, ADVANTAGES_KEY, table, f"run {self.run.run_id} advantages", info
        )
        return {**record, "options_digest": digest}

    def scheme_options(self, options_digest: str) -> dict[str, Any]:
        """`{"scheme", "options"}` stored for an options digest."""
        return json.loads((self.run.path / "advantages" / f"options-{options_digest}.json").read_text())

    def read_advantages(
        self,
        iteration: int | None = None,
        scheme: str | None = None,
        options_digest: str | None = None,
        as_pandas: bool = False,
    ) -> Any:
        """Advantage rows matching the non-None selectors, sorted by key (pyarrow.Table or pandas)."""
        table = tables.read_rows(
            self.run.path / "advantages",
            ADVANTAGES_SCHEMA,
            ADVANTAGES_KEY,
            {"iteration": iteration, "scheme": scheme, "options_digest": options_digest},
        )
        return table.to_pandas() if as_pandas else table

    def advantage_grid(self, iteration: int, scheme: str, options_digest: str | None = None) -> torch.Tensor:
        """Advantages of `iteration` under one scheme as a `[B, T]` float32 tensor, NaN where absent."""
        import torch

        what = f"run {self.run.run_id} iteration {iteration} scheme {scheme!r}"
        table = self._one_version(self.read_advantages(iteration, scheme, options_digest), "options_digest", what)
        B, T = self._dims(iteration)
        return torch.from_numpy(tables.to_grid(table, B, T, table.column("value").to_numpy()))

    def advantages_digest(self, iteration: int, scheme: str, options_digest: str) -> str:
        """Digest of the stored rows of one scheme + options (update's cache-key input)."""
        return tables.table_digest(self.read_advantages(iteration, scheme, options_digest))

    def _dims(self, iteration: int) -> tuple[int, int]:
        rollout = self.run.stage_manifest(iteration, "rollout")
        if rollout is None:
            raise NotPublishedError(
                f"run {self.run.run_id} iteration {iteration}: no published rollout to size the grid"
            )
        return int(rollout["attrs"]["B"]), int(rollout["attrs"]["T"])
