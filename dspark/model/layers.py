"""Draft decoder layer with KV injection (docs/DESIGN.md §1).

Queries come from the block only; keys/values are [k/v_proj(context) ; k/v_proj(block)].
The context keys are computed once per committed position and cached (LayerKV, in the draft's ContextCache), so a
decode step costs one pass over the block rows, whatever the context length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

from dspark.formats.spec import Backbone


def hf_config(b: Backbone) -> Qwen3Config:
    """A transformers config for the library pieces we reuse (MLP, RMSNorm, RoPE)."""
    rope = {"rope_type": "default", "rope_theta": b.rope_theta}
    if b.rope_scaling:
        rope.update(b.rope_scaling)
    return Qwen3Config(
        vocab_size=1,  # unused: embeddings are not built from this config
        hidden_size=b.hidden_size,
        intermediate_size=b.intermediate_size,
        num_hidden_layers=b.num_layers,
        num_attention_heads=b.num_attention_heads,
        num_key_value_heads=b.num_key_value_heads,
        head_dim=b.head_dim,
        hidden_act=b.hidden_act,
        rms_norm_eps=b.rms_norm_eps,
        max_position_embeddings=b.max_position_embeddings,
        attention_bias=b.attention_bias,
        rope_parameters=rope,
    )


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [N, heads, T, D]; cos/sin [N, T, D]
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class Rope(nn.Module):
    def __init__(self, b: Backbone):
        super().__init__()
        self.rotary = Qwen3RotaryEmbedding(hf_config(b))

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [N, T] -> cos, sin [N, T, head_dim]
        probe = torch.empty(0, dtype=dtype, device=positions.device)
        return self.rotary(probe, positions)


@dataclass
class LayerKV:
    k: torch.Tensor  # [N, kv_heads, T, D]  (after k_norm and RoPE)
    v: torch.Tensor  # [N, kv_heads, T, D]


class DraftAttention(nn.Module):
    def __init__(self, b: Backbone):
        super().__init__()
        self.num_heads, self.num_kv, self.head_dim = b.num_attention_heads, b.num_key_value_heads, b.head_dim
        H, bias = b.hidden_size, b.attention_bias
        self.q_proj = nn.Linear(H, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(H, self.num_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(H, self.num_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, H, bias=bias)
        self.q_norm: Qwen3RMSNorm | None
        self.k_norm: Qwen3RMSNorm | None
        if b.qk_norm:
            self.q_norm = Qwen3RMSNorm(self.head_dim, eps=b.rms_norm_eps)
            self.k_norm = Qwen3RMSNorm(self.head_dim, eps=b.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def _heads(self, x: torch.Tensor, n: int, norm: nn.Module | None) -> torch.Tensor:
        N, T, _ = x.shape
        x = x.view(N, T, n, self.head_dim)
        if norm is not None:
            x = norm(x)
        return x.transpose(1, 2)  # [N, n, T, D]

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> LayerKV:
        """Keys/values of x [N, T, H] (context features or normed block states)."""
        k = apply_rope(self._heads(self.k_proj(x), self.num_kv, self.k_norm), cos, sin)
        v = self._heads(self.v_proj(x), self.num_kv, None)
        return LayerKV(k, v)

    def forward(
        self,
        x: torch.Tensor,  # [N, S, H] normed block states
        ctx: LayerKV,  # context keys [N or 1, kv, T, D]
        mask: torch.Tensor,  # [N, 1, S, T+S] bool, True = may attend
        cos: torch.Tensor,  # [N, S, D] for the block positions
        sin: torch.Tensor,
    ) -> torch.Tensor:
        N, S, _ = x.shape
        q = apply_rope(self._heads(self.q_proj(x), self.num_heads, self.q_norm), cos, sin)
        blk = self.kv(x, cos, sin)
        k = torch.cat([ctx.k.expand(N, -1, -1, -1), blk.k], dim=2)
        v = torch.cat([ctx.v.expand(N, -1, -1, -1), blk.v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.num_kv != self.num_heads)
        return self.o_proj(out.transpose(1, 2).reshape(N, S, -1))


class DraftLayer(nn.Module):
    def __init__(self, b: Backbone):
        super().__init__()
        cfg = hf_config(b)
        self.input_layernorm = Qwen3RMSNorm(b.hidden_size, eps=b.rms_norm_eps)
        self.self_attn = DraftAttention(b)
        self.post_attention_layernorm = Qwen3RMSNorm(b.hidden_size, eps=b.rms_norm_eps)
        self.mlp = Qwen3MLP(cfg)

    def forward(self, x, ctx: LayerKV, mask, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), ctx, mask, cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))
