"""Helpers shared by the family readers: typed config access, backbone, heads, DraftSpec assembly.

Every accessor names the exact key (dotted path) in its error, because a user facing a
refused checkpoint needs to know which line of config.json to look at.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, overload

from dspark.errors import FormatError
from dspark.formats.spec import (
    MARKOV_HEAD_TYPES,
    Backbone,
    DraftSpec,
    FormatName,
    LayerAttention,
    Layout,
    query_slots_for,
)

_MISSING = object()


# ---------------------------------------------------------------- typed access


def key_path(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _is_int(value: Any) -> bool:
    # JSON booleans are Python ints; a `true` where a count belongs is a typo, not 1.
    return isinstance(value, int) and not isinstance(value, bool)


def get_int(cfg: dict, key: str, prefix: str = "", *, default: Any = _MISSING, minimum: int | None = None):
    where = key_path(prefix, key)
    value = cfg.get(key, _MISSING)
    if value is _MISSING or value is None:
        if default is _MISSING:
            raise FormatError(f"{where} is missing (an integer is required)")
        return default
    if not _is_int(value):
        raise FormatError(f"{where} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise FormatError(f"{where} must be >= {minimum}, got {value}")
    return value


def get_float(cfg: dict, key: str, prefix: str = "", *, default: Any = _MISSING) -> float:
    where = key_path(prefix, key)
    value = cfg.get(key, _MISSING)
    if value is _MISSING or value is None:
        if default is _MISSING:
            raise FormatError(f"{where} is missing (a number is required)")
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise FormatError(f"{where} must be a finite number, got {value!r}")
    return float(value)


def get_bool(cfg: dict, key: str, prefix: str = "", *, default: Any = _MISSING):
    where = key_path(prefix, key)
    value = cfg.get(key, _MISSING)
    if value is _MISSING:
        if default is _MISSING:
            raise FormatError(f"{where} is missing (true or false is required)")
        return default
    if not isinstance(value, bool):
        raise FormatError(f"{where} must be true or false, got {value!r}")
    return value


def get_str(cfg: dict, key: str, prefix: str = "", *, default: Any = _MISSING):
    where = key_path(prefix, key)
    value = cfg.get(key, _MISSING)
    if value is _MISSING or value is None:
        if default is _MISSING:
            raise FormatError(f"{where} is missing (a string is required)")
        return default
    if not isinstance(value, str):
        raise FormatError(f"{where} must be a string, got {value!r}")
    return value


@overload
def get_dict(cfg: dict, key: str, prefix: str = "", *, required: Literal[True] = True) -> dict: ...
@overload
def get_dict(cfg: dict, key: str, prefix: str = "", *, required: bool) -> dict | None: ...
def get_dict(cfg: dict, key: str, prefix: str = "", *, required: bool = True) -> dict | None:
    where = key_path(prefix, key)
    value = cfg.get(key)
    if value is None:
        if required:
            raise FormatError(f"{where} is missing (an object is required)")
        return None
    if not isinstance(value, dict):
        raise FormatError(f"{where} must be an object, got {type(value).__name__}")
    return value


def normalize_name(value: Any, where: str) -> str:
    """Author-controlled type strings: compared after strip/lower; anything but a string is refused."""
    if not isinstance(value, str):
        raise FormatError(f"{where} must be a string, got {value!r}")
    return value.strip().lower()


def get_layer_ids(cfg: dict, key: str, prefix: str = "", *, minimum: int) -> tuple[int, ...]:
    where = key_path(prefix, key)
    value = cfg.get(key)
    if value is None:
        raise FormatError(f"{where} is missing (a list of layer ids is required)")
    if not isinstance(value, list) or not value:
        raise FormatError(f"{where} must be a non-empty list of integers, got {value!r}")
    ids: list[int] = []
    for i, item in enumerate(value):
        if not _is_int(item):
            raise FormatError(f"{where}[{i}] must be an integer, got {item!r}")
        if item < minimum:
            raise FormatError(f"{where}[{i}] must be >= {minimum}, got {item}")
        if ids and item <= ids[-1]:
            raise FormatError(f"{where} must be strictly increasing, got {value}")
        ids.append(item)
    return tuple(ids)


# ---------------------------------------------------------------- backbone


def rope_from(cfg: dict, prefix: str, warnings: list[str], head_dim: int) -> tuple[float, dict | None]:
    """(rope_theta, extra rope parameters) from either transformers 5 `rope_parameters` or legacy keys."""
    params = get_dict(cfg, "rope_parameters", prefix, required=False)
    prefix_params = key_path(prefix, "rope_parameters")
    if params is not None and "rope_theta" not in params and isinstance(params.get("full_attention"), dict):
        # Gemma-style configs key the parameters by attention type; the draft layers are full attention.
        params, prefix_params = params["full_attention"], key_path(prefix_params, "full_attention")
    theta_new = get_float(params, "rope_theta", prefix_params, default=None) if params else None
    theta_old = get_float(cfg, "rope_theta", prefix, default=None)
    if theta_new is not None and theta_old is not None and theta_new != theta_old:
        raise FormatError(
            f"{key_path(prefix, 'rope_theta')}={theta_old} contradicts {prefix_params}.rope_theta={theta_new}"
        )
    theta = theta_new if theta_new is not None else theta_old
    if theta is None:
        # A wrong RoPE base loads and runs but accepts little (docs/DESIGN.md §9): say so.
        theta = 10_000.0
        warnings.append(f"{key_path(prefix, 'rope_theta')} absent: using the transformers default 10000.0")
    extra = None
    if params:
        extra = {k: v for k, v in params.items() if k != "rope_theta"}
    legacy = get_dict(cfg, "rope_scaling", prefix, required=False)
    if legacy:
        extra = {**(extra or {}), **legacy}
    if extra is not None and "type" in extra and "rope_type" not in extra:
        # transformers 4 spelled it `type`; one spelling keeps writers from emitting both.
        extra["rope_type"] = extra.pop("type")
    if extra is not None and extra.get("rope_type", "default") == "default":
        extra = None
    if theta < 1:
        # RoPE's base: below 1 a head turns faster than a radian a position, and a tiny base
        # overflows the frequencies to inf (NaN positions, then NaN draft probabilities)
        where = f"{prefix_params}.rope_theta" if theta_new is not None else key_path(prefix, "rope_theta")
        raise FormatError(f"{where} must be >= 1, got {theta}")
    if extra is not None:
        check_rope(extra, key_path(prefix, "rope_parameters" if params else "rope_scaling"), head_dim)
    return theta, extra


# transformers 5.19's RoPE types (its ROPE_INIT_FUNCTIONS, and "default") and the keys each one
# requires beyond rope_type and rope_theta (it fills original_max_position_embeddings in itself).
# A type or key it lacks fails deep inside transformers when the draft is built (a KeyError, a
# TypeError), so the reader refuses it first, naming the key. tests/test_fuzz_files.py holds this
# table against transformers' own.
ROPE_REQUIRED = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "longrope": ("short_factor", "long_factor"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "proportional": (),
}
ROPE_NUMBERS = (
    "factor",
    "attention_factor",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "low_freq_factor",
    "high_freq_factor",
)


def check_rope(extra: dict, where: str, head_dim: int) -> None:
    """The RoPE parameters beyond theta: a known type, its required keys, numbers where numbers go."""
    kind = extra.get("rope_type", "default")
    if not isinstance(kind, str) or kind not in ROPE_REQUIRED:
        raise FormatError(f"{where}.rope_type is {kind!r}: expected one of {', '.join(ROPE_REQUIRED)}")
    for key in ROPE_REQUIRED[kind]:
        if extra.get(key) is None:
            raise FormatError(f"{where}.{key} is missing (rope_type {kind!r} needs it)")
    for key in ROPE_NUMBERS:
        if key in extra and extra[key] is not None:
            get_float(extra, key, where)
    if "factor" in extra and extra["factor"] is not None and extra["factor"] < 1:
        raise FormatError(f"{where}.factor must be >= 1 (transformers' range), got {extra['factor']}")
    if extra.get("original_max_position_embeddings") is not None:
        get_int(extra, "original_max_position_embeddings", where, minimum=1)
    if extra.get("partial_rotary_factor") not in (None, 1, 1.0):
        # dspark's draft layers rotate the whole head: a partly rotated head would not match
        raise FormatError(
            f"{where}.partial_rotary_factor {extra['partial_rotary_factor']!r} is not supported "
            "(only 1: the whole head rotated)"
        )
    for key in ("short_factor", "long_factor"):
        v = extra.get(key)
        if v is not None and (
            not isinstance(v, list)
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v)
        ):
            raise FormatError(f"{where}.{key} must be a list of finite numbers, got {v!r}")
        if v is not None and len(v) != head_dim // 2:  # one per rotated frequency
            raise FormatError(f"{where}.{key} has {len(v)} entries, expected head_dim / 2 = {head_dim // 2}")


def parse_backbone(cfg: dict, prefix: str, *, family: str, qk_norm: bool, warnings: list[str]) -> Backbone:
    hidden = get_int(cfg, "hidden_size", prefix, minimum=1)
    heads = get_int(cfg, "num_attention_heads", prefix, minimum=1)
    kv_heads = get_int(cfg, "num_key_value_heads", prefix, default=heads, minimum=1)
    if heads % kv_heads:
        raise FormatError(
            f"{key_path(prefix, 'num_attention_heads')}={heads} is not a multiple of "
            f"{key_path(prefix, 'num_key_value_heads')}={kv_heads}"
        )
    if "head_dim" in cfg and cfg["head_dim"] is not None:
        head_dim = get_int(cfg, "head_dim", prefix, minimum=1)
    elif hidden % heads:
        raise FormatError(
            f"{key_path(prefix, 'head_dim')} is missing and hidden_size={hidden} is not divisible by "
            f"num_attention_heads={heads}"
        )
    else:
        head_dim = hidden // heads
    eps = get_float(cfg, "rms_norm_eps", prefix, default=None)
    if eps is None:
        eps = 1e-6
        warnings.append(f"{key_path(prefix, 'rms_norm_eps')} absent: using 1e-06")
    if eps <= 0:
        # the norm divides by sqrt(mean(x^2) + eps): a zero row (a padding mask embedding) is NaN
        raise FormatError(f"{key_path(prefix, 'rms_norm_eps')} must be > 0, got {eps}")
    theta, rope_extra = rope_from(cfg, prefix, warnings, head_dim)
    act_key = "hidden_act" if "hidden_act" in cfg else "hidden_activation"
    act = get_str(cfg, act_key, prefix, default=None)
    if act is None:
        act = "silu"
        warnings.append(f"{key_path(prefix, 'hidden_act')} absent: using silu")
    if act not in ACTIVATIONS:
        raise FormatError(
            f"{key_path(prefix, act_key)} is {act!r}: not an activation transformers knows "
            f"({', '.join(sorted(ACTIVATIONS))})"
        )
    return Backbone(
        hidden_size=hidden,
        num_layers=get_int(cfg, "num_hidden_layers", prefix, minimum=1),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=get_int(cfg, "intermediate_size", prefix, minimum=1),
        rms_norm_eps=eps,
        rope_theta=theta,
        rope_scaling=rope_extra,
        max_position_embeddings=get_int(cfg, "max_position_embeddings", prefix, default=32768, minimum=1),
        hidden_act=act,
        attention_bias=get_bool(cfg, "attention_bias", prefix, default=False),
        qk_norm=qk_norm,
        family=family,
    )


# transformers 5.19's activation names (its ACT2CLS): the draft's MLP looks hidden_act up there, and
# a name it lacks is a KeyError when the draft is built (held against transformers' table by
# tests/test_fuzz_files.py).
ACTIVATIONS = frozenset(
    {
        "gelu",
        "gelu_10",
        "gelu_accurate",
        "gelu_fast",
        "gelu_new",
        "gelu_python",
        "gelu_python_tanh",
        "gelu_pytorch_tanh",
        "hardswish",
        "laplace",
        "leaky_relu",
        "linear",
        "mish",
        "prelu",
        "quick_gelu",
        "relu",
        "relu2",
        "relu6",
        "sigmoid",
        "silu",
        "sqrtsoftplus",
        "swish",
        "tanh",
        "xielu",
    }
)


# Config classes whose __post_init__ sets sliding_window to None unless use_sliding_window is true.
GATED_WINDOW_MODEL_TYPES = {"qwen3", "qwen2"}


def window_is_gated(cfg: dict, default_model_type: str | None) -> bool:
    model_type = cfg.get("model_type", default_model_type)
    return isinstance(model_type, str) and model_type.strip().lower() in GATED_WINDOW_MODEL_TYPES


def layer_attention_from(
    cfg: dict, prefix: str, num_layers: int, *, sliding_causal: bool, gated_window: bool = False
) -> tuple[LayerAttention, ...]:
    """One LayerAttention per draft layer from HF `layer_types` (absent: transformers' Qwen3 rule).

    gated_window: the loading config class drops sliding_window unless use_sliding_window is true.
    """
    where = key_path(prefix, "layer_types")
    types = cfg.get("layer_types")
    if types is None:
        types = _implicit_layer_types(cfg, prefix, num_layers)
    if not isinstance(types, list) or len(types) != num_layers:
        raise FormatError(f"{where} must list one entry per draft layer ({num_layers}), got {types!r}")
    window = None
    out = []
    for i, kind in enumerate(types):
        kind_n = normalize_name(kind, f"{where}[{i}]")
        if kind_n == "full_attention":
            out.append(LayerAttention(None, False))
        elif kind_n == "sliding_attention":
            if gated_window and cfg.get("use_sliding_window") is not True:
                # Loaders (transformers, speculators, vLLM) would run this layer without a window.
                raise FormatError(
                    f"{where}[{i}] is 'sliding_attention' but {key_path(prefix, 'use_sliding_window')} is not "
                    "true, so transformers drops sliding_window: set use_sliding_window or the layer type"
                )
            if window is None:
                window = get_int(cfg, "sliding_window", prefix, minimum=1)
            out.append(LayerAttention(window, sliding_causal))
        else:
            raise FormatError(f"{where}[{i}] is {kind!r}: expected 'full_attention' or 'sliding_attention'")
    return tuple(out)


def _implicit_layer_types(cfg: dict, prefix: str, num_layers: int) -> list[str]:
    """transformers' Qwen3 rule when layer_types is absent: sliding from max_window_layers on, if enabled."""
    use = get_bool(cfg, "use_sliding_window", prefix, default=False)
    if not use or cfg.get("sliding_window") is None:
        return ["full_attention"] * num_layers
    first = get_int(cfg, "max_window_layers", prefix, default=28, minimum=0)
    return ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]


# ---------------------------------------------------------------- heads


@dataclass
class Heads:
    markov_rank: int
    markov_head_type: str
    confidence_head: bool
    confidence_head_with_markov: bool


def parse_heads(cfg: dict, prefix: str, *, defaults: dict | None, warnings: list[str], source: str) -> Heads:
    """Markov and confidence head settings.

    `defaults` is the family's documented default for each absent key (None: the key is required);
    every default used is reported in `warnings` because it changes what is sampled.
    """
    defaults = defaults or {}

    def pick(key: str, getter, **kw):
        if key in cfg and cfg[key] is not None:
            return getter(cfg, key, prefix, **kw)
        if key not in defaults:
            raise FormatError(f"{key_path(prefix, key)} is missing")
        warnings.append(f"{key_path(prefix, key)} absent: using the {source} default {defaults[key]!r}")
        return defaults[key]

    rank = pick("markov_rank", get_int, minimum=0)
    if rank > 0:
        raw_type = pick("markov_head_type", get_str)
        head_type = normalize_name(raw_type, key_path(prefix, "markov_head_type"))
    else:
        # No Markov head: the type is irrelevant, whatever the file says.
        raw = cfg.get("markov_head_type", "vanilla")
        head_type = normalize_name(raw, key_path(prefix, "markov_head_type")) if raw is not None else "vanilla"
    if head_type not in MARKOV_HEAD_TYPES:
        raise FormatError(
            f"{key_path(prefix, 'markov_head_type')} is {cfg.get('markov_head_type')!r}: "
            f"expected one of {', '.join(MARKOV_HEAD_TYPES)}"
        )
    confidence = pick("enable_confidence_head", get_bool)
    with_markov = False
    if confidence:
        with_markov = pick("confidence_head_with_markov", get_bool)
        if with_markov and rank == 0:
            raise FormatError(
                f"{key_path(prefix, 'confidence_head_with_markov')} is true but "
                f"{key_path(prefix, 'markov_rank')} is 0 (no Markov embedding to feed the confidence head)"
            )
    return Heads(rank, head_type, confidence, with_markov)


# ---------------------------------------------------------------- assembly


@dataclass
class Resolved:
    """What a reader decided, before the generic checks turn it into a DraftSpec."""

    format: FormatName
    layout: Layout
    layout_source: str
    gamma: int
    block_size: int
    hidden_state_indices: tuple[int, ...]
    mask_token_id: int
    mask_key: str
    vocab_size: int
    draft_vocab_size: int
    heads: Heads
    backbone: Backbone
    layer_attention: tuple[LayerAttention, ...]
    target_hidden_size: int
    verifier: str | None
    has_d2t: bool
    warnings: list[str] = field(default_factory=list)


def build_spec(r: Resolved) -> DraftSpec:
    if r.gamma < 1:
        raise FormatError(f"{r.layout} layout with block_size {r.block_size} proposes {r.gamma} tokens (need >= 1)")
    if r.mask_token_id < 0:
        raise FormatError(f"{r.mask_key} must be >= 0, got {r.mask_token_id}")
    if r.mask_token_id >= r.vocab_size:
        raise FormatError(f"{r.mask_key}={r.mask_token_id} is outside the vocabulary (vocab_size {r.vocab_size})")
    if r.draft_vocab_size > r.vocab_size:
        raise FormatError(f"draft_vocab_size {r.draft_vocab_size} is larger than vocab_size {r.vocab_size}")
    if len(r.layer_attention) != r.backbone.num_layers:
        raise FormatError(f"{len(r.layer_attention)} layer attention entries for {r.backbone.num_layers} layers")
    return DraftSpec(
        format=r.format,
        layout=r.layout,
        layout_source=r.layout_source,
        gamma=r.gamma,
        query_slots=query_slots_for(r.layout, r.gamma),
        block_size=r.block_size,
        hidden_state_indices=r.hidden_state_indices,
        mask_token_id=r.mask_token_id,
        vocab_size=r.vocab_size,
        draft_vocab_size=r.draft_vocab_size,
        has_d2t=r.has_d2t,
        markov_rank=r.heads.markov_rank,
        markov_head_type=r.heads.markov_head_type,
        confidence_head=r.heads.confidence_head,
        confidence_head_with_markov=r.heads.confidence_head_with_markov,
        num_layers=r.backbone.num_layers,
        hidden_size=r.backbone.hidden_size,
        layer_attention=r.layer_attention,
        verifier=r.verifier,
        warnings=tuple(r.warnings),
        backbone=r.backbone,
        target_hidden_size=r.target_hidden_size,
    )


def has_d2t_for(weights, vocab_size: int, draft_vocab_size: int) -> bool:
    """With weights: whether d2t is stored. Without: whether the draft vocabulary needs one."""
    if weights is not None:
        return weights.has("d2t")
    return draft_vocab_size < vocab_size
