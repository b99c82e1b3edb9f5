"""Benchmarks: each module is a script (docs/benchmarks.md)."""
