"""The benchmark of docs/bench/deployed/ (its page: README.md there)."""
