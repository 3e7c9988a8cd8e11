"""The benchmark of docs/bench/credit_quality/ (its page: README.md there)."""
