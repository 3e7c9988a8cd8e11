"""The papers stepgrpo implements, by arXiv id: the one bibliography that every registry entry's
`paper` fact and every docstring cite (tests/test_core_registry.py holds it both ways: each id the
code cites is here, each paper here is cited). docs/METHODS.md's papers table is
`stepgrpo config variants --papers`: this list beside what implements each paper, read from the
registries' facts."""

from __future__ import annotations

PAPERS: dict[str, str] = {
    "1707.06347": "PPO: Schulman et al. 2017, Proximal Policy Optimization Algorithms",
    "2010.02502": "DDIM: Song et al. 2021, Denoising Diffusion Implicit Models",
    "2211.01095": "DPM-Solver++: Lu et al. 2022, Fast Solver for Guided Sampling of Diffusion Probabilistic Models",
    "2309.05019": "SA-Solver: Xue et al. 2023, Stochastic Adams Solver for Fast Sampling of Diffusion Models",
    "2310.11513": "GenEval: Ghosh et al. 2023, An Object-Focused Framework for Evaluating Text-to-Image Alignment",
    "2402.03300": "GRPO: Shao et al. 2024, DeepSeekMath (Group Relative Policy Optimization)",
    "2403.03206": "SD3: Esser et al. 2024, Scaling Rectified Flow Transformers for High-Resolution Image Synthesis",
    "2505.05470": "Flow-GRPO: Liu et al. 2025, Training Flow Matching Models via Online RL",
    "2507.21802": "MixGRPO: Li et al. 2025, mixed ODE-SDE sampling (the SDE window)",
    "2508.04324": "TempFlow-GRPO: branched rollouts; per-step loss weighting by the step's noise",
    "2509.06040": "BranchGRPO: tree rollouts and the tree advantage",
    "2509.16117": "DiffusionNFT: Zheng et al. 2025, negative-aware fine-tuning",
    "2509.25050": "AWM: Xue et al. 2025, advantage weighted matching",
    "2510.08425": "DGPO: Luo et al. 2025, direct group preference optimization",
    "2510.01982": "G2RPO: Zhou et al. 2025, Granular GRPO (singular stochastic sampling, multi-granularity advantages)",
    "2601.20218": "DenseGRPO: Deng et al. 2026, From Sparse to Dense Reward for Flow Matching Model Alignment",
    "2602.06422": "TP-GRPO: Tong et al. 2026, Modeling Step-Wise and Long-Term Sampling Effects in Flow-Based GRPO",
    "2603.28718": "Stepwise-Flow-GRPO: Savani et al. 2026, Stepwise Credit Assignment for GRPO on Flow-Matching Models",
    "2605.25661": "Step-GRPO: k candidates a step from one state, each step's advantage among them",
}
