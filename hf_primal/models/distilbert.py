"""DistilBERT: non-causal; its attention projects with q_lin / k_lin / v_lin and applies out_lin itself."""

from transformers.models.distilbert import modeling_distilbert
from transformers.models.distilbert.configuration_distilbert import DistilBertConfig

from ..conversion import Architecture
from ..layers import PrimalProjectedAttention
from ..shareable import shareable_classes


class PrimalDistilBertSelfAttention(PrimalProjectedAttention, modeling_distilbert.DistilBertSelfAttention):
    """DistilBERT self-attention computed by non-causal Primal-Attention."""


CONFIG, MODELS = shareable_classes(
    globals(), "distilbert", DistilBertConfig, modeling_distilbert, modeling_distilbert.DistilBertPreTrainedModel
)

ARCHITECTURE = Architecture(
    name="distilbert",
    base_class=modeling_distilbert.DistilBertPreTrainedModel,
    attention_class=modeling_distilbert.DistilBertSelfAttention,
    primal_class=PrimalDistilBertSelfAttention,
    blocks="transformer.layer",
    attention="attention",
    heads_attr="n_heads",
    head_dim_attr="attention_head_size",
    qk_names=("q_lin", "k_lin"),
    out_name="out_lin",
    value_attr="v_lin",
    max_tokens=lambda config: config.max_position_embeddings,
    causal=lambda config: False,
    shareable_config=CONFIG,
    shareable_models=MODELS,
)
