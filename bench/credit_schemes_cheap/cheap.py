"""Free step rewards: DenseGRPO's credit from the rollout's own x0 predictions (0 extra NFEs) in the
papers' regime, against outcome at W9 and W3 (docs/bench/credit_schemes_cheap).

    .venv/bin/python -m bench.credit_schemes_cheap.cheap --jobs 2          # the comparison (resumable)
    .venv/bin/python -m bench.credit_schemes_cheap.cheap --report-only     # the tables from the records
    .venv/bin/python -m bench.credit_schemes_cheap.cheap --quick --out DIR # every path at tiny settings

The screen itself is `bench._lib.window` (the w9 regime runs it too).
"""

from bench._lib.window import cli

if __name__ == "__main__":
    cli("cheap", __doc__.split("\n\n")[0])
