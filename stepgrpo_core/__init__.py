"""stepgrpo_core: the step-credit math of stepgrpo, pure torch (METHODS.md in code).

Shape legend used by every docstring in this package:

    B  trajectories in a batch (B = prompts x G)
    G  group size: trajectories per prompt, sharing the initial noise x_0
    T  sampling steps; states x_0 .. x_T live on the grid sigmas [T+1] (1 = noise, 0 = clean),
       step k is x_k -> x_{k+1}
    C, H, W  latent channels, height, width
    N  rows of a flattened batch (e.g. B x T states)

The only model interface is `velocity(x [B,C,H,W], sigma [B], cond) -> v [B,C,H,W]`; `cond` is a
pytree whose tensor leaves have leading dim B (see `conditioning.take`).

Modules: `kernels` (transition kernels, log-density), `rollout` (sampling, re-scoring stored
steps), `completions` (ODE completion of every state), `credit` (advantages from step rewards),
`calibration` (DenseGRPO psi), `loss` (PPO-clip GRPO loss), `objectives` (the update objectives:
GRPO, and DiffusionNFT, AWM and DGPO on forward-noised copies), `branching` (branched and tree
rollouts), `registry`, `variants` (every registry's entries in one table).

The papers, cited where their formulas are implemented (by arXiv id and the equation, or the
component by the paper's own name where we cite no equation number), are `papers.PAPERS`; every
registry entry names its own in its `paper` fact, and `stepgrpo config variants --papers` prints
each paper beside what implements it (docs/METHODS.md).
"""

from .calibration import initial_psi, update_psi
from .completions import COMPLETIONS, Completion, Method, complete, parse_method, validate_method
from .conditioning import repeat_interleave, take
from .credit import SCHEMES, STD_EPS, Credit, assign, scheme_options
from .kernels import KERNELS, log_prob, step_moments
from .loss import LossOutput, grpo_loss
from .registry import Registry, UnknownNameError
from .rollout import Rollout, StepLogProb, rollout, step_log_prob

__all__ = [
    "COMPLETIONS",
    "KERNELS",
    "SCHEMES",
    "STD_EPS",
    "Completion",
    "Credit",
    "LossOutput",
    "Method",
    "Registry",
    "Rollout",
    "StepLogProb",
    "UnknownNameError",
    "assign",
    "complete",
    "grpo_loss",
    "initial_psi",
    "log_prob",
    "parse_method",
    "repeat_interleave",
    "rollout",
    "scheme_options",
    "step_log_prob",
    "step_moments",
    "take",
    "update_psi",
    "validate_method",
]
