"""RoBERTa: BERT's attention layout; positions start after the padding index, so N_max is 2 less than the table."""

from transformers.models.roberta import modeling_roberta
from transformers.models.roberta.configuration_roberta import RobertaConfig

from ..conversion import Architecture
from ..layers import PrimalProjectedAttention
from ..shareable import shareable_classes


class PrimalRobertaSelfAttention(PrimalProjectedAttention, modeling_roberta.RobertaSelfAttention):
    """RoBERTa self-attention computed by Primal-Attention (causal when ``config.is_decoder``)."""


CONFIG, MODELS = shareable_classes(
    globals(), "roberta", RobertaConfig, modeling_roberta, modeling_roberta.RobertaPreTrainedModel
)

ARCHITECTURE = Architecture(
    name="roberta",
    base_class=modeling_roberta.RobertaPreTrainedModel,
    attention_class=modeling_roberta.RobertaSelfAttention,
    primal_class=PrimalRobertaSelfAttention,
    blocks="encoder.layer",
    attention="attention.self",
    heads_attr="num_attention_heads",
    head_dim_attr="attention_head_size",
    qk_names=("query", "key"),
    out_name=None,  # RobertaSelfOutput.dense, outside the attention module
    value_attr="value",
    max_tokens=lambda config: config.max_position_embeddings - (config.pad_token_id or 0) - 1,
    causal=lambda config: bool(config.is_decoder),
    shareable_config=CONFIG,
    shareable_models=MODELS,
)
