"""Benchmarks: ``python -m mmbalance.bench.<module>`` (or ``mmbalance bench <module>``)."""
