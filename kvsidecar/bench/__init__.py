"""Benchmarks run by ``kvsidecar bench``."""
