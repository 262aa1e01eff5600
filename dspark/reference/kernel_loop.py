"""The target's decoder layers as a Python loop over dspark's kernels: csrc/layers.cpp's reference.

csrc/layers.cpp runs every layer of a NativeTarget in one call; this is the same work one
kernel call at a time, in the same order (the fused q/k/v matmul, the q/k norms, RoPE with the
cache write, attention by position, o_proj, the residual add with the next norm and the tap,
gate/up, silu x up, down), so tests/test_cpu_kernels.py can hold the two to the same bits.
`layers` has the signature of dspark.target.torch_layers.layers, the path NativeTarget runs
where its layer stack does not: a test swaps it in there.
"""

from __future__ import annotations

import torch

from dspark import ops
from dspark.ops import NO_TENSOR
from dspark.target.dense import PREFILL_MM_ROWS


def norm(ext, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return ext.rms_bf16(x, w, eps)


PREFILL_ROWS = 16  # csrc/dspark.h: a prefill of this many positions a row runs attn_prefill_bf16


def _lin(lin, dense: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """A prefill's rows through the layer's dense bf16 copy where one is used (csrc/layers.cpp lin_rows)."""
    if dense is None:
        return lin(x)
    y = torch.nn.functional.linear(x, dense)
    return y if lin.b is None else y + lin.b


def layers(t, x, state, pos, L0: int, tapped, prefill: bool = False):
    """The decoder layers of NativeTarget t (bf16 activations, dspark's extension) over the
    embeddings x [B, S, H] at positions pos [B, S] -> (the last layer's output, its final norm).
    prefill: a prompt's positions (NativeTarget.forward_last / forward_final)."""
    ext = t._ext
    if ext is None or t.head_dim % 16:
        raise ValueError("kernel_loop.layers runs dspark's kernels: a bf16 target on the extension, heads of 16k")
    B, S, _ = x.shape
    Hq, Hkv, D = t.n_heads, t.n_kv, t.head_dim
    layer_kv = state.layer_kv()
    # the dense copies where they were made (an empty list: refused for memory)
    dense = (t._dense_box[0] or None) if prefill and B * S >= PREFILL_MM_ROWS else None
    h = norm(ext, x, t.layers[0].ln1, t.eps)
    for li, layer in enumerate(t.layers):
        dq, do, dgu, ddown = dense[li] if dense is not None else (None,) * 4
        qkv = _lin(layer.wqkv, dq, h).view(B, S, Hq + 2 * Hkv, D)  # heads: Hq queries | Hkv keys | Hkv values
        kc, vc = layer_kv[li]  # [B, Hkv, C, D]
        if layer.qk_norm is None:
            qk, v = qkv, NO_TENSOR  # the kernel reads the value heads from qkv: no slices
        else:
            qk, v = qkv[:, :, : Hq + Hkv], qkv[:, :, Hq + Hkv :]
            qk = norm(ext, qk, layer.qk_norm, t.eps)  # Qwen3: a weight row per head, one call
        q = ext.rope_cache_bf16(qk, v, t.cos, t.sin, kc, vc, pos)  # [B, S, Hq, D], the cache written
        attend = ext.attn_prefill_bf16 if prefill and S >= PREFILL_ROWS else ext.attn_bf16
        o = attend(q, kc, vc, pos, D**-0.5)  # [B, S, Hq*D]
        x, h = ext.add_rms_bf16(x, _lin(layer.wo, do, o), layer.ln2, t.eps, NO_TENSOR, 0)
        # the residual add, the next layer's input norm (the final norm after the last) and the tap
        col = t._tap_cols[li]
        nxt = t.layers[li + 1].ln1 if li + 1 < t.num_layers else t.norm
        mlp = _lin(layer.w2, ddown, ops.silu_mul(_lin(layer.w13, dgu, h), ext))
        x, h = ext.add_rms_bf16(x, mlp, nxt, t.eps, NO_TENSOR if col < 0 else tapped, max(col, 0))
    return x, h
