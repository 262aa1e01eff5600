"""DeepSpec-native DSpark drafts (DeepSeek's reference trainer), docs/DESIGN.md §3-§4.

config.json is the target's HF config with the draft keys added at top level. The layout is
anchor-first by construction; `target_layer_ids` t means HF hidden_states[t + 1].
"""

from __future__ import annotations

from dspark.errors import FormatError
from dspark.formats.common import (
    Resolved,
    build_spec,
    get_int,
    get_layer_ids,
    has_d2t_for,
    layer_attention_from,
    parse_backbone,
    parse_heads,
    window_is_gated,
)
from dspark.formats.spec import DraftSpec, FormatName

FORMAT: FormatName = "deepspec"
ARCHITECTURES = {"qwen3dsparkmodel": "qwen3", "gemma4dsparkmodel": "gemma4"}


def detect(config: dict) -> bool:
    return _architecture(config) is not None


def _architecture(config: dict) -> str | None:
    archs = config.get("architectures")
    if not isinstance(archs, list):
        return None
    for arch in archs:
        if isinstance(arch, str) and arch.strip().lower() in ARCHITECTURES:
            return arch.strip().lower()
    return None


def read(config: dict, weights_meta) -> DraftSpec:
    warnings: list[str] = []
    arch = _architecture(config)
    if arch is None:
        raise FormatError(f"architectures={config.get('architectures')!r} names no DeepSpec draft")
    family = ARCHITECTURES[arch]
    qk_norm = weights_meta.has("layers.0.self_attn.q_norm.weight") if weights_meta is not None else True
    backbone = parse_backbone(config, "", family=family, qk_norm=qk_norm, warnings=warnings)
    block_size = get_int(config, "block_size", minimum=1)
    target_ids = get_layer_ids(config, "target_layer_ids", minimum=-1)
    _check_target_depth(config, target_ids, warnings)
    vocab = get_int(config, "vocab_size", minimum=1)
    draft_vocab = get_int(config, "draft_vocab_size", default=vocab, minimum=1)
    return build_spec(
        Resolved(
            format=FORMAT,
            layout="anchor_first",
            layout_source="format",
            gamma=block_size,
            block_size=block_size,
            hidden_state_indices=tuple(t + 1 for t in target_ids),
            mask_token_id=get_int(config, "mask_token_id"),
            mask_key="mask_token_id",
            vocab_size=vocab,
            draft_vocab_size=draft_vocab,
            # DeepSpec writes every head key it uses; an absent one means a broken export.
            heads=parse_heads(config, "", defaults=None, warnings=warnings, source="DeepSpec"),
            backbone=backbone,
            # DeepSpec draft attention is bidirectional inside the block, sliding layers included.
            layer_attention=layer_attention_from(
                config, "", backbone.num_layers, sliding_causal=False, gated_window=window_is_gated(config, None)
            ),
            target_hidden_size=get_int(config, "target_hidden_size", default=backbone.hidden_size, minimum=1),
            verifier=None,
            has_d2t=has_d2t_for(weights_meta, vocab, draft_vocab),
            warnings=warnings,
        )
    )


def _check_target_depth(config: dict, target_ids: tuple[int, ...], warnings: list[str]) -> None:
    if config.get("num_target_layers") is None:
        return
    depth = get_int(config, "num_target_layers", minimum=1)
    if target_ids[-1] >= depth:
        raise FormatError(f"target_layer_ids {list(target_ids)} reach past num_target_layers={depth}")
    if target_ids[-1] == depth - 1:
        warnings.append(
            f"target layer {depth - 1} is the target's last layer: HF output_hidden_states[-1] is taken after "
            "the final norm, so tap that layer's raw output instead"
        )
