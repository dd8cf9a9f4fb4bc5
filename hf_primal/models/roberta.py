"""RoBERTa: BERT's attention layout; positions start after the padding index, so N_max is 2 less than the table."""

from transformers.models.roberta import modeling_roberta

from ..modeling.architecture import BERT_LAYOUT, causal_when_decoder
from ..modeling.shareable import define_architecture

ARCHITECTURE = define_architecture(
    globals(), modeling_roberta.RobertaPreTrainedModel, modeling_roberta.RobertaSelfAttention, BERT_LAYOUT,
    causal=causal_when_decoder,
    max_tokens=lambda config: config.max_position_embeddings - (config.pad_token_id or 0) - 1,
)
