"""What a saved primal model runs: the method in plain torch and its transformers glue.

Every module here imports only torch, transformers and its siblings (``from .x import``), and the whole package is
copied, flat, into each shared folder as its remote code (`hf_primal.integration.hub.write_remote_code`), with
the architecture's module from `hf_primal.models`. `tests/test_layout.py` holds the rule.

The method, in plain torch (no transformers import): `primal` (PrimalCore, CausalState, the KSVD terms), `sampling`
(which tokens the data-dependent weights sample), `kernel` (packed segments, prefix means, the attention kernel),
`fused_heads` (scores, head map and KSVD sums with a hand-written backward), `decode` (the one-token causal step).

The transformers side: `config` (PrimalAttentionConfig), `architecture` (the Layout presets, the Architecture
record, converting attention modules in place), `layers` (the forward every Primal*Attention shares),
`cache_layers` and `cache` (the constant-size generation state and putting it into transformers caches),
`shareable` (the primal_<arch> config and model classes), `model_card` (the README.md of shared folders).
"""
