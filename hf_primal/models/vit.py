"""ViT: non-causal; N_max is the patch count plus the [CLS] token."""

from transformers.models.vit import modeling_vit

from ..modeling.architecture import VIT_LAYOUT, patch_tokens
from ..modeling.layers import PrimalProjectedAttention
from ..modeling.shareable import define_architecture


class PrimalViTAttention(PrimalProjectedAttention, modeling_vit.ViTAttention):
    """``ViTAttention`` computed by Primal-Attention (the forward of `PrimalProjectedAttention`)."""


ARCHITECTURE = define_architecture(globals(), modeling_vit.ViTPreTrainedModel, modeling_vit.ViTAttention, VIT_LAYOUT,
                                   max_tokens=lambda config: patch_tokens(config, extra=1),
                                   primal_class=PrimalViTAttention)

# PrimalViTConfig and the shareable twin of every vit model class
# of the installed transformers are made by define_architecture (shareable.shareable_classes);
# tests/test_architectures.py checks this list against them.
__all__ = [
    "ARCHITECTURE",
    "PrimalViTAttention",
    "PrimalViTConfig",
    "PrimalViTForImageClassification",
    "PrimalViTForMaskedImageModeling",
    "PrimalViTModel",
]
