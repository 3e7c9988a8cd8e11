"""Re-score stored trajectories of a run with another reward: no sampling, no transformer call.

Adds reward rows (`reward_name`, `reward_version`) next to the ones already stored; rollout and
completion stages are read, never recomputed. The images the first reward saw are read from the
iteration's image store when it has one (no VAE call); otherwise the VAE alone is loaded to decode
the stored latents, and the images are stored for the next re-score (`storage.images`).
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from stepgrpo import stages
from tasks.stages import bind


@flow(name="rescore", log_prints=True)
def rescore(run: str, reward: str, reward_options: dict[str, Any] | None = None,
            iterations: list[int] | None = None) -> dict[str, Any]:
    """Score every stored iteration (or `iterations`) of `run` with `reward`."""
    path, stored = stages.run_path(run)
    cfg = stages.validate(stored.model_dump(mode="json") | {"reward": {"name": reward, "options": reward_options or {}}})
    conf, where, t = cfg.model_dump(mode="json"), str(path), bind(path)
    done = []
    for i in iterations if iterations is not None else stages.stored_iterations(path):
        clean = stages.clean_ref(path, cfg, i)
        done.append(t.score(where, conf, i, {"clean": clean["digest"], "rollout": clean["rollout"]}))
        print(f"iteration {i}: {done[-1]['reward_name']} mean {done[-1]['reward_mean']:.4f} "
              f"(images {done[-1]['images']})")
    return {"run_dir": where, "scores": done}
