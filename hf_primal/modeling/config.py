"""`PrimalAttentionConfig`: what a model's `config.json` says about its primal layers.

Plain Python on purpose (no torch, no transformers): this file is copied next to converted checkpoints
as remote code and must import anywhere.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

LayersSpec = Union[str, list[int]]

# hf_primal's version (the package's __version__), written into every saved config.json as "hf_primal_version" so
# that an older hf_primal can name the version of a folder it cannot read.
VERSION = "0.1.0"

KSVD_REDUCTIONS = ("sequence", "batch")  # how the KSVD loss is reduced (docs/method.md)
# What fills the p slots of an encoder layer (docs/method.md, "Sampling"). A stored primal_attention without the
# field was written before "even" existed and keeps the rule it was trained with.
SAMPLING_RULES = ("even", "legacy", "segment_mean", "jitter")
SAMPLING_WHEN_NOT_SAVED = "legacy"
# How a causal layer weighs the tokens before it (docs/method.md, "Causal layer"): per-head decayed sums, or the
# paper's prefix mean (every earlier token the same weight). A stored primal_attention without the field was written
# before "decay" existed and keeps the prefix mean it was trained with.
CAUSAL_MIXING = ("decay", "prefix_mean")
CAUSAL_MIXING_WHEN_NOT_SAVED = "prefix_mean"
# What a selected layer computes: Primal-Attention, or KEP-SVGP attention (a Gaussian-process head on the same KSVD
# scores, docs/method.md "KEP-SVGP"), with its two readings of the covariance parameters.
VARIANTS = ("primal", "kep_svgp")
COVARIANCES = ("consistent", "reference")
_KEP_FIELDS = ("eta_kl", "covariance")
# How many of its latest tokens a causal layer's generation cache can take back (cache_layers.py uses it).
DEFAULT_CROP_WINDOW = 64


def loss_weight(value: Any, name: str) -> float:
    """`value` as a float when it is a finite real number >= 0 (a loss term's weight), else a ValueError naming
    `name`, the value and what is allowed."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (0 <= value < float("inf")):
        raise ValueError(f"{name}={value!r} is not allowed: it must be a finite real number >= 0.")
    return float(value)


LAYERS_SYNTAX = '"all" or comma-separated integer layer indices such as "-1" or "0,3"'


def parse_layers(text: str) -> LayersSpec:
    """A layer selection as typed on a command line (the CLI's ``--layers``, the scripts' ``--primal_layers``).

    ``"all"`` in any case -> ``"all"``; ``"-1"`` -> ``[-1]``; ``" 0, 3 "`` -> ``[0, 3]``. Anything else, including an
    empty entry (``"0,,3"``) or an empty string, is a ValueError naming the value and the syntax.
    """
    value = text.strip()
    if value.lower() == "all":
        return "all"
    parts = [part.strip() for part in value.split(",")]
    try:
        if "" in parts:
            raise ValueError
        return [int(part) for part in parts]
    except ValueError:
        raise ValueError(f"layers {text!r} is not allowed: use {LAYERS_SYNTAX} (no empty entries).") from None


def resolve_layer_indices(layers: Any, num_layers: int) -> list[int]:
    """A ``layers`` selection ("all" or indices, negative from the end) as sorted indices into ``range(num_layers)``;
    raises ValueError when an index does not exist or names a layer twice. Plain Python on the stored value, so
    torch.compile traces it (`Architecture.attends_only_through_primal` calls it at every forward)."""
    if layers == "all":
        return list(range(num_layers))
    resolved = []
    for index in layers:
        if not -num_layers <= index < num_layers:
            raise ValueError(
                f"PrimalAttentionConfig.layers={layers!r}: index {index} is out of range for a model with "
                f"{num_layers} attention layers (allowed: {-num_layers} .. {num_layers - 1})."
            )
        resolved.append(index % num_layers)
    if len(set(resolved)) != len(resolved):
        raise ValueError(
            f"PrimalAttentionConfig.layers={layers!r} names the same layer twice once negative indices are "
            f"resolved against {num_layers} layers ({resolved})."
        )
    return sorted(resolved)

@dataclass
class PrimalAttentionConfig:
    """Which attention layers run Primal-Attention, and with what hyper-parameters.

    Args:
        layers: Layer indices to make primal (negative indices count from the end, as in Python), or
            ``"all"``. The default ``[-1]`` is the paper's "Primal.+" (only the last layer); ``"all"`` is
            "Primal." (PrimalFormer).
        low_rank: ``s``, the number of KSVD projection directions per head.
        rank_multi: ``m``; encoders sample ``p = min(N_max, s * m)`` tokens to build the data-dependent
            projection weights (``N_max`` = the model's maximum sequence length).
        eta: weight of the KSVD regulariser added to the task loss by `PrimalTrainer`.
        ksvd_reduction: ``"sequence"`` (J per sequence, squared, then averaged; the default) or ``"batch"``
            (J over the whole batch, as in the paper's CV/LRA code).
        sampling: what fills the p slots of an encoder layer's W_{e|X} (docs/method.md, "Sampling").
            ``"segment_mean"`` (the default): the L valid tokens cut into p consecutive runs, each slot the mean of
            its run, so every token reaches the weights; for L < p each slot holds one token, as under ``"even"``.
            ``"even"`` (the paper's rule): p single tokens evenly spaced over the valid tokens, and for L < p every
            valid token in floor(p/L) or ceil(p/L) slots. ``"jitter"``: while training (``model.train()``) each slot
            takes a uniformly drawn token of its run, a fresh draw every forward; at inference it samples as
            ``"even"``. ``"legacy"``: the rule of hf_primal 0.1 (for L < p the last valid token gets one slot, the
            others about p/L). The three rules agree with ``"even"`` on inputs shorter than p. Configs saved without
            the field (hf_primal 0.1) load with ``"legacy"``; see `saved_config_dict`. Causal layers sample nothing.
        causal_mixing: how a causal (decoder) layer weighs the tokens before it (docs/method.md, "Causal layer").
            ``"decay"`` (the default): head h keeps sums of q and k in which a token's weight shrinks by gamma_h at
            every later valid token, gamma_h = 1 - 2^-b_h with b_h evenly spaced from 1 to 10 over the heads (windows
            of about 2 to 1,024 tokens), so some heads read the last few tokens and others the whole context.
            ``"prefix_mean"``: the paper's rule, the plain mean of every earlier q and k. Both keep a generation state
            of constant size. Configs saved without the field load with ``"prefix_mean"``. Encoders ignore it.
        crop_window: ``W``, how many of the latest tokens a causal layer's generation cache can take back
            (``cache.crop``, used by assisted and prompt-lookup decoding). While a cache records its past (transformers
            calls ``activate_past_recording`` for those modes) each causal primal layer keeps the running state after
            each of its last W + 1 tokens; cropping more than W tokens at once raises an error. From transformers 5.25
            ``generate`` says how many tokens it drafts per step, and the window widens to that when it is larger.
        variant: ``"primal"`` (the default) or ``"kep_svgp"``: KEP-SVGP attention (encoders only), whose posterior
            gives calibrated uncertainty (`hf_primal.predict_with_uncertainty`); docs/method.md, "KEP-SVGP".
        eta_kl: KEP-SVGP only: weight of the layers' KL term, which `PrimalTrainer` adds beside eta * KSVD.
        covariance: KEP-SVGP only: ``"consistent"`` (the KL is that of the sampled posterior) or ``"reference"``
            (the authors' layer and KL, for reproduction).
    """

    layers: LayersSpec = field(default_factory=lambda: [-1])
    low_rank: int = 30
    rank_multi: int = 10
    eta: float = 0.1
    ksvd_reduction: str = "sequence"
    crop_window: int = DEFAULT_CROP_WINDOW
    sampling: str = "segment_mean"
    causal_mixing: str = "decay"
    variant: str = "primal"
    eta_kl: float = 1.0
    covariance: str = "consistent"

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        if isinstance(self.layers, str):
            if self.layers != "all":
                raise ValueError(
                    f"PrimalAttentionConfig.layers={self.layers!r} is not allowed: use 'all' or a list of layer "
                    "indices such as [-1] or [0, 3]."
                )
        elif isinstance(self.layers, Sequence) and not isinstance(self.layers, (bytes, bytearray)):
            bad = [x for x in self.layers if isinstance(x, bool) or not isinstance(x, numbers.Integral)]
            if bad or len(self.layers) == 0:
                raise ValueError(
                    f"PrimalAttentionConfig.layers={list(self.layers)!r} is not allowed: it must be 'all' or a "
                    "non-empty list of integer layer indices (negative indices count from the end)."
                )
            self.layers = [int(x) for x in self.layers]
            if len(set(self.layers)) != len(self.layers):
                raise ValueError(
                    f"PrimalAttentionConfig.layers={self.layers!r} contains duplicated indices; each layer may "
                    "appear once."
                )
        else:
            raise ValueError(
                f"PrimalAttentionConfig.layers={self.layers!r} (type {type(self.layers).__name__}) is not allowed: "
                "it must be 'all' or a list of integer layer indices such as [-1]."
            )
        for name in ("low_rank", "rank_multi", "crop_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"PrimalAttentionConfig.{name}={value!r} is not allowed: it must be an integer >= 1.")
            setattr(self, name, int(value))
        self.eta = loss_weight(self.eta, "PrimalAttentionConfig.eta")
        if self.ksvd_reduction not in KSVD_REDUCTIONS:
            raise ValueError(
                f"PrimalAttentionConfig.ksvd_reduction={self.ksvd_reduction!r} is not allowed: use one of "
                f"{list(KSVD_REDUCTIONS)}."
            )
        if self.sampling not in SAMPLING_RULES:
            raise ValueError(
                f"PrimalAttentionConfig.sampling={self.sampling!r} is not allowed: use one of {list(SAMPLING_RULES)}."
            )
        for name, allowed in (("causal_mixing", CAUSAL_MIXING), ("variant", VARIANTS), ("covariance", COVARIANCES)):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"PrimalAttentionConfig.{name}={getattr(self, name)!r} is not allowed: use one of {list(allowed)}."
                )
        self.eta_kl = loss_weight(self.eta_kl, "PrimalAttentionConfig.eta_kl")

    def resolve_layers(self, num_layers: int) -> list[int]:
        """Map `layers` onto ``range(num_layers)``; raises ValueError when an index does not exist."""
        return resolve_layer_indices(self.layers, num_layers)

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        """The plain-JSON form stored under ``"primal_attention"`` in ``config.json``.

        ``crop_window`` is written only when it differs from its default, so that checkpoints which do not change
        it keep the fields that earlier hf_primal versions (and remote code copied with them) read. ``sampling`` and
        ``causal_mixing`` are always written: the absence of either marks a config saved before it existed
        (`saved_config_dict`). The
        KEP-SVGP fields are written only for ``variant="kep_svgp"``, so primal folders keep the fields earlier
        versions read.
        """
        data = dataclasses.asdict(self)
        if data["crop_window"] == DEFAULT_CROP_WINDOW:
            del data["crop_window"]
        if self.variant == "primal":
            for name in ("variant", *_KEP_FIELDS):
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "PrimalAttentionConfig":
        allowed = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise ValueError(
                f"primal_attention has unknown field(s) {unknown}; allowed fields are {sorted(allowed)}."
            )
        misplaced = [name for name in _KEP_FIELDS if name in data]
        if misplaced and data.get("variant", "primal") != "kep_svgp":
            raise ValueError(
                f"primal_attention field(s) {misplaced} apply to variant='kep_svgp' only; got variant="
                f"{data.get('variant', 'primal')!r}. Add \"variant\": \"kep_svgp\" or drop them."
            )
        return cls(**dict(data))

    @classmethod
    def coerce(cls, value: Any) -> "PrimalAttentionConfig":
        """Accept a `PrimalAttentionConfig` or a dict (e.g. read from config.json)."""
        if isinstance(value, cls):
            value.validate()
            return value
        # Duck-typed: the remote-code copy of this class is a different class object.
        if dataclasses.is_dataclass(value) and type(value).__name__ == cls.__name__:
            return cls.from_dict(dataclasses.asdict(value))
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        raise ValueError(
            f"primal_attention={value!r} (type {type(value).__name__}) is not allowed: pass a PrimalAttentionConfig, "
            "a dict of its fields, or None."
        )


def saved_config_dict(config_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A model's config.json dict as read from disk, with the sampling and causal mixing rules its primal layers were
    saved with.

    A ``primal_attention`` entry without ``sampling`` was written by hf_primal 0.1, whose only rule is ``"legacy"``;
    one without ``causal_mixing`` was written before ``"decay"`` existed, when causal layers took the prefix mean.
    Each missing rule is filled in explicitly, so that the checkpoint keeps computing what it was trained to compute.
    (Dicts a user writes, e.g. ``from_pretrained(path, primal_attention={...})``, do not pass through here and get
    the current defaults.)
    """
    spec = config_dict.get("primal_attention")
    if isinstance(spec, Mapping):
        saved = {"sampling": SAMPLING_WHEN_NOT_SAVED, "causal_mixing": CAUSAL_MIXING_WHEN_NOT_SAVED}
        missing = {name: rule for name, rule in saved.items() if name not in spec}
        if missing:
            return {**config_dict, "primal_attention": {**spec, **missing}}
    return dict(config_dict)
