"""Shareable primal classes: a ``Primal*Config`` and a ``Primal*`` subclass of every model class of an architecture.

They carry their own model_type (``"primal_bert"``, ...). A saved folder's config.json has an ``auto_map`` to them,
so ``AutoModel*.from_pretrained(folder, trust_remote_code=True)`` rebuilds the primal layers where hf_primal is not
installed, and plain Auto loading without the plugin or trust_remote_code fails loudly (unknown model type) instead
of producing a stock model with missing weights. Each architecture module (hf_primal/models/) makes its classes,
its primal attention class and its `architecture.Architecture` record with one `define_architecture` call.

Imports only torch, transformers and flat hf_primal modules: copied next to shared checkpoints as remote code.
"""

from __future__ import annotations

import os
import sys
import tempfile
from types import ModuleType
from typing import Any, Optional

from transformers import GenerationMixin, PreTrainedModel

from .architecture import Architecture, Layout
from .config import saved_config_dict
from .folder_check import check_saved_config
from .hooks import global_hook_installed, init_weights, post_init, prepare_cache
from .model_card import model_card


class PrimalConfigMixin:
    """Reads a shared folder's config.json with the sampling rule its primal layers were saved with, and refuses one
    that lost its ``primal_attention`` entry (`folder_check`)."""

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path: Any, **kwargs: Any) -> tuple[dict, dict]:
        config_dict, unused = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        check_saved_config(config_dict, pretrained_model_name_or_path, kwargs)
        return config_dict, unused

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs: Any) -> Any:
        # Auto classes and remote code build the config from the dict read from disk here; user overrides such as
        # from_pretrained(..., primal_attention={...}) come in kwargs and are applied afterwards, untouched.
        return super().from_dict(saved_config_dict(config_dict), **kwargs)


class PrimalModelMixin:
    """The hooks of `hooks` as methods, for where hf_primal is not installed (where it is, its global patches do
    the same work and these methods only call them), and a model card written next to the weights."""

    _primal_architecture = None  # set by `architecture.Architecture`

    def save_pretrained(self, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        result = super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            with open(os.path.join(save_directory, "README.md"), "w", encoding="utf-8") as handle:
                handle.write(model_card(self))
        return result

    def push_to_hub(self, repo_id: str, *, commit_message: Optional[str] = None, private: Optional[bool] = None,
                    token: Any = None, revision: Optional[str] = None, create_pr: bool = False,
                    max_shard_size: Any = "50GB", commit_description: Optional[str] = None,
                    tags: Optional[list[str]] = None) -> Any:
        # transformers' push_to_hub arguments, the same upload path, but the model card written by save_pretrained
        # is kept (transformers would replace it with a generic one); `tags` go into that card's metadata.
        with tempfile.TemporaryDirectory() as tmp_dir:
            self.save_pretrained(tmp_dir, max_shard_size=max_shard_size)
            if tags:
                with open(os.path.join(tmp_dir, "README.md"), "w", encoding="utf-8") as handle:
                    handle.write(model_card(self, tags=tags))
            return upload_folder(tmp_dir, repo_id, uploader=self, commit_message=commit_message, private=private,
                                 token=token, revision=revision, create_pr=create_pr,
                                 commit_description=commit_description)

    def _prepare_cache_for_generation(self, generation_config: Any, model_kwargs: dict, *args: Any, **kwargs: Any):
        result = super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        if not global_hook_installed(GenerationMixin._prepare_cache_for_generation):
            prepare_cache(self, model_kwargs, generation_config)
        return result

    def post_init(self) -> None:
        if global_hook_installed(PreTrainedModel.post_init):
            return super().post_init()
        post_init(self, self._primal_architecture, super().post_init)

    def initialize_weights(self) -> None:
        super().initialize_weights()
        if not global_hook_installed(PreTrainedModel._init_weights):
            # Not in `_init_weights`: transformers initialises the modules of a stock sub-model (the `bert` of
            # PrimalBertForSequenceClassification) with that sub-model's own `_init_weights`, which knows nothing of
            # primal cores. Tensors a checkpoint filled are skipped (transformers' init helpers).
            for module in self.modules():
                init_weights(module)


def upload_folder(folder: str, repo_id: str, *, uploader: Any = None, commit_message: Optional[str] = None,
                  private: Optional[bool] = None, token: Any = None, revision: Optional[str] = None,
                  create_pr: bool = False, commit_description: Optional[str] = None) -> Any:
    """Create `repo_id` if needed and commit every file of `folder` through transformers' own upload
    (``PushToHubMixin._upload_modified_files``): the one path `push_to_hub` of a primal model and
    ``hf-primal convert --push-to-hub`` share. `uploader` (a model) names the default commit message."""
    from transformers.utils.hub import PushToHubMixin, hf_api  # the Hub client is needed only when uploading

    repo_id = hf_api().create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
    return PushToHubMixin._upload_modified_files(
        uploader if uploader is not None else PushToHubMixin(), folder, repo_id, files_timestamps={},
        commit_message=commit_message, token=token, create_pr=create_pr, revision=revision,
        commit_description=commit_description,
    )


def shareable_classes(
    namespace: dict, name: str, config_class: type, modeling: ModuleType, base_class: type
) -> tuple[type, dict]:
    """Define ``Primal<Config>`` and ``Primal<Model>`` for every model class of one architecture in `namespace`.

    Args:
        namespace: the architecture module's ``globals()``: the classes are defined there, under their names, so that
            an ``auto_map`` entry such as ``"modeling_primal_bert.PrimalBertModel"`` finds them.
        name: transformers' model_type ("bert"); the classes get ``"primal_<name>"``.
        config_class: the stock config class (``BertConfig``).
        modeling: transformers' modeling module of the architecture; every public subclass of `base_class` it
            defines gets a shareable twin, so no head transformers has is missed.
        base_class: the architecture's ``*PreTrainedModel``.
    Returns:
        (the config class, {stock model class: shareable subclass}).
    """
    module = namespace["__name__"]
    config = type(f"Primal{config_class.__name__}", (PrimalConfigMixin, config_class),
                  {"model_type": f"primal_{name}", "primal_attention": None, "__module__": module})
    models = {}
    stock_classes = sorted(
        (c for c in vars(modeling).values()
         if isinstance(c, type) and issubclass(c, base_class) and c is not base_class
         and c.__module__ == modeling.__name__ and not c.__name__.startswith("_")),
        key=lambda c: c.__name__,
    )
    for stock in stock_classes:
        models[stock] = type(f"Primal{stock.__name__}", (PrimalModelMixin, stock),
                             {"config_class": config, "__module__": module})
    namespace.update({cls.__name__: cls for cls in (config, *models.values())})
    return config, models


def define_architecture(namespace: dict, base_class: type, attention_class: type, layout: Layout,
                        primal_class: type, **record: Any) -> Architecture:
    """Define one architecture's shareable classes in `namespace` and return its `Architecture` record.

    Args:
        namespace: the architecture module's ``globals()``. ``Primal<Config>`` and the shareable model classes are
            defined there under their names (the module lists them in ``__all__``), so that pickle and an ``auto_map``
            entry such as ``"modeling_primal_bert.PrimalBertModel"`` (the module copied as remote code) find them.
        base_class: the architecture's ``*PreTrainedModel``. Its ``config_class`` gives the name (``model_type``)
            and the config to subclass; its module, the model classes that get shareable twins (`shareable_classes`).
        attention_class: the stock attention module that becomes primal.
        layout: where the attention modules are and what their projections are called (an `architecture` preset
            when the architecture shares one).
        primal_class: the module's ``Primal<attention class>``: ``(PrimalProjectedAttention, <attention class>)``
            with no code of its own for two-linear q/k projections, or a forward of its own (GPT-2's fused
            ``c_attn``).
        **record: the `Architecture` fields that have defaults (``max_tokens``, ``causal``,
            ``lora_fan_in_fan_out``, ``causal_lm_heads``, ``cross_attention``), where the architecture
            differs from them.
    """
    if not (isinstance(primal_class, type) and issubclass(primal_class, attention_class)):
        raise TypeError(f"define_architecture: primal_class {primal_class!r} must subclass {attention_class.__name__}")
    config_class = base_class.config_class
    config, models = shareable_classes(namespace, config_class.model_type, config_class,
                                       sys.modules[base_class.__module__], base_class)
    return Architecture(
        **{field: getattr(layout, field) for field in Layout.__dataclass_fields__},
        name=config_class.model_type, base_class=base_class, attention_class=attention_class,
        primal_class=primal_class, shareable_config=config, shareable_models=models, **record,
    )
