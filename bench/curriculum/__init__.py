"""The benchmark of docs/bench/curriculum/ (its page: README.md there)."""
