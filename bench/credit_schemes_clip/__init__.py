"""The benchmark of docs/bench/credit_schemes_clip/ (its page: README.md there)."""
