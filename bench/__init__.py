"""Benchmarks: each script starts what it needs and prints JSON."""
