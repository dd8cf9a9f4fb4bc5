"""RoBERTa: BERT's attention layout; positions start after the padding index, so N_max is 2 less than the table."""

from transformers.models.roberta import modeling_roberta

from ..modeling.architecture import BERT_LAYOUT, causal_when_decoder
from ..modeling.layers import PrimalProjectedAttention
from ..modeling.shareable import define_architecture


class PrimalRobertaSelfAttention(PrimalProjectedAttention, modeling_roberta.RobertaSelfAttention):
    """``RobertaSelfAttention`` computed by Primal-Attention (the forward of `PrimalProjectedAttention`)."""


ARCHITECTURE = define_architecture(
    globals(), modeling_roberta.RobertaPreTrainedModel, modeling_roberta.RobertaSelfAttention, BERT_LAYOUT,
    causal=causal_when_decoder,
    max_tokens=lambda config: config.max_position_embeddings - (config.pad_token_id or 0) - 1,
    primal_class=PrimalRobertaSelfAttention,
)

# PrimalRobertaConfig and the shareable twin of every roberta model class
# of the installed transformers are made by define_architecture (shareable.shareable_classes);
# tests/test_architectures.py checks this list against them.
__all__ = [
    "ARCHITECTURE",
    "PrimalRobertaSelfAttention",
    "PrimalRobertaConfig",
    "PrimalRobertaForCausalLM",
    "PrimalRobertaForMaskedLM",
    "PrimalRobertaForMultipleChoice",
    "PrimalRobertaForQuestionAnswering",
    "PrimalRobertaForSequenceClassification",
    "PrimalRobertaForTokenClassification",
    "PrimalRobertaModel",
]
