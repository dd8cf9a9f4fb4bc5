"""DeiT: ViT's attention layout and older checkpoint names; N_max is the patch count plus the [CLS] and distillation
tokens."""

from transformers.models.deit import modeling_deit

from ..modeling.architecture import VIT_LAYOUT
from ..modeling.layers import patch_tokens
from ..modeling.shareable import define_architecture

ARCHITECTURE = define_architecture(globals(), modeling_deit.DeiTPreTrainedModel, modeling_deit.DeiTAttention,
                                   VIT_LAYOUT, max_tokens=lambda config: patch_tokens(config, extra=2))
