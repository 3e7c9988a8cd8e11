"""The benchmark of docs/bench/oracle/ (its page: README.md there)."""
