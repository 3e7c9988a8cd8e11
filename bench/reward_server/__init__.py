"""The benchmark of docs/bench/reward_server/ (its page: README.md there)."""
