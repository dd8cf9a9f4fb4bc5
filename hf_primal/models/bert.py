"""BERT (and BERT decoders with ``is_decoder=True``, which run the causal variant)."""

from transformers.models.bert import modeling_bert
from transformers.models.bert.configuration_bert import BertConfig

from ..conversion import Architecture
from ..layers import PrimalProjectedAttention
from ..shareable import shareable_classes


class PrimalBertSelfAttention(PrimalProjectedAttention, modeling_bert.BertSelfAttention):
    """BERT self-attention computed by Primal-Attention (causal when ``config.is_decoder``)."""


CONFIG, MODELS = shareable_classes(globals(), "bert", BertConfig, modeling_bert, modeling_bert.BertPreTrainedModel)

ARCHITECTURE = Architecture(
    name="bert",
    base_class=modeling_bert.BertPreTrainedModel,
    attention_class=modeling_bert.BertSelfAttention,
    primal_class=PrimalBertSelfAttention,
    blocks="encoder.layer",
    attention="attention.self",
    heads_attr="num_attention_heads",
    head_dim_attr="attention_head_size",
    qk_names=("query", "key"),
    out_name=None,  # BertSelfOutput.dense, outside the attention module
    value_attr="value",
    max_tokens=lambda config: config.max_position_embeddings,
    causal=lambda config: bool(config.is_decoder),
    shareable_config=CONFIG,
    shareable_models=MODELS,
)
