"""The benchmarks: one script per question (`python bench/<name>.py`, or `python -m bench.<name>`),
their shared helpers (`bench._common`), and the records and reports they publish under docs/bench/.
docs/BENCHMARKS.md is the index."""
