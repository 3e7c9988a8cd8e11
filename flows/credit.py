"""Recompute advantages of a run with another credit scheme, from stored rewards only."""

from __future__ import annotations

from typing import Any

from prefect import flow

from stepgrpo import stages
from tasks.stages import bind


@flow(name="credit", log_prints=True)
def credit(run: str, scheme: str, options: dict[str, Any] | None = None, reward: str | None = None,
           iterations: list[int] | None = None) -> dict[str, Any]:
    """Advantages under `scheme` for every stored iteration, from the rewards of `reward`
    (default: the run's training reward)."""
    path, stored = stages.run_path(run)
    cfg = stages.validate(stored.model_dump(mode="json") | {"credit": {"scheme": scheme, "options": options or {}}})
    conf, where, t = cfg.model_dump(mode="json"), str(path), bind(path)
    done = []
    for i in iterations if iterations is not None else stages.stored_iterations(path):
        rewards = stages.stored_reward(path, cfg, i, reward)
        done.append(t.credit(where, conf, i, {"rewards": rewards["digest"], "reward": [rewards["name"], rewards["version"]]}))
        print(f"iteration {i}: {scheme} advantages std {done[-1]['adv_std']:.4f}, "
              f"zero-std groups {done[-1]['zero_std_ratio']:.2f}")
    return {"run_dir": where, "advantages": done}
