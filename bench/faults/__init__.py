"""The benchmark of docs/bench/faults/ (its page: README.md there)."""
