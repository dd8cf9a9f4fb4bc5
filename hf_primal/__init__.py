"""hf_primal: Primal-Attention (Chen et al., NeurIPS 2023) for HuggingFace Transformers.

``import hf_primal`` lets BERT, ViT and GPT-2 models take a ``primal_attention`` config option::

    import hf_primal
    from transformers import AutoModelForSequenceClassification
    model = AutoModelForSequenceClassification.from_pretrained(path, primal_attention={"layers": [-1]})
"""

from .analysis import LayerSpectrum, attention_spectrum, plot_attention_spectrum
from .config import PrimalAttentionConfig
from .convert import convert
from .hub import enable_remote_code, register_auto_classes, save_converted
from .lora import lora_config
from .loss import clear_ksvd_terms, ksvd_loss
from .modeling_primal import SUPPORTED_ARCHITECTURES, apply_primal_attention, primal_layers
from .patching import install_hooks
from .primal import KSVDTerms, PrimalCore
from .trainer import PrimalTrainer

install_hooks()
register_auto_classes()

__version__ = "0.1.0"

__all__ = [
    "PrimalAttentionConfig",
    "PrimalCore",
    "KSVDTerms",
    "SUPPORTED_ARCHITECTURES",
    "apply_primal_attention",
    "primal_layers",
    "ksvd_loss",
    "clear_ksvd_terms",
    "PrimalTrainer",
    "lora_config",
    "convert",
    "enable_remote_code",
    "save_converted",
    "LayerSpectrum",
    "attention_spectrum",
    "plot_attention_spectrum",
]
