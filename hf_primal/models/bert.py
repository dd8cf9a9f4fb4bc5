"""BERT (and BERT decoders with ``is_decoder=True``, which run the causal variant)."""

from transformers.models.bert import modeling_bert

from ..modeling.architecture import BERT_LAYOUT, causal_when_decoder
from ..modeling.layers import PrimalProjectedAttention
from ..modeling.shareable import define_architecture


class PrimalBertSelfAttention(PrimalProjectedAttention, modeling_bert.BertSelfAttention):
    """``BertSelfAttention`` computed by Primal-Attention (the forward of `PrimalProjectedAttention`)."""


ARCHITECTURE = define_architecture(globals(), modeling_bert.BertPreTrainedModel, modeling_bert.BertSelfAttention,
                                   BERT_LAYOUT, causal=causal_when_decoder,
                                   causal_lm_heads=("BertLMHeadModel",), primal_class=PrimalBertSelfAttention)

# PrimalBertConfig and the shareable twin of every bert model class
# of the installed transformers are made by define_architecture (shareable.shareable_classes);
# tests/test_architectures.py checks this list against them.
__all__ = [
    "ARCHITECTURE",
    "PrimalBertSelfAttention",
    "PrimalBertConfig",
    "PrimalBertForMaskedLM",
    "PrimalBertForMultipleChoice",
    "PrimalBertForNextSentencePrediction",
    "PrimalBertForPreTraining",
    "PrimalBertForQuestionAnswering",
    "PrimalBertForSequenceClassification",
    "PrimalBertForTokenClassification",
    "PrimalBertLMHeadModel",
    "PrimalBertModel",
]
