"""The benchmark of docs/bench/storage/ (its page: README.md there)."""
