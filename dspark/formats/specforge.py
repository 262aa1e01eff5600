"""SpecForge DSpark exports: a Qwen3 config with a nested `dflash_config` whose
`projector_type` is "dspark" (docs/DESIGN.md §3).

SpecForge drafts the DFlash way: row 0 holds the anchor and rows 1..block_size-1 are
sampled (bonus-anchor). `dflash_config.target_layer_ids` t means HF hidden_states[t + 1].
SpecForge has no embed_tokens nor lm_head of its own: both come from the target.
"""

from __future__ import annotations

from dspark.errors import FormatError
from dspark.formats.common import (
    Resolved,
    build_spec,
    get_bool,
    get_int,
    get_layer_ids,
    has_d2t_for,
    layer_attention_from,
    normalize_name,
    parse_backbone,
    parse_heads,
)
from dspark.formats.spec import DraftSpec, FormatName

FORMAT: FormatName = "specforge"
DC = "dflash_config"

# SpecForge's DSparkConfig defaults: transformers' save_pretrained omits a value equal to the
# class default, so an absent key really means this value in SpecForge.
HEAD_DEFAULTS = {
    "markov_rank": 256,
    "markov_head_type": "vanilla",
    "enable_confidence_head": True,
    "confidence_head_with_markov": True,
}
_SUPPORTED_ATTENTION = {"gqa", "mha"}


def detect(config: dict) -> bool:
    dc = config.get(DC)
    if not isinstance(dc, dict) or "projector_type" not in dc:
        return False
    kind = dc["projector_type"]
    return isinstance(kind, str) and kind.strip().lower() == "dspark"


def read(config: dict, weights_meta) -> DraftSpec:
    dc = config[DC]
    warnings: list[str] = []
    _refuse_unsupported(dc)
    qk_norm = weights_meta.has("layers.0.self_attn.q_norm.weight") if weights_meta is not None else True
    backbone = parse_backbone(config, "", family="qwen3", qk_norm=qk_norm, warnings=warnings)
    block_size = _block_size(config, dc)
    vocab = get_int(config, "vocab_size", minimum=1)
    return build_spec(
        Resolved(
            format=FORMAT,
            layout="bonus_anchor",
            layout_source="format",
            gamma=block_size - 1,
            block_size=block_size,
            hidden_state_indices=tuple(t + 1 for t in _target_layer_ids(config, dc, backbone.num_layers, warnings)),
            mask_token_id=get_int(dc, "mask_token_id", DC),
            mask_key=f"{DC}.mask_token_id",
            vocab_size=vocab,
            draft_vocab_size=vocab,
            heads=parse_heads(
                _head_keys(config, dc), "", defaults=HEAD_DEFAULTS, warnings=warnings, source="SpecForge"
            ),
            backbone=backbone,
            # SpecForge loads every draft config through Qwen3Config.
            layer_attention=layer_attention_from(
                config, "", backbone.num_layers, sliding_causal=False, gated_window=True
            ),
            target_hidden_size=get_int(dc, "target_hidden_size", DC, default=backbone.hidden_size, minimum=1),
            verifier=None,
            has_d2t=has_d2t_for(weights_meta, vocab, vocab),
            warnings=warnings,
        )
    )


def _refuse_unsupported(dc: dict) -> None:
    if get_bool(dc, "shift_label", DC, default=False):
        raise FormatError(f"{DC}.shift_label=true changes which row predicts which token; not supported")
    prefix = dc.get("pure_draft_prefix_len", 0)
    if prefix not in (0, None):
        raise FormatError(f"{DC}.pure_draft_prefix_len={prefix!r} is not supported (only 0)")
    modes = dc.get("attention_modes", [dc.get("attention_mode", "gqa")])
    if not isinstance(modes, list):
        raise FormatError(f"{DC}.attention_modes must be a list, got {modes!r}")
    for mode in modes:
        if normalize_name(mode, f"{DC}.attention_mode") not in _SUPPORTED_ATTENTION:
            raise FormatError(f"{DC}.attention_mode {mode!r} is not supported (only gqa/mha draft attention)")


def _block_size(config: dict, dc: dict) -> int:
    top = get_int(config, "block_size", default=None, minimum=2)
    nested = get_int(dc, "block_size", DC, default=None, minimum=2)
    if top is not None and nested is not None and top != nested:
        raise FormatError(f"block_size={top} contradicts {DC}.block_size={nested}")
    if top is None and nested is None:
        raise FormatError(f"block_size is missing (checked block_size and {DC}.block_size)")
    return top if top is not None else nested


def _target_layer_ids(config: dict, dc: dict, num_layers: int, warnings: list[str]) -> tuple[int, ...]:
    if dc.get("target_layer_ids") is not None:
        return get_layer_ids(dc, "target_layer_ids", DC, minimum=-1)
    depth = get_int(config, "num_target_layers", default=None, minimum=1)
    if depth is None:
        raise FormatError(f"{DC}.target_layer_ids is missing (and num_target_layers is absent)")
    ids = _specforge_default_layers(depth, num_layers)
    warnings.append(f"{DC}.target_layer_ids absent: SpecForge's default for {depth} target layers is {ids}")
    return tuple(ids)


def _specforge_default_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    # SpecForge's build_target_layer_ids, which its model applies when the key is absent.
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def _head_keys(config: dict, dc: dict) -> dict:
    """Head settings live at top level; some exports repeat them in dflash_config. They must agree."""
    merged = {}
    for key in HEAD_DEFAULTS:
        top, nested = config.get(key), dc.get(key)
        if top is not None and nested is not None and top != nested:
            raise FormatError(f"{key}={top!r} contradicts {DC}.{key}={nested!r}")
        value = top if top is not None else nested
        if value is not None:
            merged[key] = value
    return merged
