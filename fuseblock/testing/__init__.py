"""Measurement tools for tests and benchmarks (not needed at run time)."""
