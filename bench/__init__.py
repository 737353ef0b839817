"""Benchmarks: `python -m bench.io_throughput` and `python -m bench.vs_run_batch` (see README)."""
