"""Benchmarks (`scripts.benchmarks`, run as ``python -m scripts.benchmarks.NAME``) and training examples
(``python scripts/examples/NAME.py``)."""
