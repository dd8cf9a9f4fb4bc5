"""Causal language modelling from scratch on real text: what a decoder whose layers are primal learns, and what its
generation state and decoding cost (``python -m scripts.benchmarks.causal_lm``; the module docstring of
`__main__` says what is measured)."""
