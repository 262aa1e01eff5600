"""The draft's decoding forward on dspark's CPU kernels (bf16, with the compiled extension).

`DSparkDraft.forward` is the reference: the modules training uses, about 120 small torch ops
for one block of a one-layer draft and ~35 more for each context update. A drafting step pays
that before the target runs, so on a CPU the ops, not the arithmetic, decided its cost (docs/
BENCHMARKS.md, "Session 12"). Here the same layer runs as the target's native runtime runs its
own (dspark/target/native.py): fused q/k/v and gate/up weights in dspark's bf16 layout, the
norm kernel, RoPE and the cache write in one call, and the attention kernel reading the
preallocated context cache directly. Same arithmetic up to bf16 rounding order; the target
verifies every token, so a draft that rounds differently changes acceptance, never output.

A block's own keys and values are written into the context cache right after each row's
committed entries (positions lengths[b] ..), where the next context update overwrites them:
the block attends to [context ; block] without a concatenation. The block is not causal in
DSpark (spec.layer_attention); a causal layer reads up to its own position instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dspark import kernels
from dspark.model.layers import LayerKV


class _Linear:
    """x @ W.T (+ b) with W packed once for dspark's bf16 kernel (oneDNN's layout where it does not hold W)."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None):
        self.n, self.b = w.shape[0], b
        self.packed = kernels.pack_bf16(w)
        self.w = w if self.packed is None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.w, self.b)
        return kernels.packed_linear(x, self.packed, self.b, self.n)


class FastDraft:
    """The packed weights of one draft's layers; built by `for_draft`, read-only afterwards."""

    def __init__(self, draft):
        b = draft.spec.backbone
        self.Hq, self.Hkv, self.D, self.eps = b.num_attention_heads, b.num_key_value_heads, b.head_dim, b.rms_norm_eps
        self.fc = _Linear(draft.fc.weight.detach(), None)
        self.hidden_norm = draft.hidden_norm.weight.detach()
        self.norm = draft.norm.weight.detach()
        self.layers = []
        for layer in draft.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append(dict(
                ln1=layer.input_layernorm.weight.detach(),
                wqkv=_Linear(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach(),
                             kernels.fused_bias(a.q_proj, a.k_proj, a.v_proj)),
                wkv=_Linear(torch.cat([a.k_proj.weight, a.v_proj.weight]).detach(), kernels.fused_bias(a.k_proj, a.v_proj)),
                # Qwen3's q_norm on every query head, k_norm on every key head: one call, one weight row a head
                qk_norm=None if a.q_norm is None else torch.cat([a.q_norm.weight.expand(self.Hq, -1),
                                                                 a.k_norm.weight.expand(self.Hkv, -1)]).detach().contiguous(),
                k_norm=None if a.k_norm is None else a.k_norm.weight.detach(),
                wo=_Linear(a.o_proj.weight.detach(), kernels.fused_bias(a.o_proj)),
                ln2=layer.post_attention_layernorm.weight.detach(),
                w13=_Linear(torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach(), kernels.fused_bias(m.gate_proj, m.up_proj)),
                w2=_Linear(m.down_proj.weight.detach(), kernels.fused_bias(m.down_proj)),
            ))
        rot = draft.rope.rotary
        self.inv_freq = rot.inv_freq.float()
        self.scale = float(getattr(rot, "attention_scaling", 1.0))
        self.cos = self.sin = torch.zeros(0, self.D, dtype=torch.bfloat16)
        # the draft head in Q8_0 (groups of 32, d = max|w| / 127: as fine a grid as bf16's 8-bit
        # mantissa): read from memory every step, after the target's weights have evicted it, it is
        # the largest tensor a drafting step reads; at half the bytes it costs ~half (BENCHMARKS.md)
        w = draft.lm_head.weight.detach()
        self.head = kernels.pack_q8(*kernels.q8_groups(w)) if kernels.tile_applies(*w.shape) else None
        self.ext = kernels.extension()
        # a drafting step reads these right after the target's step evicted them: in 2 MB pages
        kernels.into_huge_pages([(self.fc, "packed"), (self, "head")]
                                + [(ly[k], "packed") for ly in self.layers for k in ("wqkv", "wkv", "wo", "w13", "w2")])
        # what a weight update shows: an in-place change bumps a tensor's version; `.to()` replaces fc.weight
        self.fc_weight = draft.fc.weight
        self.versions = [(t, t._version) for t in draft.parameters()]

    def _room(self, ctx, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Room in ctx for n entries after each row's committed ones -> (their positions [B, n],
        the cos / sin tables covering them)."""
        end = int(ctx.lengths.max()) + n
        ctx.reserve(end)
        return (ctx.lengths[:, None] + torch.arange(n)[None, :], *self._table(end))

    def _table(self, need: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin [P, D] bf16 for positions < need, computed as the draft's rotary module does
        (fp32, then cast); the kernel clamps past the table, so it must cover every position."""
        if self.cos.shape[0] < need:
            t = torch.arange(-(-need // 1024) * 1024, dtype=torch.float32)
            freqs = torch.outer(t, self.inv_freq)
            emb = torch.cat([freqs, freqs], -1)
            self.cos = (emb.cos() * self.scale).to(torch.bfloat16)
            self.sin = (emb.sin() * self.scale).to(torch.bfloat16)
        return self.cos, self.sin

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., H] -> draft-head logits [..., Vd] bf16."""
        return kernels.q8_linear(h, self.head)

    def stale(self, draft) -> bool:
        return draft.fc.weight is not self.fc_weight or any(t._version != v for t, v in self.versions)

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.ext.rms_bf16(x, w, self.eps)

    def block(self, draft, block_ids: torch.Tensor, ctx, rows: int | None = None) -> torch.Tensor:
        """block_ids [N, S] -> post-norm block states h [N, rows, H] of the first `rows` rows (all
        S by default), as `DSparkDraft.forward` over ctx."""
        N, S = block_ids.shape
        pos, cos, sin = self._room(ctx, S)  # pos [N, S]: the block rows' positions
        last = (ctx.lengths + S - 1)[:, None].expand(N, S).contiguous()  # a row sees its whole block
        causal = [att.causal for att in draft.spec.layer_attention]  # the caller's reading (read_as views share this copy)
        x = draft.embed_tokens(block_ids).to(torch.bfloat16)
        h = self._rms(x, self.layers[0]["ln1"])
        for i, (ly, kv) in enumerate(zip(self.layers, ctx.layers)):
            qkv = ly["wqkv"](h).view(N, S, self.Hq + 2 * self.Hkv, self.D)
            qk, v = qkv[:, :, : self.Hq + self.Hkv], qkv[:, :, self.Hq + self.Hkv :]
            if ly["qk_norm"] is not None:
                qk = self._rms(qk, ly["qk_norm"])
            q = self.ext.rope_cache_bf16(qk, v, cos, sin, kv.k, kv.v, pos)  # block keys at pos, in the scratch
            seen = pos if causal[i] else last
            if rows is not None and i == len(self.layers) - 1 and rows < S:
                # every row's keys and values are in the cache; past them the last layer works
                # row by row (attention per query, then per-row matmuls, each row's own bits), so
                # rows nobody reads are skipped: a depth-1 step needs one row of the MLP, not S
                q, seen, x = q[:, :rows], seen[:, :rows].contiguous(), x[:, :rows].contiguous()
            o = self.ext.attn_bf16(q, kv.k, kv.v, seen, self.D ** -0.5)
            x, h = self.ext.add_rms_bf16(x, ly["wo"](o), ly["ln2"], self.eps, kernels.NO_TENSOR, 0)
            nxt = self.layers[i + 1]["ln1"] if i + 1 < len(self.layers) else self.norm
            x, h = self.ext.add_rms_bf16(x, ly["w2"](kernels.silu_mul(ly["w13"](h), self.ext)), nxt, self.eps,
                                        kernels.NO_TENSOR, 0)
        return h

    def extend(self, ctx, taps: torch.Tensor, counts: torch.Tensor) -> None:
        """Commit the first counts[b] of taps [B, n, F] to each row's context, as `DSparkDraft.extend_context`."""
        B, n, _ = taps.shape
        pos, cos, sin = self._room(ctx, n)
        c = self._rms(self.fc(taps.to(torch.bfloat16)), self.hidden_norm)
        for ly, kv in zip(self.layers, ctx.layers):
            kvp = ly["wkv"](c).view(B, n, 2 * self.Hkv, self.D)
            k, v = kvp[:, :, : self.Hkv], kvp[:, :, self.Hkv :]
            if ly["k_norm"] is not None:
                k = self._rms(k, ly["k_norm"])
            self.ext.rope_cache_bf16(k, v, cos, sin, kv.k, kv.v, pos)  # no query heads: keys and values only
        ctx.lengths = ctx.lengths + counts


def why_not(draft) -> str | None:
    """Why this draft decodes through its modules rather than the kernels, or None: it can."""
    spec, b, w = draft.spec, draft.spec.backbone, draft.fc.weight
    if w.device.type != "cpu":
        return f"weights on {w.device.type}"
    if w.dtype != torch.bfloat16:
        return f"{str(w.dtype).removeprefix('torch.')} weights; the kernels are bf16"
    if kernels.extension() is None:
        return kernels.why_unavailable()
    if any(att.sliding_window is not None for att in spec.layer_attention):
        return "sliding-window layers"
    if b.head_dim % 16 or b.hidden_act != "silu":
        return f"head size {b.head_dim}, activation {b.hidden_act}; the kernels take multiples of 16 and SiLU"
    return None


def applies(draft, ctx, rows: int) -> bool:
    """Can the fast path run this draft on this context now? (`why_not` says nothing against the
    draft, no gradient is wanted, and ctx holds one bf16 context row of its own per block row.)"""
    k = ctx.layers[0].k if ctx.layers else None
    return (
        k is not None and not ctx.shared and k.shape[0] == rows and k.dtype == torch.bfloat16 and k.is_contiguous()
        and not torch.is_grad_enabled() and why_not(draft) is None
    )


def describe(draft) -> str:
    """One line for the start-up notes: how this draft decodes, and why."""
    reason = why_not(draft)
    if reason is not None:
        return f"draft decodes through its modules ({reason})"
    head = "Q8_0" if head_applies(draft, grad=False) else "bf16"
    return f"draft decodes on dspark's CPU kernels (bf16 layers, head {head})"


def for_draft(draft) -> FastDraft:
    """The draft's packed copy, built once and shared by its views (`read_as`); rebuilt when a
    weight has changed in place since."""
    held = draft._fast
    fast = held.get("fast")
    if fast is None or fast.stale(draft):
        fast = held["fast"] = FastDraft(draft)
    return fast


def head_applies(draft, grad: bool | None = None) -> bool:
    """Does the draft head run in Q8_0 here? (bf16 on a CPU with dspark's matmul tile, no
    gradient wanted: grad None reads torch's current mode.)"""
    w = draft.lm_head.weight
    grad = torch.is_grad_enabled() if grad is None else grad
    return w.dtype == torch.bfloat16 and w.device.type == "cpu" and not grad and kernels.tile_applies(*w.shape)
