"""The benchmarks: a folder per question (`bench/<question>/`: its script or scripts, run from the
repository's root as `python -m bench.<question>.<script>`), the library they share (`bench._lib`:
runner and records, statistics, compute at equal passes, the temporary Prefect server, the warm
workers, GPU run settings), and, under docs/bench/<question>/, each question's page, reports and
records. A question's folder imports `bench._lib` and the product, never another question's.
docs/BENCHMARKS.md is the index."""
