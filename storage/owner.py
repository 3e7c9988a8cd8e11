"""What a run's parts (`Run.stages`, `Run.tables`, `Run.checkpoints`) use of the run they belong to,
as a protocol: the parts stand below `stepgrpo.storage.run`, which builds them, and import nothing of it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

from stepgrpo.storage.schema import StoreSpec
from stepgrpo.storage.writer import StageWriter


class RunDir(Protocol):
    path: Path
    run_id: str

    def inside(self, path: str | os.PathLike[str]) -> Path: ...

    def dim_limits(self) -> dict[str, int]: ...

    def stage_path(self, iteration: int, stage: str) -> Path: ...

    def stage_manifest(self, iteration: int, stage: str) -> dict[str, Any] | None: ...

    def iterations(self, stage: str = "rollout") -> list[int]: ...

    def _begin(self, iteration: int, stage: str, spec: StoreSpec | None, resume: str | None = None) -> StageWriter: ...
