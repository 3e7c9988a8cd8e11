"""stepgrpo: GRPO for flow-matching text-to-image models with step-level credit assignment."""

import os

# MKL may otherwise use fewer threads than asked when it judges so, and a CPU kernel's last bits
# depend on its thread count: set before MKL first runs (docs/RELIABILITY.md, "Same bytes").
os.environ.setdefault("MKL_DYNAMIC", "FALSE")

__version__ = "0.1.0"
