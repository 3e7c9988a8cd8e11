"""The checkpoints of a run: safetensors groups and a JSON state, published atomically.

`Checkpoints` is a part of `stepgrpo.storage.run.Run`; see `storage` for the API.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stepgrpo.storage.errors import CorruptChunkError, NotPublishedError
from stepgrpo.storage.pruned import check_not_pruned
from stepgrpo.storage.publish import check_json, read_json
from stepgrpo.storage.schema import check_name
from stepgrpo.storage.writer import StageWriter, digest_files

if TYPE_CHECKING:
    import torch

    from stepgrpo.storage.owner import RunDir


STATE_FILE = "state.json"


@dataclass(frozen=True)
class Checkpoint:
    """A stored checkpoint."""

    iteration: int
    tensors: dict[str, dict[str, torch.Tensor]]  # group (e.g. "lora", "optimizer") -> name -> tensor
    state: dict[str, Any]  # small JSON state (iteration, RNG states as lists of ints, ...)
    manifest: dict[str, Any]


class Checkpoints:
    """A run's checkpoints: safetensors weights with a JSON state, digest-checked on load (`Run.checkpoints`)."""

    def __init__(self, run: RunDir) -> None:
        self.run = run

    def begin_checkpoint(self, iteration: int) -> StageWriter:
        """Begin a checkpoint directory (write safetensors/JSON files under `writer.path`, then publish)."""
        return self.run._begin(iteration, "checkpoint", None)

    def save_checkpoint(
        self,
        iteration: int,
        tensors: Mapping[str, Mapping[str, torch.Tensor]],
        state: Mapping[str, Any],
        inputs: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Save tensor groups (`<group>.safetensors`) and JSON `state`, published atomically;
        `inputs` (the cache key, timings) go in the manifest and are not digested."""
        from safetensors.torch import save_file

        check_json(dict(state), "checkpoint state")
        with self.begin_checkpoint(iteration) as writer:
            for group, named in tensors.items():
                check_name(group, "tensor group")
                save_file(
                    {n: t.detach().cpu().contiguous() for n, t in named.items()},
                    str(writer.path / f"{group}.safetensors"),
                )
            (writer.path / STATE_FILE).write_text(json.dumps(dict(state), sort_keys=True) + "\n")
            return writer.publish(inputs=inputs)

    def latest_checkpoint(self) -> int | None:
        """The highest iteration with a published checkpoint, or None."""
        found = self.run.iterations("checkpoint")
        return found[-1] if found else None

    def load_checkpoint(self, iteration: int | None = None) -> Checkpoint:
        """Load a published checkpoint (the latest by default)."""
        from safetensors.torch import load_file

        iteration = self.latest_checkpoint() if iteration is None else iteration
        manifest = None if iteration is None else self.run.stage_manifest(iteration, "checkpoint")
        if manifest is None:
            raise NotPublishedError(f"run {self.run.run_id}: no published checkpoint for iteration {iteration}")
        path = self.run.stage_path(iteration, "checkpoint")
        check_not_pruned(path, None, f"run {self.run.run_id} checkpoint iteration {iteration}")
        if digest_files(path)[0] != manifest["digest"]:
            raise CorruptChunkError(
                f"run {self.run.run_id} checkpoint iteration {iteration}: files do not match the published "
                "digest (damaged or edited); restore it or resume from an earlier checkpoint"
            )
        tensors = {p.stem: load_file(str(p)) for p in sorted(path.glob("*.safetensors"))}
        self.run.check_checkpoint_number(iteration)
        return Checkpoint(iteration, tensors, read_json(path / STATE_FILE, "checkpoint state"), manifest)
