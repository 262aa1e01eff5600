"""speculators-format DSpark drafts (`speculators_model_type: "dspark"`), docs/DESIGN.md §3-§4.

The layout is the one thing engines get silently wrong here, so it is decided from every
signal in the file and any disagreement between them is refused rather than guessed.
"""

from __future__ import annotations

from dspark.errors import FormatError
from dspark.formats.common import (
    Resolved,
    build_spec,
    get_bool,
    get_dict,
    get_int,
    get_layer_ids,
    get_str,
    has_d2t_for,
    layer_attention_from,
    normalize_name,
    parse_backbone,
    parse_heads,
    window_is_gated,
)
from dspark.formats.spec import DraftSpec, FormatName, Layout

FORMAT: FormatName = "speculators"
MODEL_TYPE = "dspark"
TL = "transformer_layer_config"

# The pydantic defaults of speculators' DSparkSpeculatorConfig: files written by versions
# that predate a field load with these values in speculators itself.
HEAD_DEFAULTS = {
    "markov_rank": 256,
    "markov_head_type": "vanilla",
    "enable_confidence_head": True,
    "confidence_head_with_markov": True,
}


def detect(config: dict) -> bool:
    return "speculators_model_type" in config


def read(config: dict, weights_meta) -> DraftSpec:
    model_type = normalize_name(config["speculators_model_type"], "speculators_model_type")
    if model_type != MODEL_TYPE:
        raise FormatError(
            f"speculators_model_type is {config['speculators_model_type']!r}: only 'dspark' drafts are supported"
        )
    warnings: list[str] = []
    block_size = get_int(config, "block_size", minimum=1)
    layout, source, gamma = resolve_layout(config, block_size, warnings)

    tl = get_dict(config, TL)
    family, qk_norm = _family(tl, weights_meta)
    backbone = parse_backbone(tl, TL, family=family, qk_norm=qk_norm, warnings=warnings)
    vocab = get_int(tl, "vocab_size", TL, minimum=1)
    draft_vocab = get_int(config, "draft_vocab_size", minimum=1)
    non_causal = get_bool(config, "sliding_window_non_causal", default=False)
    target_hidden = get_int(config, "target_hidden_size", default=backbone.hidden_size, minimum=1)

    return build_spec(
        Resolved(
            format=FORMAT,
            layout=layout,
            layout_source=source,
            gamma=gamma,
            block_size=block_size,
            hidden_state_indices=get_layer_ids(config, "aux_hidden_state_layer_ids", minimum=0),
            mask_token_id=get_int(config, "mask_token_id"),
            mask_key="mask_token_id",
            vocab_size=vocab,
            draft_vocab_size=draft_vocab,
            heads=parse_heads(config, "", defaults=HEAD_DEFAULTS, warnings=warnings, source="speculators"),
            backbone=backbone,
            layer_attention=layer_attention_from(
                tl, TL, backbone.num_layers, sliding_causal=not non_causal, gated_window=window_is_gated(tl, "qwen3")
            ),
            target_hidden_size=target_hidden,
            verifier=_verifier(config),
            has_d2t=has_d2t_for(weights_meta, vocab, draft_vocab),
            warnings=warnings,
        )
    )


# ---------------------------------------------------------------- layout


def resolve_layout(config: dict, block_size: int, warnings: list[str]) -> tuple[Layout, str, int]:
    """(layout, layout_source, gamma) from sample_from_anchor, speculative_tokens and block_size."""
    tokens = speculative_tokens(config)
    flag = config.get("sample_from_anchor")
    if flag is not None and not isinstance(flag, bool):
        raise FormatError(f"sample_from_anchor must be true or false, got {flag!r}")
    if "sample_from_anchor" in config and flag is None:
        warnings.append("sample_from_anchor is null: treated as absent (legacy file)")

    if flag is not None:
        layout: Layout = "anchor_first" if flag else "bonus_anchor"
        expected = _gamma(layout, block_size)
        if tokens is not None and tokens != expected:
            raise FormatError(
                f"sample_from_anchor={str(flag).lower()} contradicts {_tokens_key(config)}={tokens}: "
                f"with block_size {block_size} that flag means {expected} speculative tokens"
            )
        if tokens is None:
            warnings.append(f"speculative_tokens absent: gamma {expected} from block_size and sample_from_anchor")
        return layout, "flag", expected

    if tokens is None:
        warnings.append(
            "sample_from_anchor and speculative_tokens absent: legacy file read as bonus-anchor "
            f"(gamma = block_size - 1 = {block_size - 1})"
        )
        return "bonus_anchor", "legacy_default", block_size - 1
    if tokens == block_size - 1:
        warnings.append(
            f"sample_from_anchor absent: legacy file read as bonus-anchor "
            f"(speculative_tokens {tokens} = block_size - 1 agrees)"
        )
        return "bonus_anchor", "legacy_default", tokens
    if tokens == block_size:
        warnings.append(
            f"sample_from_anchor absent but speculative_tokens {tokens} == block_size: read as anchor-first"
        )
        return "anchor_first", "speculative_tokens", tokens
    raise FormatError(
        f"{_tokens_key(config)}={tokens} fits neither layout of block_size {block_size} "
        f"(anchor-first: {block_size}, bonus-anchor: {block_size - 1}) and sample_from_anchor is absent"
    )


def _gamma(layout: str, block_size: int) -> int:
    return block_size if layout == "anchor_first" else block_size - 1


def speculative_tokens(config: dict) -> int | None:
    """speculative_tokens of the default proposal method (else the first), or None when not given."""
    sc = get_dict(config, "speculators_config", required=False)
    if sc is None:
        return None
    methods = sc.get("proposal_methods")
    if methods is None or methods == []:
        return None
    if not isinstance(methods, list) or not all(isinstance(m, dict) for m in methods):
        raise FormatError("speculators_config.proposal_methods must be a list of objects")
    index = _default_method_index(sc, methods)
    where = f"speculators_config.proposal_methods[{index}]"
    if "speculative_tokens" not in methods[index]:
        return None
    return get_int(methods[index], "speculative_tokens", where, minimum=1)


def _default_method_index(sc: dict, methods: list[dict]) -> int:
    default = sc.get("default_proposal_method")
    if default is None:
        return 0
    if not isinstance(default, str):
        raise FormatError(f"speculators_config.default_proposal_method must be a string, got {default!r}")
    for i, method in enumerate(methods):
        if method.get("proposal_type") == default:
            return i
    types = [m.get("proposal_type") for m in methods]
    raise FormatError(
        f"speculators_config.default_proposal_method {default!r} matches no proposal_type in "
        f"speculators_config.proposal_methods ({types})"
    )


def _tokens_key(config: dict) -> str:
    sc = config.get("speculators_config") or {}
    return (
        f"speculators_config.proposal_methods[{_default_method_index(sc, sc['proposal_methods'])}].speculative_tokens"
    )


# ---------------------------------------------------------------- the rest


def _family(tl: dict, weights_meta) -> tuple[str, bool]:
    """speculators always builds Qwen3 layers; only a Llama config without q/k norm weights is Llama."""
    has_qk = weights_meta.has("layers.0.self_attn.q_norm.weight") if weights_meta is not None else True
    model_type = tl.get("model_type")
    if isinstance(model_type, str) and model_type.strip().lower() == "llama" and not has_qk:
        return "llama", False
    return "qwen3", has_qk


def _verifier(config: dict) -> str | None:
    sc = config.get("speculators_config")
    if not isinstance(sc, dict):
        return None
    verifier = sc.get("verifier")
    if verifier is None:
        return None
    if not isinstance(verifier, dict):
        raise FormatError(f"speculators_config.verifier must be an object, got {verifier!r}")
    return get_str(verifier, "name_or_path", "speculators_config.verifier", default=None)
