"""DeiT: ViT's attention layout and older checkpoint names; N_max is the patch count plus the [CLS] and distillation
tokens."""

from transformers.models.deit import modeling_deit

from ..modeling.architecture import VIT_LAYOUT, patch_tokens
from ..modeling.layers import PrimalProjectedAttention
from ..modeling.shareable import define_architecture


class PrimalDeiTAttention(PrimalProjectedAttention, modeling_deit.DeiTAttention):
    """``DeiTAttention`` computed by Primal-Attention (the forward of `PrimalProjectedAttention`)."""


ARCHITECTURE = define_architecture(globals(), modeling_deit.DeiTPreTrainedModel, modeling_deit.DeiTAttention,
                                   VIT_LAYOUT, max_tokens=lambda config: patch_tokens(config, extra=2),
                                   primal_class=PrimalDeiTAttention)

# PrimalDeiTConfig and the shareable twin of every deit model class
# of the installed transformers are made by define_architecture (shareable.shareable_classes);
# tests/test_architectures.py checks this list against them.
__all__ = [
    "ARCHITECTURE",
    "PrimalDeiTAttention",
    "PrimalDeiTConfig",
    "PrimalDeiTForImageClassification",
    "PrimalDeiTForImageClassificationWithTeacher",
    "PrimalDeiTForMaskedImageModeling",
    "PrimalDeiTModel",
]
