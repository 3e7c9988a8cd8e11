"""The benchmarks: a folder per question (`bench/<question>/`: its script or scripts, run as
`python bench/<question>/<script>.py` or `python -m bench.<question>.<script>`), the helpers they
share (`bench._common`, `bench._prefect`, `bench._warm`), and, under docs/bench/<question>/, each
question's page, reports and records. docs/BENCHMARKS.md is the index."""
