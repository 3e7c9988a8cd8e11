"""Every family of names a config or a command takes, by the heading the docs give it: the core's
variants (kernels, completion methods, credit schemes, objectives), the rewards, the optimizer
presets and the evaluation protocols. Each is a `Registry`, the only list of its names:
`stepgrpo config variants` prints them all, and no document lists them by hand
(tests/test_docs.py)."""

from __future__ import annotations

from stepgrpo_core.registry import Registry


def families() -> dict[str, Registry]:
    """Every family's registry, by its heading."""
    from stepgrpo.config import OPTIMIZER_PRESETS
    from stepgrpo.prompts.protocols import PROTOCOLS
    from stepgrpo.rewards import REWARDS
    from stepgrpo_core.variants import core_registries

    return {
        **core_registries(),
        "reward": REWARDS,
        "optimizer preset": OPTIMIZER_PRESETS,
        "evaluation protocol": PROTOCOLS,
    }
