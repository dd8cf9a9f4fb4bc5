"""hf_primal: Primal-Attention (Chen et al., NeurIPS 2023) for HuggingFace Transformers.

``import hf_primal`` lets BERT, ViT, GPT-2, RoBERTa, DistilBERT and DeiT models take a ``primal_attention`` config
option::

    import hf_primal
    from transformers import AutoModelForSequenceClassification
    model = AutoModelForSequenceClassification.from_pretrained(path, primal_attention={"layers": [-1]})
"""

import os
import sys

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
    """Import the API (torch, transformers) and install the hooks; idempotent."""
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
    from .tools.convert import convert, text_batches
    from .tools.embedding_metrics import knn_accuracy, neighbour_overlap
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


def _started_as_cli() -> bool:
    """True while the `hf-primal` script or ``python -m hf_primal.tools.cli`` is starting up.

    That process runs only the CLI, which calls `_import_all` before any command, so `--help` and argument errors
    answer without importing torch and transformers (seconds). Every other ``import hf_primal`` is eager: the hooks
    must be in place before the user builds a model.
    """
    argv = getattr(sys, "argv", None) or [""]
    script = os.path.splitext(os.path.basename(argv[0]))[0]
    if script in ("hf-primal", "hf-primal-script"):
        return True
    # Under `python -m`, sys.argv[0] is "-m" while the parent packages of the target module are imported.
    return argv[0] == "-m" and "hf_primal.tools.cli" in getattr(sys, "orig_argv", ())


def __getattr__(name: str):
    # Only reached in a CLI process before `_import_all` ran (elsewhere everything is imported eagerly).
    if name in __all__:
        _import_all()
        return globals()[name]
    raise AttributeError(f"module 'hf_primal' has no attribute {name!r}")


if not _started_as_cli():
    _import_all()
