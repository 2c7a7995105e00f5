"""Benchmark harness: ``python -m tritonattn.bench`` (see __main__.py)."""
