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

from dspark.formats.spec import Backbone
from dspark.target.checkpoint import rope_inv_freq


def hf_config(b: Backbone):
    """A transformers Qwen3 config for the library's rotary module (scaled RoPE types, imported
    only where a draft has one: the import costs seconds of every start)."""
    from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

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
        rope_parameters=rope_parameters(b),
    )


def rope_parameters(b: Backbone) -> dict:
    rope = {"rope_type": "default", "rope_theta": b.rope_theta}
    if b.rope_scaling:
        rope.update(b.rope_scaling)
    return rope


class RMSNorm(nn.Module):
    """transformers' Qwen3/Llama RMSNorm, the same arithmetic (fp32 statistics, the weight applied
    in the input's dtype), without importing its modeling module on every start."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


def activation(name: str):
    """The MLP's activation: SiLU here, any other name from transformers' table (imported then)."""
    if name == "silu":
        return F.silu
    from transformers.activations import ACT2FN

    return ACT2FN[name]


class MLP(nn.Module):
    """transformers' Qwen3/Llama gated MLP: down(act(gate(x)) * up(x))."""

    def __init__(self, b: Backbone):
        super().__init__()
        H, inter = b.hidden_size, b.intermediate_size
        self.gate_proj = nn.Linear(H, inter, bias=False)
        self.up_proj = nn.Linear(H, inter, bias=False)
        self.down_proj = nn.Linear(inter, H, bias=False)
        self.act_fn = activation(b.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Rotary(nn.Module):
    """Unscaled RoPE as transformers' rotary module computes it (inv_freq in fp32; cos/sin in fp32,
    then cast); a draft with a scaled RoPE type runs transformers' own module (Rope below)."""

    def __init__(self, b: Backbone):
        super().__init__()
        inv_freq = rope_inv_freq(b.rope_theta, b.head_dim)
        self.attention_scaling = 1.0
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [N, heads, T, D]; cos/sin [N, T, D]
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class Rope(nn.Module):
    def __init__(self, b: Backbone):
        super().__init__()
        if rope_parameters(b)["rope_type"] == "default":
            self.rotary: nn.Module = Rotary(b)
        else:
            from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

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
        self.q_norm: RMSNorm | None
        self.k_norm: RMSNorm | None
        if b.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=b.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=b.rms_norm_eps)
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
        self.input_layernorm = RMSNorm(b.hidden_size, eps=b.rms_norm_eps)
        self.self_attn = DraftAttention(b)
        self.post_attention_layernorm = RMSNorm(b.hidden_size, eps=b.rms_norm_eps)
        self.mlp = MLP(b)

    def forward(self, x, ctx: LayerKV, mask, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), ctx, mask, cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))
