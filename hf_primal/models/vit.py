"""ViT: non-causal; N_max is the patch count plus the [CLS] token."""

from transformers.models.vit import modeling_vit
from transformers.models.vit.configuration_vit import ViTConfig

from ..conversion import Architecture
from ..layers import PrimalProjectedAttention, patch_tokens
from ..shareable import shareable_classes


class PrimalViTAttention(PrimalProjectedAttention, modeling_vit.ViTAttention):
    """ViT self-attention computed by non-causal Primal-Attention."""


CONFIG, MODELS = shareable_classes(globals(), "vit", ViTConfig, modeling_vit, modeling_vit.ViTPreTrainedModel)

ARCHITECTURE = Architecture(
    name="vit",
    base_class=modeling_vit.ViTPreTrainedModel,
    attention_class=modeling_vit.ViTAttention,
    primal_class=PrimalViTAttention,
    blocks="layers",
    attention="attention",
    heads_attr="num_attention_heads",
    head_dim_attr="head_dim",
    qk_names=("q_proj", "k_proj"),
    out_name="o_proj",
    value_attr="v_proj",
    max_tokens=lambda config: patch_tokens(config, extra=1),
    causal=lambda config: False,
    shareable_config=CONFIG,
    shareable_models=MODELS,
    # Checkpoints in transformers' older ViT naming, and a key every ViT renaming rule but the value one rewrites
    # (that rule is dropped once every layer is primal, see models.drop_value_renamings).
    legacy_value_keys=(
        r"encoder\.layer\.{i}\.attention\.attention\.value\.",
        r"layers\.{i}\.attention\.attention\.value\.",
    ),
)
