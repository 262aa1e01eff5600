"""The native runtime's decoder layers on torch's ops, one layer at a time.

The path where dspark's compiled layer stack (csrc/layers.cpp, one call for every layer) does
not run: float32 activations, GPUs, no compiler, weights off dspark's matmul tile. It uses none
of dspark's kernels but the matmul tile a weight may be held on (target/quant.py): a layer runs
either all in the compiled stack or all here. The compiled stack's own reference, the same
kernels called one at a time from Python, is dspark/reference/kernel_loop.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dspark import ops


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # HF's RMSNorm: normalise in fp32, cast back to the activation dtype, then scale
    return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, S, h, D], cos/sin [B, S, 1, D]; HF's rotate_half convention (halves, not pairs)
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat((-x2, x1), -1) * sin


def layers(t, x, state, pos, L0: int, tapped, prefill: bool = False):
    """The decoder layers of target t over the embeddings x [B, S, H] at positions pos [B, S]
    (L0: the longest row's committed length) -> (the last layer's output, its final norm).
    prefill: the positions are a prompt's (torch's attention here is the same either way)."""
    B, S, _ = x.shape
    dev = x.device
    T = L0 + S  # keys read: every row's committed entries + the S new ones (shorter rows masked)
    lengths = state.lengths
    uniform = B == 1 or bool((lengths == lengths[0]).all())
    Hq, Hkv, D = t.n_heads, t.n_kv, t.head_dim
    G = Hq // Hkv
    if uniform:
        cos, sin = t.cos[L0 : L0 + S][None, :, None], t.sin[L0 : L0 + S][None, :, None]  # [1, S, 1, D]
    else:
        p = pos.clamp(max=t.cos.shape[0] - 1)  # padding may run past the table; never read
        cos, sin = t.cos[p][:, :, None], t.sin[p][:, :, None]  # [B, S, 1, D]
    if uniform and S == 1:
        mask = None  # one new query per row sees every entry up to itself
    else:
        # key j visible to new position i of row b iff j <= lengths[b] + i: committed entries
        # plus the causal part of the new ones; stale entries past a row's length are hidden
        m = torch.arange(T, device=dev)[None, None, :] <= pos[:, :, None]  # [B, S, T]
        # GQA without copying K/V: the G query heads sharing a KV head are folded into the
        # query axis ([B, Hkv, G*S, D]), so the mask repeats per group
        mask = m[:, None].repeat(1, 1, G, 1)  # [B, 1, G*S, T]
    bidx = None if uniform else torch.arange(B, device=dev)[:, None]  # ragged cache writes
    layer_kv = state.layer_kv()
    h = rms(x, t.layers[0].ln1, t.eps)
    for li, layer in enumerate(t.layers):
        qkv = layer.wqkv(h).view(B, S, Hq + 2 * Hkv, D)  # heads: Hq queries | Hkv keys | Hkv values
        kc, vc = layer_kv[li]  # [B, Hkv, C, D]
        qk, v = qkv[:, :, : Hq + Hkv], qkv[:, :, Hq + Hkv :]
        if layer.qk_norm is not None:  # Qwen3: q_norm on query heads, k_norm on key heads, one call
            qk = rms(qk, layer.qk_norm, t.eps)  # a weight row per head
        qk = rope(qk, cos, sin)  # queries and keys rotated together: half the small ops
        q, k, v = qk[:, :, :Hq].transpose(1, 2), qk[:, :, Hq:].transpose(1, 2), v.transpose(1, 2)
        if uniform:
            kc[:, :, L0 : L0 + S] = k  # every row at the same offset: a slice copy
            vc[:, :, L0 : L0 + S] = v
        else:
            kc[bidx, :, pos] = k.transpose(1, 2)  # [B, S, Hkv, D] at each row's own offset
            vc[bidx, :, pos] = v.transpose(1, 2)
        qg = q.reshape(B, Hkv, G * S, D)  # HF's repeat_kv: query head h uses KV head h // G
        o = F.scaled_dot_product_attention(qg, kc[:, :, :T], vc[:, :, :T], attn_mask=mask)
        o = o.view(B, Hq, S, D).transpose(1, 2).reshape(B, S, Hq * D)
        x, h = add_norm(x, layer.wo(o), layer.ln2, t.eps)
        # the residual add and the next layer's input norm (the final norm after the last);
        # the last layer's output is tapped before the final norm, like the HF target's hook
        x, h = add_norm(
            x,
            layer.w2(ops.silu_mul(layer.w13(h), None)),
            t.layers[li + 1].ln1 if li + 1 < t.num_layers else t.norm,
            t.eps,
            tapped,
            t._tap_cols[li],
        )
    return x, h


def add_norm(
    x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float, taps: torch.Tensor | None = None, col: int = -1
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + r, its norm with weight w). With col >= 0, x + r is also written to taps[..., col : col + H]."""
    x = x + r
    if col >= 0:
        if taps is None:
            raise ValueError(f"add_norm: col={col} names columns of taps, but no taps were given")
        taps[..., col : col + x.shape[-1]] = x
    return x, rms(x, w, eps)
