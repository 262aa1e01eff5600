"""A fresh DraftSpec for a target (training, tests): Qwen3-style layers whatever the target.

Defaults suit small targets; DeepSpec's own heads use 5 taps spread from layer 1 to L-3.
"""

from __future__ import annotations

from dspark.errors import FormatError
from dspark.formats.spec import Backbone, DraftSpec, LayerAttention, Layout, query_slots_for


def default_taps(num_target_layers: int, n_taps: int) -> tuple[int, ...]:
    """HF hidden_states indices (input of layer i) spread like DeepSpec's [1, 9, 17, 25, 33] (+1)."""
    lo, hi = 2, max(2, num_target_layers - 2)
    if n_taps == 1:
        return (hi,)
    return tuple(sorted({round(lo + i * (hi - lo) / (n_taps - 1)) for i in range(n_taps)}))


def make_spec(
    target_config,
    *,
    gamma: int = 7,
    layout: Layout = "anchor_first",
    num_layers: int = 2,
    n_taps: int = 3,
    taps: tuple[int, ...] | None = None,
    markov_rank: int = 64,
    markov_head_type: str = "vanilla",
    confidence_head: bool = True,
    mask_token_id: int = 0,
    intermediate_size: int | None = None,
    num_key_value_heads: int | None = None,
    verifier: str | None = None,
    draft_vocab_size: int | None = None,
) -> DraftSpec:
    """draft_vocab_size < the target's vocabulary: a reduced draft vocabulary mapped by d2t."""
    c = target_config
    H = c.hidden_size
    heads = c.num_attention_heads
    kv = num_key_value_heads or getattr(c, "num_key_value_heads", None) or heads
    if heads % kv:
        raise FormatError(f"draft key/value heads {kv} must divide its {heads} attention heads")
    head_dim = getattr(c, "head_dim", None) or H // heads
    rope = getattr(c, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))
    backbone = Backbone(
        hidden_size=H,
        num_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        intermediate_size=intermediate_size or getattr(c, "intermediate_size", 4 * H),
        rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        max_position_embeddings=getattr(c, "max_position_embeddings", 4096),
        qk_norm=True,
        family="qwen3",
    )
    taps = tuple(taps) if taps else default_taps(c.num_hidden_layers, n_taps)
    q = query_slots_for(layout, gamma)
    return DraftSpec(
        format="deepspec" if layout == "anchor_first" else "speculators",
        layout=layout,
        layout_source="format" if layout == "anchor_first" else "flag",
        gamma=gamma,
        query_slots=q,
        block_size=q,
        hidden_state_indices=taps,
        mask_token_id=mask_token_id,
        vocab_size=c.vocab_size,
        draft_vocab_size=draft_vocab_size or c.vocab_size,
        has_d2t=bool(draft_vocab_size) and draft_vocab_size < c.vocab_size,
        markov_rank=markov_rank,
        markov_head_type=markov_head_type,
        confidence_head=confidence_head,
        confidence_head_with_markov=confidence_head and markov_rank > 0,
        num_layers=num_layers,
        hidden_size=H,
        layer_attention=tuple(LayerAttention(None, False) for _ in range(num_layers)),
        verifier=verifier,
        backbone=backbone,
        target_hidden_size=H,
    )
