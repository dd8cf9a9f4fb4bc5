"""DeiT: ViT's attention; N_max is the patch count plus the [CLS] and distillation tokens."""

from transformers.models.deit import modeling_deit
from transformers.models.deit.configuration_deit import DeiTConfig

from ..conversion import Architecture
from ..layers import patch_tokens, run_primal, split_heads
from ..shareable import shareable_classes


class PrimalDeiTAttention(modeling_deit.DeiTAttention):
    """DeiT self-attention computed by non-causal Primal-Attention."""

    _is_primal_attention = True

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        q, k = split_heads(self.q_proj(hidden_states), self.k_proj(hidden_states), self.head_dim)
        out, attention = run_primal(self, q, k, hidden_states, attention_mask, **kwargs)
        return self.o_proj(out), attention


CONFIG, MODELS = shareable_classes(globals(), "deit", DeiTConfig, modeling_deit, modeling_deit.DeiTPreTrainedModel)

ARCHITECTURE = Architecture(
    name="deit",
    base_class=modeling_deit.DeiTPreTrainedModel,
    attention_class=modeling_deit.DeiTAttention,
    primal_class=PrimalDeiTAttention,
    list_layers=lambda base: [(f"layers.{i}.attention", layer.attention) for i, layer in enumerate(base.layers)],
    head_geometry=lambda module: (module.num_attention_heads, module.head_dim),
    qk_names=("q_proj", "k_proj"),
    out_name="o_proj",
    value_attr="v_proj",
    value_checkpoint_patterns=lambda i: [
        rf"layers\.{i}\.attention\.v_proj\.",
        rf"encoder\.layer\.{i}\.attention\.attention\.value\.",
        rf"layers\.{i}\.attention\.attention\.value\.",
    ],
    max_tokens=lambda config: patch_tokens(config, extra=2),
    causal=lambda config: False,
    shareable_config=CONFIG,
    shareable_models=MODELS,
)
