"""RoBERTa: BERT's attention; positions start after the padding index, so N_max is 2 less than the table."""

from transformers.models.roberta import modeling_roberta
from transformers.models.roberta.configuration_roberta import RobertaConfig

from ..conversion import Architecture
from ..layers import pop_cache, run_primal, split_heads
from ..shareable import shareable_classes


class PrimalRobertaSelfAttention(modeling_roberta.RobertaSelfAttention):
    """RoBERTa self-attention computed by Primal-Attention (causal when ``config.is_decoder``)."""

    _is_primal_attention = True

    def forward(self, hidden_states, attention_mask=None, cache=None, **kwargs):
        q, k = split_heads(self.query(hidden_states), self.key(hidden_states), self.attention_head_size)
        return run_primal(self, q, k, hidden_states, attention_mask, pop_cache(cache, kwargs), **kwargs)


CONFIG, MODELS = shareable_classes(
    globals(), "roberta", RobertaConfig, modeling_roberta, modeling_roberta.RobertaPreTrainedModel
)

ARCHITECTURE = Architecture(
    name="roberta",
    base_class=modeling_roberta.RobertaPreTrainedModel,
    attention_class=modeling_roberta.RobertaSelfAttention,
    primal_class=PrimalRobertaSelfAttention,
    list_layers=lambda base: [(f"encoder.layer.{i}.attention.self", layer.attention.self)
                              for i, layer in enumerate(base.encoder.layer)],
    head_geometry=lambda module: (module.num_attention_heads, module.attention_head_size),
    qk_names=("query", "key"),
    out_name=None,
    value_attr="value",
    value_checkpoint_patterns=lambda i: [rf"encoder\.layer\.{i}\.attention\.self\.value\."],
    max_tokens=lambda config: config.max_position_embeddings - (config.pad_token_id or 0) - 1,
    causal=lambda config: bool(config.is_decoder),
    shareable_config=CONFIG,
    shareable_models=MODELS,
)
