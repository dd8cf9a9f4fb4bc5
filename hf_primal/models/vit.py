"""ViT: non-causal; N_max is the patch count plus the [CLS] token."""

from transformers.models.vit import modeling_vit
from transformers.models.vit.configuration_vit import ViTConfig

from ..conversion import Architecture
from ..layers import patch_tokens, run_primal, split_heads
from ..shareable import shareable_classes


class PrimalViTAttention(modeling_vit.ViTAttention):
    """ViT self-attention computed by non-causal Primal-Attention."""

    _is_primal_attention = True

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        q, k = split_heads(self.q_proj(hidden_states), self.k_proj(hidden_states), self.head_dim)
        out, attention = run_primal(self, q, k, hidden_states, attention_mask, **kwargs)
        return self.o_proj(out), attention


CONFIG, MODELS = shareable_classes(globals(), "vit", ViTConfig, modeling_vit, modeling_vit.ViTPreTrainedModel)

ARCHITECTURE = Architecture(
    name="vit",
    base_class=modeling_vit.ViTPreTrainedModel,
    attention_class=modeling_vit.ViTAttention,
    primal_class=PrimalViTAttention,
    list_layers=lambda base: [(f"layers.{i}.attention", layer.attention) for i, layer in enumerate(base.layers)],
    head_geometry=lambda module: (module.num_attention_heads, module.head_dim),
    qk_names=("q_proj", "k_proj"),
    out_name="o_proj",
    value_attr="v_proj",
    value_checkpoint_patterns=lambda i: [
        rf"layers\.{i}\.attention\.v_proj\.",
        rf"encoder\.layer\.{i}\.attention\.attention\.value\.",
        # a legacy checkpoint key renamed by every ViT rule but the value one (dropped when all layers are primal)
        rf"layers\.{i}\.attention\.attention\.value\.",
    ],
    max_tokens=lambda config: patch_tokens(config, extra=1),
    causal=lambda config: False,
    shareable_config=CONFIG,
    shareable_models=MODELS,
)
