"""The papers' regime: the SDE on steps 0-8 of 10, those 9 steps trained, outcome credit against
Stepwise-Flow-GRPO, TP-GRPO and DenseGRPO, each with its paper's completion (docs/bench/credit_schemes_w9).

    .venv/bin/python -m bench.credit_schemes_w9.w9 --jobs 2          # the comparison (resumable; ~13 core-hours)
    .venv/bin/python -m bench.credit_schemes_w9.w9 --report-only     # the tables from the records
    .venv/bin/python -m bench.credit_schemes_w9.w9 --quick --out DIR # every path at tiny settings

The screen itself is `bench._lib.window` (the cheap regime runs it too).
"""

from bench._lib.window import cli

if __name__ == "__main__":
    cli("w9", __doc__.split("\n\n")[0])
