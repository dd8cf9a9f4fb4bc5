"""BERT (and BERT decoders with ``is_decoder=True``, which run the causal variant)."""

from transformers.models.bert import modeling_bert

from ..modeling.architecture import BERT_LAYOUT, causal_when_decoder
from ..modeling.shareable import define_architecture

# Defines PrimalBertSelfAttention, PrimalBertConfig and a shareable Primal* twin of every BERT model class here.
ARCHITECTURE = define_architecture(globals(), modeling_bert.BertPreTrainedModel, modeling_bert.BertSelfAttention,
                                   BERT_LAYOUT, causal=causal_when_decoder,
                                   causal_lm_heads=("BertLMHeadModel",))
