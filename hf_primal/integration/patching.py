"""How `import hf_primal` attaches primal layers to transformers models.

Hooks, installed once, each a no-op for models whose config does not ask for primal attention:

* ``PreTrainedConfig.primal_attention = None`` (class attribute) so ``from_pretrained(...,
  primal_attention=...)`` routes the kwarg into the config instead of the model's ``__init__``; the value
  is validated and stored as a plain JSON dict when the config is created, when a model is built from it
  and when it is serialised (configs are strict dataclasses whose ``__setattr__`` cannot be wrapped);
* ``PreTrainedModel.post_init`` converts the selected layers *before* transformers initialises and loads
  weights, so the loader reports exactly the new primal tensors as missing and fills the q/k/out ones;
* ``PreTrainedModel._init_weights`` initialises the new primal parameters (docs/method.md, "Initialisation");
* ``PreTrainedModel.save_pretrained`` writes every primal model in the shareable form (``model_type="primal_<arch>"``,
  ``auto_map``, remote code, model card; `hub.save_shareable`), so that no saved primal model loads as a softmax
  model where hf_primal is not imported; ``push_to_hub`` uploads that folder with its model card;
* ``PreTrainedConfig.get_config_dict`` lets a stock config class (``BertConfig``, so ``BertModel.from_pretrained``)
  read such a folder without transformers' model-type warning: with the hooks installed that load is exact; and it
  refuses a primal folder whose config.json lost its ``primal_attention`` entry (`folder_check`);
* ``conversion_mapping.get_model_conversion_mapping`` (and the modules that imported it by name) leaves out the
  checkpoint renaming rules for value projections a primal model no longer has (`drop_value_renamings`);
* transformers' ``sdpa`` and ``eager`` mask functions give a model whose every attention layer is primal the 2D
  padding mask instead of a (batch, 1, N, N) one (`masks.padding_only`).

Nothing global changes behaviour: a model without ``config.primal_attention`` runs stock code.
"""

from __future__ import annotations

from ..modeling import hooks
from ..modeling.config import PrimalAttentionConfig, saved_config_dict
from ..modeling.folder_check import check_saved_config
from ..modeling.shareable import PrimalModelMixin
from ..models import drop_value_renamings, find_architecture
from . import compat
from .hub import save_shareable
from .masks import padding_only

_INSTALLED = False


def _normalise(config) -> None:
    value = config.__dict__.get("primal_attention")
    if value is not None:
        config.__dict__["primal_attention"] = PrimalAttentionConfig.coerce(value).to_dict()


def _acts_on(model) -> bool:
    """Whether the global hooks act on `model`: its config asks for primal attention (shareable Primal* classes
    included: their own hook methods defer to these patches while hf_primal is imported)."""
    return getattr(getattr(model, "config", None), "primal_attention", None) is not None


_PM = "transformers.modeling_utils.PreTrainedModel"
_PC = "transformers.configuration_utils.PreTrainedConfig"


def install_hooks() -> None:
    """Install the construction-time hooks (idempotent; `import hf_primal` calls it).

    Every replaced method is listed in `compat.INTERNALS` (checked when hf_primal is imported); `compat.patch`
    refuses anything that is not.
    """
    global _INSTALLED
    if _INSTALLED:
        return
    _wrap_conversion_mapping()
    _install_generation_hook()
    _install_saving_hooks()
    _install_config_hooks()
    _install_model_hooks()
    _install_mask_hooks()
    _INSTALLED = True


_MASKS = "transformers.masking_utils.AttentionMaskInterface._global_mapping"


def _install_mask_hooks() -> None:
    mapping = compat.original(_MASKS)
    for implementation in ("sdpa", "eager"):
        compat.patch_entry(_MASKS, implementation, padding_only(mapping[implementation]))


def _install_config_hooks() -> None:
    original_get_config_dict = compat.original(f"{_PC}.get_config_dict").__func__

    def get_config_dict(cls, *args, **kwargs):
        config_dict, unused = original_get_config_dict(cls, *args, **kwargs)
        # A primal folder whose config.json lost its entry must not load as softmax attention.
        check_saved_config(config_dict, args[0] if args else kwargs.get("pretrained_model_name_or_path"), kwargs)
        # A checkpoint saved without `sampling` keeps the rule it was trained with, whichever class reads it.
        config_dict = saved_config_dict(config_dict)
        # "primal_bert" read by BertConfig: same fields, and the hooks rebuild the primal layers from
        # primal_attention, so transformers' "model of type primal_bert ... type bert" warning would be noise.
        if cls.model_type and config_dict.get("model_type") == f"primal_{cls.model_type}":
            config_dict = {**config_dict, "model_type": cls.model_type}
        return config_dict, unused

    original_config_post_init = compat.original(f"{_PC}.__post_init__")

    def __post_init__(self, *args, **kwargs):
        original_config_post_init(self, *args, **kwargs)
        _normalise(self)

    original_to_dict = compat.original(f"{_PC}.to_dict")

    def to_dict(self):
        _normalise(self)
        return original_to_dict(self)

    compat.patch(f"{_PC}.get_config_dict", classmethod(get_config_dict))
    compat.add(f"{_PC}.primal_attention", None)
    compat.patch(f"{_PC}.__post_init__", __post_init__)
    compat.patch(f"{_PC}.to_dict", to_dict)


def _install_model_hooks() -> None:
    original_post_init = compat.original(f"{_PM}.post_init")

    @hooks.mark_global_hook(original_post_init)
    def post_init(self):
        if not _acts_on(self):
            return original_post_init(self)
        _normalise(self.config)
        hooks.post_init(self, find_architecture(self), lambda: original_post_init(self))

    original_init_weights = compat.original(f"{_PM}._init_weights")

    @hooks.mark_global_hook(original_init_weights)
    def _init_weights(self, module):
        original_init_weights(self, module)
        if _acts_on(self):
            hooks.init_weights(module)

    compat.patch(f"{_PM}.post_init", post_init)
    compat.patch(f"{_PM}._init_weights", _init_weights)


def _install_saving_hooks() -> None:
    original_save_pretrained = compat.original(f"{_PM}.save_pretrained")

    def save_pretrained(self, save_directory, *args, **kwargs):
        # Adapter-only saves (transformers' own PEFT integration) write no config.json to make shareable.
        if getattr(self.config, "primal_attention", None) is None or getattr(self, "_hf_peft_config_loaded", False):
            return original_save_pretrained(self, save_directory, *args, **kwargs)
        return save_shareable(self, original_save_pretrained, save_directory, *args, **kwargs)

    original_push_to_hub = compat.original(f"{_PM}.push_to_hub")

    def push_to_hub(self, *args, **kwargs):
        # Upload what save_pretrained writes, model card included (transformers would put a generic card over it).
        if getattr(self.config, "primal_attention", None) is None or getattr(self, "_hf_peft_config_loaded", False):
            return original_push_to_hub(self, *args, **kwargs)
        return PrimalModelMixin.push_to_hub(self, *args, **kwargs)

    compat.patch(f"{_PM}.save_pretrained", save_pretrained)
    compat.patch(f"{_PM}.push_to_hub", push_to_hub)


def _install_generation_hook() -> None:
    prepare_path = "transformers.generation.utils.GenerationMixin._prepare_cache_for_generation"
    original_prepare_cache = compat.original(prepare_path)

    @hooks.mark_global_hook(original_prepare_cache)
    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        result = original_prepare_cache(self, generation_config, model_kwargs, *args, **kwargs)
        if _acts_on(self):
            hooks.prepare_cache(self, model_kwargs, generation_config)
        return result

    compat.patch(prepare_path, _prepare_cache_for_generation)


def _wrap_conversion_mapping() -> None:
    """Route transformers' per-model weight-conversion lookup through `drop_value_renamings`."""
    path = "transformers.conversion_mapping.get_model_conversion_mapping"
    original = compat.original(path)

    def get_model_conversion_mapping(model, *args, **kwargs):
        return drop_value_renamings(model, original(model, *args, **kwargs))

    get_model_conversion_mapping.__wrapped__ = original
    # Modules that ran `from .conversion_mapping import get_model_conversion_mapping` hold their own reference;
    # modules imported later, and lazy imports, read the patched module attribute.
    compat.patch(path, get_model_conversion_mapping, where_imported=True)
