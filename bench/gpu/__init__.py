"""The benchmark of docs/bench/gpu/ (its page: README.md there)."""
