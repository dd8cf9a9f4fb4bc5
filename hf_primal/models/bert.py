"""BERT (and BERT decoders with ``is_decoder=True``, which run the causal variant)."""

from transformers.models.bert import modeling_bert
from transformers.models.bert.configuration_bert import BertConfig

from ..conversion import Architecture
from ..layers import pop_cache, run_primal, split_heads
from ..shareable import shareable_classes


class PrimalBertSelfAttention(modeling_bert.BertSelfAttention):
    """BERT self-attention computed by Primal-Attention (causal when ``config.is_decoder``)."""

    _is_primal_attention = True

    def forward(self, hidden_states, attention_mask=None, cache=None, **kwargs):
        q, k = split_heads(self.query(hidden_states), self.key(hidden_states), self.attention_head_size)
        return run_primal(self, q, k, hidden_states, attention_mask, pop_cache(cache, kwargs), **kwargs)


CONFIG, MODELS = shareable_classes(globals(), "bert", BertConfig, modeling_bert, modeling_bert.BertPreTrainedModel)

ARCHITECTURE = Architecture(
    name="bert",
    base_class=modeling_bert.BertPreTrainedModel,
    attention_class=modeling_bert.BertSelfAttention,
    primal_class=PrimalBertSelfAttention,
    list_layers=lambda base: [(f"encoder.layer.{i}.attention.self", layer.attention.self)
                              for i, layer in enumerate(base.encoder.layer)],
    head_geometry=lambda module: (module.num_attention_heads, module.attention_head_size),
    qk_names=("query", "key"),
    out_name=None,
    value_attr="value",
    value_checkpoint_patterns=lambda i: [rf"encoder\.layer\.{i}\.attention\.self\.value\."],
    max_tokens=lambda config: config.max_position_embeddings,
    causal=lambda config: bool(config.is_decoder),
    shareable_config=CONFIG,
    shareable_models=MODELS,
)
