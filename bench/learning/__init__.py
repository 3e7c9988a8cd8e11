"""The benchmark of docs/bench/learning/ (its page: README.md there)."""
