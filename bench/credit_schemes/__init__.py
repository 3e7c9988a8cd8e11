"""The benchmark of docs/bench/credit_schemes/ (its page: README.md there)."""
