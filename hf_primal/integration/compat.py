"""Every transformers (and torch) internal hf_primal patches or relies on, checked when hf_primal is imported.

hf_primal hooks a handful of base-class methods (`patching.install_hooks`) and subclasses or calls some
transformers internals that are not public API. A release that renames one of them would otherwise break a user
silently (a hook that never fires) or deep inside a forward pass. `check_transformers` resolves every entry of
`INTERNALS` and checks the parameters hf_primal passes or receives, and raises `IncompatibleTransformersError` naming
the installed transformers version, the missing piece and the supported range. `patching` takes the originals it
wraps from here (`original`) and changes transformers only through `patch` and `add`, which refuse anything not
listed and record what they changed (`applied`); a test walks every transformers module and class and fails on an
hf_primal object found anywhere else. (The primal cache layers bind a validating ``crop`` on the user's cache
*instance*: that lives in the remote code, which cannot import this module, and changes no transformers class.)

Keep `TRANSFORMERS_RANGE` equal to the requirement in setup.py (a test checks it); `.ci/run` runs the test suite on
the lowest and the newest release in that range.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import warnings
from dataclasses import dataclass
from typing import Any

TRANSFORMERS_RANGE = ">=5.23,<6"


class IncompatibleTransformersError(ImportError):
    """The installed transformers lacks (or changed) an internal hf_primal needs."""


@dataclass(frozen=True)
class Internal:
    path: str  # dotted: module path, then attributes
    why: str  # what hf_primal does with it (shown in the error)
    params: tuple[str, ...] = ()  # parameter names the callable must accept
    patched: bool = False  # hf_primal replaces it (patching.install_hooks)
    added: bool = False  # hf_primal adds it: transformers must not have it
    keys: tuple[str, ...] = ()  # a mapping: the entries that must exist (and that `patch_entry` may replace);
    # `params` then applies to each entry's value

    @property
    def private(self) -> bool:
        return any(part.startswith("_") and not part.startswith("__") for part in self.path.split("."))


_PM = "transformers.modeling_utils.PreTrainedModel"
_PC = "transformers.configuration_utils.PreTrainedConfig"
_TR = "transformers.trainer.Trainer"
_CU = "transformers.cache_utils"

INTERNALS: tuple[Internal, ...] = (
    # Patched by patching.install_hooks.
    Internal(
        f"{_PC}.__post_init__", "validate and normalise `primal_attention` when a config is created", patched=True
    ),
    Internal(f"{_PC}.to_dict", "serialise `primal_attention` as a plain dict", patched=True),
    Internal(f"{_PC}.primal_attention", "route `from_pretrained(..., primal_attention=...)` into the config (a class "
             "attribute, None)", added=True),
    Internal(f"{_PC}.get_config_dict", "read a saved primal_<arch> folder with the stock config class", patched=True),
    Internal(f"{_PM}.post_init", "convert the chosen layers before weights are initialised and loaded", patched=True),
    Internal(f"{_PM}._init_weights", "initialise the new primal parameters", ("module",), patched=True),
    Internal(f"{_PM}.save_pretrained", "save every primal model in the shareable form", ("save_directory",),
             patched=True),
    Internal(f"{_PM}.push_to_hub", "upload the shareable folder with its model card", patched=True),
    Internal("transformers.generation.utils.GenerationMixin._prepare_cache_for_generation",
             "put constant-size primal layers into generate()'s cache", ("generation_config", "model_kwargs"),
             patched=True),
    Internal("transformers.masking_utils.AttentionMaskInterface._global_mapping",
             "give a model whose every attention layer is primal the 2D padding mask, not a (batch, 1, N, N) one",
             ("q_length", "kv_length", "q_offset", "kv_offset", "mask_function", "attention_mask"), patched=True,
             keys=("sdpa", "eager")),
    Internal("transformers.conversion_mapping.get_model_conversion_mapping",
             "drop weight-renaming rules for the value projections primal layers no longer have", ("model",),
             patched=True),
    # Relied on.
    Internal("transformers.masking_utils.bidirectional_mask_function",
             "recognise a plain bidirectional mask request (masks.padding_only)"),
    Internal("transformers.masking_utils.causal_mask_function", "recognise a plain causal mask request "
             "(masks.padding_only)"),
    Internal("transformers.conversion_mapping.get_checkpoint_conversion_mapping",
             "give shareable Primal* classes the renaming rules of their stock class"),
    Internal("transformers.conversion_mapping.register_checkpoint_conversion_mapping",
             "give shareable Primal* classes the renaming rules of their stock class"),
    Internal("transformers.utils.output_capturing._CAN_RECORD_REGISTRY",
             "register the outputs a model can record when convert() swaps in a shareable Primal* class"),
    Internal("transformers.utils.output_capturing._active_collector",
             "return the kernel matrix when output_attentions=True is requested through the output collector"),
    Internal(f"{_PM}._keys_to_ignore_on_load_unexpected", "keep dropped value projections out of the load report"),
    Internal(f"{_PM}._can_record_outputs", "register the outputs a model swapped to a shareable class can record"),
    Internal("transformers.integrations.peft.PeftAdapterMixin._hf_peft_config_loaded",
             "leave adapter-only saves of transformers' PEFT integration as they are"),
    Internal("torch.Tensor._version", "tell whether a cached tensor was modified in place (packed-segment cache)"),
    Internal(f"{_PM}.initialize_weights", "initialise the primal cores of shareable classes where hf_primal is not "
             "installed (remote code)"),
    Internal("transformers.initialization.orthogonal_", "initialise W_e and W_r"),
    Internal("transformers.initialization.uniform_", "initialise Lambda"),
    Internal(f"{_CU}.Cache", "fill gaps of a cache with the layer class it replicates",
             ("layer_class_to_replicate",)),
    Internal(f"{_CU}.Cache.crop", "roll primal sums back for assisted / prompt-lookup decoding",
             ("tokens_to_remove",)),
    Internal(f"{_CU}.Cache.activate_past_recording", "keep per-token history for cropping"),
    # The layer interface Cache calls on each layer; the primal cache layers override these by name.
    Internal(f"{_CU}.CacheLayerMixin.update", "primal cache layer interface", ("key_states", "value_states")),
    Internal(f"{_CU}.CacheLayerMixin.lazy_initialization", "primal cache layer interface",
             ("key_states", "value_states")),
    Internal(f"{_CU}.CacheLayerMixin.get_seq_length", "primal cache layer interface"),
    Internal(f"{_CU}.CacheLayerMixin.get_mask_sizes", "primal cache layer interface", ("query_length",)),
    Internal(f"{_CU}.CacheLayerMixin.get_max_length", "primal cache layer interface"),
    Internal(f"{_CU}.CacheLayerMixin.reset", "primal cache layer interface"),
    Internal(f"{_CU}.CacheLayerMixin.reorder_cache", "primal cache layer interface (beam search)", ("beam_idx",)),
    Internal(f"{_CU}.DynamicLayer.crop", "primal cache layer interface", ("tokens_to_remove",)),
    Internal(f"{_CU}.DynamicLayer.batch_repeat_interleave", "primal cache layer interface", ("repeats",)),
    Internal(f"{_CU}.DynamicLayer.batch_select_indices", "primal cache layer interface", ("indices",)),
    Internal(f"{_CU}.DynamicLayer", "fill gaps of a lazily grown DynamicCache"),
    Internal(f"{_CU}.StaticLayer", "recognise static caches"),
    Internal(f"{_CU}.EncoderDecoderCache", "find the self-attention cache of encoder-decoder caches"),
    Internal("transformers.models.auto.modeling_auto.MODEL_MAPPING_NAMES", "derive the auto_map of shared models"),
    Internal("transformers.generation.utils.GenerationMixin.prepare_inputs_for_generation",
             "tell the cache keyword of this release (`cache.cache_kwarg`)", ("input_ids",)),
    Internal(f"{_TR}.compute_loss", "add eta * KSVD (and distillation) to the task loss",
             ("model", "inputs", "return_outputs", "num_items_in_batch")),
    Internal(f"{_TR}.create_optimizer", "give new primal parameters their own parameter group"),
    Internal(f"{_TR}.prediction_step", "collect the KSVD loss during evaluation",
             ("model", "inputs", "prediction_loss_only", "ignore_keys")),
    Internal(f"{_TR}.evaluation_loop", "report eval_ksvd_loss under the caller's metric prefix",
             ("dataloader", "description", "prediction_loss_only", "ignore_keys", "metric_key_prefix")),
    Internal(f"{_TR}.get_decay_parameter_names", "keep weight decay off the primal parameter group", ("model",)),
    Internal(f"{_TR}.get_optimizer_cls_and_kwargs", "build the optimizer with the primal parameter group",
             ("args", "model")),
    Internal("transformers.utils.hub.PushToHubMixin._upload_modified_files",
             "upload the shareable folder, model card included",
             ("working_dir", "repo_id", "files_timestamps", "commit_message", "token", "create_pr", "revision",
              "commit_description")),
    Internal("torch._dynamo.mark_static_address", "keep static-cache buffers at fixed addresses for compiled decoding"),
    Internal(f"{_TR}.log", "log ksvd_loss, task_loss and distill_loss with the loss"),
)

# Instance attributes transformers' constructors set (so not resolvable on the class); tests/test_compat.py builds
# a tiny config and checks each.
CONFIG_ATTRIBUTES = (
    ("_attn_implementation", "switch a model to eager attention for `attention_spectrum` and back"),
)

# Set by Trainer.__init__; checked by PrimalTrainer after it ran (instances only).
TRAINER_ATTRIBUTES = ("model_accepts_loss_kwargs", "compute_loss_func", "loss_is_scaled_for_ga", "accelerator")


def _installed_version() -> str:
    import transformers

    return transformers.__version__


def _problem(entry: Internal, what: str) -> IncompatibleTransformersError:
    return IncompatibleTransformersError(
        f"hf_primal needs transformers{TRANSFORMERS_RANGE}, and the installed transformers {_installed_version()} "
        f"{what} `{entry.path}` (hf_primal uses it to {entry.why}). Install a supported version: "
        f"pip install 'transformers{TRANSFORMERS_RANGE}'."
    )


def _resolve(path: str) -> Any:
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)  # AttributeError: missing
        return obj
    raise ImportError(path)


def _has(path: str) -> bool:
    try:
        _resolve(path)
    except (ImportError, AttributeError):
        return False
    return True


def original(path: str) -> Any:
    """The object at a listed `path` (plain attribute access: a classmethod comes back bound)."""
    return _resolve(_entry(path).path)


_APPLIED: list[str] = []  # dotted paths of every attribute `patch` and `add` set, in order


def patch(path: str, replacement: Any, where_imported: bool = False) -> None:
    """Replace a listed internal marked ``patched`` (so every patch hf_primal makes is in `INTERNALS`).

    With `where_imported`, also replace the references that transformers modules took with ``from x import name``
    (a module function: those modules would otherwise keep calling the original).
    """
    entry = _entry(path)
    if not entry.patched:
        raise KeyError(f"{path!r} is listed in hf_primal.integration.compat.INTERNALS as relied on, not patched")
    owner_path, _, name = entry.path.rpartition(".")
    original_value = _resolve(entry.path) if where_imported else None
    _set(owner_path, name, replacement)
    if where_imported:
        for module_name, module in list(sys.modules.items()):
            if (module_name == "transformers" or module_name.startswith("transformers.")) and \
                    module_name != owner_path and getattr(module, name, None) is original_value:
                _set(module_name, name, replacement)


def patch_entry(path: str, key: str, replacement: Any) -> None:
    """Replace entry `key` of a listed mapping marked ``patched`` whose `keys` name it."""
    entry = _entry(path)
    if not entry.patched or key not in entry.keys:
        raise KeyError(f"{path}[{key!r}] is not listed as a patched entry in hf_primal.integration.compat.INTERNALS")
    _resolve(entry.path)[key] = replacement
    if f"{entry.path}[{key}]" not in _APPLIED:
        _APPLIED.append(f"{entry.path}[{key}]")


def add(path: str, value: Any) -> None:
    """Give a transformers class a listed attribute marked ``added``."""
    entry = _entry(path)
    if not entry.added:
        raise KeyError(f"{path!r} is listed in hf_primal.integration.compat.INTERNALS, but not as added")
    owner_path, _, name = entry.path.rpartition(".")
    _set(owner_path, name, value)


def _set(owner_path: str, name: str, value: Any) -> None:
    setattr(_resolve(owner_path), name, value)
    if f"{owner_path}.{name}" not in _APPLIED:
        _APPLIED.append(f"{owner_path}.{name}")


def applied() -> list[str]:
    """Every transformers attribute hf_primal has set (dotted path)."""
    return list(_APPLIED)


def patched_internals() -> list[str]:
    return [entry.path for entry in INTERNALS if entry.patched]


def _entry(path: str) -> Internal:
    for entry in INTERNALS:
        if entry.path == path:
            return entry
    raise KeyError(f"{path!r} is not listed in hf_primal.integration.compat.INTERNALS; list every transformers "
                   "internal you use")


def check_transformers(internals: tuple[Internal, ...] = INTERNALS) -> None:
    """Raise `IncompatibleTransformersError` for the first internal that is missing or lost a parameter."""
    for entry in internals:
        if entry.added:
            if entry.path not in _APPLIED and _has(entry.path):
                raise _problem(entry, "already has an attribute of its own at")
            continue
        try:
            obj = _resolve(entry.path)
        except (ImportError, AttributeError):
            raise _problem(entry, "has no") from None
        if entry.keys:
            absent = [key for key in entry.keys if key not in obj]
            if absent:
                raise _problem(entry, f"has no entries {absent} in")
            values = [obj[key] for key in entry.keys]
        else:
            values = [obj]
        for value in values if entry.params else ():
            func = value.__func__ if inspect.ismethod(value) else value
            try:
                accepted = inspect.signature(func).parameters
            except (TypeError, ValueError):
                raise _problem(entry, "has an uninspectable") from None
            missing = [p for p in entry.params if p not in accepted]
            if missing:
                raise _problem(entry, f"dropped the parameter(s) {missing} of")
    _warn_outside_range()


def _warn_outside_range() -> None:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    installed = Version(_installed_version())
    if Version(installed.base_version) not in SpecifierSet(TRANSFORMERS_RANGE):
        warnings.warn(
            f"hf_primal is tested with transformers{TRANSFORMERS_RANGE}; the installed {installed} is outside that "
            "range. Every hooked internal was found, but results are untested.",
            stacklevel=3,
        )


def check_trainer_instance(trainer: Any) -> None:
    """After `Trainer.__init__`: the attributes PrimalTrainer reads must exist."""
    missing = [name for name in TRAINER_ATTRIBUTES if not hasattr(trainer, name)]
    if missing:
        raise IncompatibleTransformersError(
            f"hf_primal needs transformers{TRANSFORMERS_RANGE}, and Trainer of the installed transformers "
            f"{_installed_version()} does not set {missing} (PrimalTrainer reads them to scale the KSVD loss under "
            f"gradient accumulation). Install a supported version: pip install 'transformers{TRANSFORMERS_RANGE}'."
        )
