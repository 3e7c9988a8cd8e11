"""What a run stored, by content: compare two runs (e.g. made by two commits) item by item.

For every published Zarr stage its content digest, for the reward and advantage tables their
digest-named parts, for every checkpoint and the exported LoRA a digest of each safetensors
file's tensors (names and values, not the file's metadata), for every evaluation its mean and a
digest of its per-sample scores, and the calibrated `psi` table. Timings, cache keys and MLflow ids
are left out: they differ between any two runs.

The command that compares two runs: `python -m bench.costs.digests RUN_A [RUN_B]`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def _tensors_digest(path: Path) -> str:
    from safetensors.torch import load_file

    h = hashlib.sha256()
    for name, t in sorted(load_file(str(path)).items()):
        h.update(name.encode())
        h.update(t.contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def items(run: Path) -> dict[str, object]:
    """The run's content items (module doc), by a name relative to the run directory."""
    out: dict[str, object] = {}
    for p in sorted(run.rglob("_published.json")):
        rel = p.parent.relative_to(run).as_posix()
        if not rel.startswith("checkpoints/"):  # a checkpoint's digest covers its state.json (timings)
            out[rel] = json.loads(p.read_text()).get("digest")
    for table in ("rewards", "advantages"):
        out[table] = sorted(q.name for q in (run / table).glob("*")) if (run / table).is_dir() else []
    for p in sorted(list(run.glob("checkpoints/iter_*/*.safetensors")) + list(run.glob("lora/*.safetensors"))):
        out[p.relative_to(run).as_posix()] = _tensors_digest(p)
    for p in sorted((run / "eval").glob("*.json")):
        e = json.loads(p.read_text())
        out[f"eval/{p.name}"] = [e["reward_mean"], hashlib.sha256(json.dumps(e["scores"]).encode()).hexdigest()[:16]]
    if (run / "calibration" / "psi.json").is_file():
        out["calibration/psi"] = json.loads((run / "calibration" / "psi.json").read_text())["psi"]
    return out
