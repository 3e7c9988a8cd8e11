"""The benchmark of docs/bench/costs/ (its page: README.md there)."""
