"""DeiT: ViT's attention layout; N_max is the patch count plus the [CLS] and distillation tokens."""

from transformers.models.deit import modeling_deit
from transformers.models.deit.configuration_deit import DeiTConfig

from ..conversion import Architecture
from ..layers import PrimalProjectedAttention, patch_tokens
from ..shareable import shareable_classes


class PrimalDeiTAttention(PrimalProjectedAttention, modeling_deit.DeiTAttention):
    """DeiT self-attention computed by non-causal Primal-Attention."""


CONFIG, MODELS = shareable_classes(globals(), "deit", DeiTConfig, modeling_deit, modeling_deit.DeiTPreTrainedModel)

ARCHITECTURE = Architecture(
    name="deit",
    base_class=modeling_deit.DeiTPreTrainedModel,
    attention_class=modeling_deit.DeiTAttention,
    primal_class=PrimalDeiTAttention,
    blocks="layers",
    attention="attention",
    heads_attr="num_attention_heads",
    head_dim_attr="head_dim",
    qk_names=("q_proj", "k_proj"),
    out_name="o_proj",
    value_attr="v_proj",
    max_tokens=lambda config: patch_tokens(config, extra=2),
    causal=lambda config: False,
    shareable_config=CONFIG,
    shareable_models=MODELS,
    # DeiT checkpoints use ViT's older naming (transformers renames them on load like ViT's).
    legacy_value_keys=(
        r"encoder\.layer\.{i}\.attention\.attention\.value\.",
        r"layers\.{i}\.attention\.attention\.value\.",
    ),
)
