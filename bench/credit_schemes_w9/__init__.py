"""The benchmark of docs/bench/credit_schemes_w9/ (its page: README.md there)."""
