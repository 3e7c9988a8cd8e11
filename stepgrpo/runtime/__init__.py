"""How work runs: process settings, Ray workers and shards, the data-parallel launcher, faults, orphan
reaping. May import the contracts (config, errors, paths) and storage; no loop, no report, no task."""
