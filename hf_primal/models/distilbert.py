"""DistilBERT: non-causal; its attention projects with q_lin / k_lin / v_lin and applies out_lin itself."""

from transformers.models.distilbert import modeling_distilbert

from ..modeling.architecture import Layout
from ..modeling.layers import PrimalProjectedAttention
from ..modeling.shareable import define_architecture


class PrimalDistilBertSelfAttention(PrimalProjectedAttention, modeling_distilbert.DistilBertSelfAttention):
    """``DistilBertSelfAttention`` computed by Primal-Attention (the forward of `PrimalProjectedAttention`)."""


ARCHITECTURE = define_architecture(
    globals(), modeling_distilbert.DistilBertPreTrainedModel, modeling_distilbert.DistilBertSelfAttention,
    Layout(blocks="transformer.layer", attention="attention", heads_attr="n_heads", head_dim_attr="attention_head_size",
           qk_names=("q_lin", "k_lin"), out_name="out_lin", value_attr="v_lin"),
    primal_class=PrimalDistilBertSelfAttention,
)

# PrimalDistilBertConfig and the shareable twin of every distilbert model class
# of the installed transformers are made by define_architecture (shareable.shareable_classes);
# tests/test_architectures.py checks this list against them.
__all__ = [
    "ARCHITECTURE",
    "PrimalDistilBertSelfAttention",
    "PrimalDistilBertConfig",
    "PrimalDistilBertForMaskedLM",
    "PrimalDistilBertForMultipleChoice",
    "PrimalDistilBertForQuestionAnswering",
    "PrimalDistilBertForSequenceClassification",
    "PrimalDistilBertForTokenClassification",
    "PrimalDistilBertModel",
]
