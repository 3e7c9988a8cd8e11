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
component by the paper's own name where we cite no equation number):

    Flow-GRPO           arXiv 2505.05470  Liu et al. 2025, Flow-GRPO: Training Flow Matching Models via Online RL
    Stepwise-Flow-GRPO  arXiv 2603.28718  Savani et al. 2026, Stepwise Credit Assignment for GRPO on
                                          Flow-Matching Models
    TP-GRPO             arXiv 2602.06422  Tong et al. 2026, Alleviating Sparse Rewards by Modeling Step-Wise and
                                          Long-Term Sampling Effects in Flow-Based GRPO
    DenseGRPO           arXiv 2601.20218  Deng et al. 2026, DenseGRPO: From Sparse to Dense Reward for Flow Matching
                                          Model Alignment
    DDIM                arXiv 2010.02502  Song et al. 2021, Denoising Diffusion Implicit Models
    PPO                 arXiv 1707.06347  Schulman et al. 2017, Proximal Policy Optimization Algorithms
    GRPO                arXiv 2402.03300  Shao et al. 2024, DeepSeekMath (Group Relative Policy Optimization)
    MixGRPO             arXiv 2507.21802  Li et al. 2025, MixGRPO: mixed ODE-SDE sampling (the SDE window)
    TempFlow-GRPO       arXiv 2508.04324  branched rollouts; per-step loss weighting by the step's noise
    BranchGRPO          arXiv 2509.06040  tree rollouts and the tree advantage
    DiffusionNFT        arXiv 2509.16117  Zheng et al. 2025, negative-aware fine-tuning (objective `nft`)
    AWM                 arXiv 2509.25050  Xue et al. 2025, advantage weighted matching (objective `awm`)
    DGPO                arXiv 2510.08425  Luo et al. 2025, direct group preference optimization (objective `dgpo`)
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
