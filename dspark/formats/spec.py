"""The one normalized description of a DSpark draft (docs/DESIGN.md §3 and §4).

Every reader in this package maps its family onto DraftSpec; nothing downstream
(model, engine, training) ever looks at a raw config again.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

from dspark.errors import FormatError

Layout = Literal["anchor_first", "bonus_anchor"]
FormatName = Literal["deepspec", "speculators", "specforge", "deepseek_v4"]
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


@dataclass(frozen=True)
class LayerAttention:
    sliding_window: int | None  # None: full attention over the context
    causal: bool  # causal inside the block (speculators sliding layers); else bidirectional


@dataclass(frozen=True)
class Backbone:
    """What is needed to build the draft's decoder layers."""

    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None  # HF rope_parameters beyond theta (type, factor, ...)
    max_position_embeddings: int = 32768
    hidden_act: str = "silu"
    attention_bias: bool = False
    qk_norm: bool = True  # Qwen3 layers have q/k RMSNorm; Llama-style layers do not
    family: str = "qwen3"  # "qwen3" | "llama" | "gemma4" (the model builder refuses what it cannot run)


@dataclass(frozen=True)
class DraftSpec:
    format: FormatName
    layout: Layout
    layout_source: str  # "flag" | "legacy_default" | "speculative_tokens" | "format" | "forced"
    gamma: int  # draft tokens proposed per step
    query_slots: int  # block rows fed to the draft: gamma (anchor-first) or gamma+1
    block_size: int  # as written in the file
    hidden_state_indices: tuple[int, ...]  # into HF output_hidden_states (index i = input of layer i)
    mask_token_id: int
    vocab_size: int  # target vocabulary (rows of markov_w1 / embed_tokens)
    draft_vocab_size: int  # rows of lm_head / markov_w2
    has_d2t: bool
    markov_rank: int  # 0: no Markov head (DFlash-style)
    markov_head_type: str
    confidence_head: bool
    confidence_head_with_markov: bool
    num_layers: int
    hidden_size: int
    layer_attention: tuple[LayerAttention, ...]
    verifier: str | None
    warnings: tuple[str, ...] = ()
    # Not part of `inspect --json`: what the model builder needs.
    backbone: Backbone | None = field(default=None, compare=False)
    target_hidden_size: int | None = None
    path: str | None = field(default=None, compare=False)  # checkpoint directory

    @property
    def sampled_rows(self) -> range:
        """Block rows whose logits are sampled: row k predicts the token after the previous row.

        anchor-first: rows 0..gamma-1 predict anchor+1..anchor+gamma.
        bonus-anchor: row 0 is never trained nor sampled; rows 1..gamma predict anchor+1..anchor+gamma.
        """
        start = 0 if self.layout == "anchor_first" else 1
        return range(start, start + self.gamma)

    def to_json(self) -> dict:
        """The public description printed by `dspark inspect --json` (exactly these keys)."""
        return {
            "format": self.format,
            "layout": self.layout,
            "layout_source": self.layout_source,
            "gamma": self.gamma,
            "query_slots": self.query_slots,
            "block_size": self.block_size,
            "hidden_state_indices": list(self.hidden_state_indices),
            "mask_token_id": self.mask_token_id,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "has_d2t": self.has_d2t,
            "markov_rank": self.markov_rank,
            "markov_head_type": self.markov_head_type,
            "confidence_head": self.confidence_head,
            "confidence_head_with_markov": self.confidence_head_with_markov,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "layer_attention": [asdict(a) for a in self.layer_attention],
            "verifier": self.verifier,
            "warnings": list(self.warnings),
        }


def backbone_of(spec: DraftSpec) -> Backbone:
    """spec.backbone, which every reader sets: a description made without one has no layers to build or check."""
    if spec.backbone is None:
        raise FormatError("the draft description has no backbone (hidden size, heads, ...)")
    return spec.backbone


def query_slots_for(layout: Layout, gamma: int) -> int:
    return gamma if layout == "anchor_first" else gamma + 1
