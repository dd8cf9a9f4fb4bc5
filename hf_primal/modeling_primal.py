"""Former home of the primal layers, kept so that imports written against hf_primal 0.1 keep working.

Each concern now has its own module: `layers` (masks, `run_primal`), `conversion` (`Architecture`, converting
modules in place), `models` (one module per architecture and the registry), `shareable` (the ``primal_*`` classes
shared as remote code) and `model_card`. Saved folders carry their own copy of the code they need.
"""

from .conversion import inherit_weight_conversions, init_primal_core, prepare_primal_cache, primal_layers
from .layers import attentions_requested, packed_segments, run_primal, valid_tokens
from .model_card import model_card
from .models import SUPPORTED_ARCHITECTURES, apply_primal_attention, drop_value_renamings, find_architecture
from .models.bert import PrimalBertSelfAttention
from .models.gpt2 import PrimalGPT2Attention
from .models.vit import PrimalViTAttention
from .shareable import PrimalModelMixin

__all__ = [
    "PrimalBertSelfAttention",
    "PrimalGPT2Attention",
    "PrimalModelMixin",
    "PrimalViTAttention",
    "SUPPORTED_ARCHITECTURES",
    "apply_primal_attention",
    "attentions_requested",
    "drop_value_renamings",
    "find_architecture",
    "inherit_weight_conversions",
    "init_primal_core",
    "model_card",
    "packed_segments",
    "prepare_primal_cache",
    "primal_layers",
    "run_primal",
    "valid_tokens",
]
