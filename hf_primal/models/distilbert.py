"""DistilBERT: non-causal; its attention projects with q_lin / k_lin / v_lin and out_lin."""

from transformers.models.distilbert import modeling_distilbert
from transformers.models.distilbert.configuration_distilbert import DistilBertConfig

from ..conversion import Architecture
from ..layers import run_primal, split_heads
from ..shareable import shareable_classes


class PrimalDistilBertSelfAttention(modeling_distilbert.DistilBertSelfAttention):
    """DistilBERT self-attention computed by non-causal Primal-Attention."""

    _is_primal_attention = True

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        q, k = split_heads(self.q_lin(hidden_states), self.k_lin(hidden_states), self.attention_head_size)
        out, attention = run_primal(self, q, k, hidden_states, attention_mask, **kwargs)
        return self.out_lin(out), attention


CONFIG, MODELS = shareable_classes(
    globals(), "distilbert", DistilBertConfig, modeling_distilbert, modeling_distilbert.DistilBertPreTrainedModel
)

ARCHITECTURE = Architecture(
    name="distilbert",
    base_class=modeling_distilbert.DistilBertPreTrainedModel,
    attention_class=modeling_distilbert.DistilBertSelfAttention,
    primal_class=PrimalDistilBertSelfAttention,
    list_layers=lambda base: [(f"transformer.layer.{i}.attention", block.attention)
                              for i, block in enumerate(base.transformer.layer)],
    head_geometry=lambda module: (module.n_heads, module.attention_head_size),
    qk_names=("q_lin", "k_lin"),
    out_name="out_lin",
    value_attr="v_lin",
    value_checkpoint_patterns=lambda i: [rf"transformer\.layer\.{i}\.attention\.v_lin\."],
    max_tokens=lambda config: config.max_position_embeddings,
    causal=lambda config: False,
    shareable_config=CONFIG,
    shareable_models=MODELS,
)
