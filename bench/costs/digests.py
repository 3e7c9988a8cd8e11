"""Compare what two runs stored, item by item (`bench._lib.digests.items`: every published stage's
content digest, the tables' parts, each checkpoint's tensors, the evaluations' scores, `psi`).

    python -m bench.costs.digests RUN_A [RUN_B]   (one run: print its items; two: the items that differ)
"""

from __future__ import annotations

import sys
from pathlib import Path

from bench._lib.digests import items

USAGE = "usage: python -m bench.costs.digests RUN_A [RUN_B]"


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print(USAGE, file=sys.stderr)
        return 2
    runs = [Path(a) for a in argv]
    for r in runs:
        if not (r / "manifest.json").is_file():
            print(f"{r}: not a run directory (no manifest.json)", file=sys.stderr)
            return 2
    if len(runs) == 1:
        for name, value in items(runs[0]).items():
            print(f"{name}  {value}")
        return 0
    a, b = items(runs[0]), items(runs[1])
    differ = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    for k in differ:
        print(f"differs: {k}: {a.get(k, '(absent)')} | {b.get(k, '(absent)')}")
    print(f"{len(set(a) | set(b))} items compared, {len(differ)} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
