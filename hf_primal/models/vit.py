"""ViT: non-causal; N_max is the patch count plus the [CLS] token."""

from transformers.models.vit import modeling_vit

from ..modeling.architecture import VIT_LAYOUT
from ..modeling.layers import patch_tokens
from ..modeling.shareable import define_architecture

ARCHITECTURE = define_architecture(globals(), modeling_vit.ViTPreTrainedModel, modeling_vit.ViTAttention, VIT_LAYOUT,
                                   max_tokens=lambda config: patch_tokens(config, extra=1))
