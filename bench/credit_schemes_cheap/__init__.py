"""The benchmark of docs/bench/credit_schemes_cheap/ (its page: README.md there)."""
