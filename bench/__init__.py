"""Benchmarks: ``python -m bench.<module>`` from the repository root."""
