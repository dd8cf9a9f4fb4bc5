"""hf_primal: Primal-Attention (Chen et al., NeurIPS 2023) for HuggingFace Transformers.

``import hf_primal`` lets BERT, ViT, GPT-2, RoBERTa, DistilBERT and DeiT models take a ``primal_attention`` config
option::

    import hf_primal
    from transformers import AutoModelForSequenceClassification
    model = AutoModelForSequenceClassification.from_pretrained(path, primal_attention={"layers": [-1]})
"""

from .modeling.config import VERSION as __version__

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
    "progressive_conversion",
    "ConversionArguments",
    "layer_sensitivity",
    "LayerSensitivity",
    "knn_accuracy",
    "neighbour_overlap",
    "text_batches",
    "enable_remote_code",
    "save_converted",
    "LayerSpectrum",
    "attention_spectrum",
    "plot_attention_spectrum",
    "predict_with_uncertainty",
]

_LOADED = False


def _import_all() -> None:
    """Import the API (torch, transformers) and install the hooks; idempotent.

    Eager on every ``import hf_primal``, whatever the process: the hooks must be in place before the user builds a
    model.
    """
    global _LOADED
    if _LOADED:
        return
    # First: a transformers release that lacks an internal we hook fails here, by name, not deep in a forward.
    from .integration.compat import check_transformers

    check_transformers()
    from .integration.hub import enable_remote_code, register_auto_classes, save_converted
    from .integration.patching import install_hooks
    from .modeling.architecture import primal_layers
    from .modeling.config import PrimalAttentionConfig
    from .modeling.primal import KSVDTerms, PrimalCore
    from .models import SUPPORTED_ARCHITECTURES, apply_primal_attention
    from .tools.analysis import LayerSpectrum, attention_spectrum, plot_attention_spectrum
    from .tools.conversion_arguments import ConversionArguments
    from .tools.convert import convert, text_batches
    from .tools.embedding_metrics import knn_accuracy, neighbour_overlap
    from .tools.progressive import progressive_conversion
    from .tools.selection import LayerSensitivity, layer_sensitivity
    from .tools.uncertainty import predict_with_uncertainty
    from .training.lora import lora_config
    from .training.loss import clear_ksvd_terms, ksvd_loss
    from .training.trainer import PrimalTrainer

    # Bind after every import: importing a submodule sets a package attribute of the same name (`convert`).
    globals().update({name: value for name, value in locals().items() if name in __all__})
    install_hooks()
    register_auto_classes()
    _LOADED = True


_import_all()
