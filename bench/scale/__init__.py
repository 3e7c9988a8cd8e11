"""The benchmark of docs/bench/scale/ (its page: README.md there)."""
