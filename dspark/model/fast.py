"""The draft's decoding work on dspark's CPU kernels: one compiled call a phase (csrc/draft.cpp).

`DSparkDraft.forward` is the reference: the modules training uses, about 120 small torch ops for
one block of a one-layer draft and ~35 more for each context update. A drafting step pays that
before the target runs, and on a CPU each small op costs tens of microseconds right after a target
step, so the ops, not the arithmetic, decided its cost. Here the whole phase (the context update
of the committed positions, the block's layers, the head over the draft vocabulary, the greedy
Markov walk and the confidences) is one call into the extension, over weights handed to it once:
fused q/k/v and gate/up matrices, the norm, RoPE and attention kernels, the preallocated context
cache read in place. The target verifies every token, so a draft that rounds differently from its
modules changes acceptance, never output.

The matrices are held in one of three formats (`DRAFT_WEIGHTS`, the engine's `--draft-weights`):
"q4" (Q4_1: 4-bit values with an fp16 scale and minimum per 32 inputs, as the shipped SmolLM2's
layers are), "q8" (Q8_0: 8-bit values, an fp16 scale per 32 inputs, as fine a grid as bf16's 8-bit
mantissa) or "bf16" (the draft's own numbers). The head is Q4_1 in "q4", Q8_0 otherwise. The AVX2
build multiplies q4 and q8 matrices with 8-bit activations, the AVX512-BF16 one in bf16. "auto" is
q4: a drafting step reads the draft's weights right after the target's step evicted them from the
CPU's caches, so their bytes are its cost (docs/BENCHMARKS.md: the bundled draft's first slot is
accepted as often in q8 as in bf16, and ~0.01 less often in q4, for a phase ~a quarter cheaper).
The kernels compute in bf16 whatever the format; "fp32" (what `--dtype fp32` asks for: the draft's
own numbers, computed in fp32) is the fourth choice, and it runs the draft's modules, not this call.

A block's own keys and values are written into the context cache right after each row's committed
entries (positions lengths[b] ..), where the next context update overwrites them: the block
attends to [context ; block] without a concatenation. The block is not causal in DSpark
(spec.layer_attention); a causal layer reads up to its own position instead.
"""

from __future__ import annotations

import torch

from dspark import hugepages, kernels, ops, packing

# auto: Q4_1 matrices and a Q8_0 head. The head's rows are the target's own LM head rows, which the
# target itself runs in Q8_0; rounded to Q4_1 they cost a draft 0.01-0.03 of mean acceptance
# length (docs/TRAINING.md), while a draft vocabulary of 8 192 tokens (`dspark train vocab`) holds
# a Q8_0 head in the bytes of a 16 384-token Q4_1 one. q4: Q4_1 everywhere, the fewest bytes.
DRAFT_WEIGHTS = ("auto", "q4", "q8", "bf16", "fp32")
# the formats of the kernels' own copy; "fp32" runs the draft's modules in fp32 (the kernels compute in bf16)
KERNEL_WEIGHTS = ("q4", "q8", "bf16")
FP32_REASON = "fp32 asked for: the draft's own numbers in fp32; dspark's drafting kernels compute in bf16"


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.bfloat16).contiguous()


def _q8(w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Q8_0 of w [N, K] with fp16 scales (the kernels then read a group's scale in 2 bytes, not 4) -> (P, D)."""
    g = w.detach().float().reshape(w.shape[0], -1, 32)
    d = (g.abs().amax(-1) / 127).half().float()
    q = (g / torch.where(d > 0, d, 1.0)[..., None]).round().clamp(-127, 127)
    return packing.pack_q8(q.reshape(w.shape).to(torch.int8), d)


def q4_1_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 of w [N, K] (GGUF's rule: w = q d + lo, q in 0..15 per group of 32 inputs; fp16 d and
    lo) -> q [N, K/32, 32], d and lo [N, K/32], all fp32."""
    g = w.detach().float().reshape(w.shape[0], -1, 32)
    lo = g.amin(-1).half().float()
    d = ((g.amax(-1) - lo) / 15).half().float()
    q = ((g - lo[..., None]) / torch.where(d > 0, d, 1.0)[..., None]).round().clamp(0, 15)
    return q, d, lo


def q4_1_values(w: torch.Tensor) -> torch.Tensor:
    """The values dspark's Q4_1 matrices hold for w [N, K] (fp32, w's shape): what a draft trained
    against its shipping format computes with (dspark.train.quant_aware)."""
    q, d, lo = q4_1_groups(w)
    return (q * d[..., None] + lo[..., None]).reshape(w.shape)


def _q4(w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Q4_1 of w [N, K] (q4_1_groups) -> (P, D, L)."""
    q, d, lo = q4_1_groups(w)
    return packing.pack_q4(q.reshape(w.shape), d, lo)


def _pack(w: torch.Tensor, b: torch.Tensor | None, fmt: str) -> list[torch.Tensor]:
    """A weight [N, K] (and bias) -> the extension's (P, D, L, bias) in `fmt` (L empty but for q4)."""
    none = ops.NO_TENSOR
    packed = {"q4": _q4, "q8": _q8}.get(fmt, lambda m: packing.pack_bf16(_bf16(m)))(w)
    return [*packed, *[none] * (3 - len(packed)), none if b is None else _bf16(b)]


def _matrices(draft) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Every matrix of the draft as the kernels take it, with its bias: fc, then per layer the
    fused q/k/v, the fused k/v (the context update), o, the fused gate/up and down."""
    out: list[tuple[torch.Tensor, torch.Tensor | None]] = [(draft.fc.weight, None)]
    for layer in draft.layers:
        a, m = layer.self_attn, layer.mlp
        out += [
            (
                torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                packing.fused_bias(a.q_proj, a.k_proj, a.v_proj),
            ),
            (torch.cat([a.k_proj.weight, a.v_proj.weight]), packing.fused_bias(a.k_proj, a.v_proj)),
            (a.o_proj.weight, a.o_proj.bias),
            (torch.cat([m.gate_proj.weight, m.up_proj.weight]), packing.fused_bias(m.gate_proj, m.up_proj)),
            (m.down_proj.weight, m.down_proj.bias),
        ]
    return out


def _shapes(draft) -> list[tuple[int, int]]:
    """The shapes of `_matrices` (without building them), then the head's."""
    out = [tuple(draft.fc.weight.shape)]
    for layer in draft.layers:
        a, m = layer.self_attn, layer.mlp
        H = a.q_proj.weight.shape[1]
        kv = a.k_proj.weight.shape[0] + a.v_proj.weight.shape[0]
        out += [
            (a.q_proj.weight.shape[0] + kv, H),
            (kv, H),
            tuple(a.o_proj.weight.shape),
            (2 * m.gate_proj.weight.shape[0], H),
            tuple(m.down_proj.weight.shape),
        ]
    return out + [tuple(draft.lm_head.weight.shape)]


class FastDraft:
    """One draft's weights registered with the extension; built by `for_draft`, read-only afterwards."""

    def __init__(self, draft, weights: str = "auto"):
        if weights not in DRAFT_WEIGHTS:
            raise ValueError(f"draft weights must be one of {', '.join(DRAFT_WEIGHTS)}, got {weights!r}")
        self.weights = weights
        fmt = "q4" if weights == "auto" else weights
        if fmt not in KERNEL_WEIGHTS:
            raise ValueError(f"draft weights {fmt!r} run through the draft's modules, not dspark's kernels")
        b = draft.spec.backbone
        self.Hq, self.Hkv, self.D, self.eps = b.num_attention_heads, b.num_key_value_heads, b.head_dim, b.rms_norm_eps
        none, mh, ch = ops.NO_TENSOR, draft.markov_head, draft.confidence_head
        # the walk and the confidences run in the call, whatever the Markov head's kind (or none)
        kind = MARKOV_KINDS[mh.head_type] if mh is not None else 0
        proj = {"gated": "gate_proj", "rnn": "joint_proj"}.get(mh.head_type) if mh is not None else None
        conf = ch is not None
        # the head and W2 side by side: the first slot's logits U h + W2 z_0 are one matmul over
        # [h ; z_0] (csrc/draft.cpp `walk_block`); [h ; 0] gives U h alone
        head = draft.lm_head.weight.detach()
        if mh is not None:
            head = torch.cat([head.float(), mh.markov_w2.weight.detach().float()], 1)
        head = torch.nn.functional.pad(head, (0, -head.shape[1] % 32))  # inputs in groups of 32
        mats = [_pack(w, bias, fmt) for w, bias in _matrices(draft)] + [
            _pack(head, None, "q4" if weights == "q4" else "q8")
        ]
        # a drafting step reads these right after the target's step evicted them: in 2 MB pages
        streamed = iter(_in_huge_pages([t for m in mats for t in m[:3] if t.numel()]))
        mats = [[next(streamed) if t.numel() else t for t in m[:3]] + m[3:] for m in mats]
        self.head = tuple(t for t in mats.pop()[:3] if t.numel())
        flat = [
            _bf16(draft.embed_tokens.weight),
            _bf16(draft.hidden_norm.weight),
            _bf16(draft.norm.weight),
            _bf16(mh.markov_w1.weight) if mh is not None else none,
            _bf16(mh.w2_transposed()) if mh is not None else none,
            draft.d2t if draft.d2t is not None else torch.zeros(0, dtype=torch.long),
            _bf16(ch.proj.weight) if conf else none,
            _bf16(ch.proj.bias) if conf else none,
            *mats[0],
            *self.head,
            *[none] * (4 - len(self.head)),
            _bf16(getattr(mh, proj).weight) if proj else none,
            _bf16(getattr(mh, proj).bias) if proj and getattr(mh, proj).bias is not None else none,
        ]
        for i, layer in enumerate(draft.layers):
            a = layer.self_attn
            flat += [
                _bf16(layer.input_layernorm.weight),
                # Qwen3's q_norm on every query head, k_norm on every key head: a weight row a head
                none
                if a.q_norm is None
                else _bf16(torch.cat([a.q_norm.weight.expand(self.Hq, -1), a.k_norm.weight.expand(self.Hkv, -1)])),
                none if a.k_norm is None else _bf16(a.k_norm.weight.expand(self.Hkv, -1)),
                _bf16(layer.post_attention_layernorm.weight),
                *[t for m in mats[1 + 5 * i : 6 + 5 * i] for t in m],
            ]
        self.ext = kernels.extension()
        self.id = self.ext.draft_register(
            flat,
            len(draft.layers),
            self.Hq,
            self.Hkv,
            self.D,
            conf and draft.spec.confidence_head_with_markov,
            self.eps,
            kind,
        )
        self._flat = flat  # the extension holds references too; kept for the lifetime of the handle
        rot = draft.rope.rotary
        self.inv_freq = rot.inv_freq.float()
        self.scale = float(getattr(rot, "attention_scaling", 1.0))
        self.cos = self.sin = torch.zeros(0, self.D, dtype=torch.bfloat16)
        # what a weight update shows: an in-place change bumps a tensor's version; `.to()` replaces fc.weight
        self.fc_weight = draft.fc.weight
        self.versions = [(t, t._version) for t in draft.parameters()]

    def __del__(self):
        try:
            self.ext.draft_release(self.id)
        except Exception:  # at interpreter exit the extension may be gone first; nothing to free then
            pass

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
        """h [..., H] -> draft-head logits [..., Vd] bf16 (the head's W2 columns read zeros)."""
        h = h.to(torch.bfloat16)
        pad = self.head[0].shape[1] * 32 - h.shape[-1]
        h = torch.nn.functional.pad(h, (0, pad)) if pad else h
        return ops.q4_linear(h, self.head) if len(self.head) == 3 else ops.q8_linear(h, self.head)

    def stale(self, draft) -> bool:
        return draft.fc.weight is not self.fc_weight or any(t._version != v for t, v in self.versions)

    def call(
        self,
        spec,
        ctx,
        taps: torch.Tensor | None,
        counts: torch.Tensor | None,
        anchors: torch.Tensor | None = None,
        row0: int = 0,
        depth: int = 1,
        walk: bool = False,
        sampling: torch.Tensor | None = None,
        uniforms: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """One phase in one call: commit the first counts[b] of taps [B, n, F] to each row's context,
        then (anchors given) the block [anchor, MASK, ...] of spec.query_slots rows over it, the head
        on rows row0 .. row0 + depth - 1 and, with walk, the Markov walk and the confidences: greedy,
        or sampled for the rows whose sampling [B, 3] fp32 (temperature, top_k, top_p) has a
        temperature > 0, each slot drawn by its uniform in uniforms [B, depth].
        -> csrc/draft.cpp's outputs after the new lengths, which ctx takes."""
        S = spec.query_slots if anchors is not None else 0
        n = taps.shape[1] if taps is not None else 0
        end = int(ctx.lengths.max()) + n + S
        ctx.reserve(end)
        cos, sin = self._table(end)
        kv = [t for layer in ctx.layers for t in (layer.k, layer.v)]
        none = _NO_IDS
        out = self.ext.draft_forward(
            self.id,
            kv,
            ctx.lengths,
            ops.NO_TENSOR if taps is None else taps.to(torch.bfloat16),
            none if counts is None else counts,
            none if anchors is None else anchors,
            cos,
            sin,
            [att.causal for att in spec.layer_attention] if S else [],
            spec.mask_token_id if S else 0,
            S,
            row0,
            depth,
            walk,
            _NO_FLOATS if sampling is None else sampling,
            _NO_FLOATS if uniforms is None else uniforms,
        )
        ctx.lengths = out[0]
        return out[1:]

    def extend(self, ctx, taps: torch.Tensor, counts: torch.Tensor) -> None:
        """Commit the first counts[b] of taps [B, n, F] to each row's context, as `DSparkDraft.extend_context`."""
        self.call(None, ctx, taps, counts)


_NO_IDS = torch.zeros(0, dtype=torch.long)
# csrc/draft.cpp's Markov head kinds (0: none)
MARKOV_KINDS = {"vanilla": 1, "gated": 2, "rnn": 3}
_NO_FLOATS = torch.zeros(0, dtype=torch.float32)


def _in_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The same tensors, moved into 2 MB pages where the OS gives them (hugepages.into_huge_pages)."""
    holder = type("Held", (), {})()
    holder.t = tuple(tensors)
    hugepages.into_huge_pages([(holder, "t")])
    return list(holder.t)


def why_not(draft) -> str | None:
    """Why this draft decodes through its modules rather than the kernels, or None: it can.
    Asked where a draft context is made (which path runs on it is the context's, for good) and
    to check one; answered once per spec, weights (their dtype and device; a shape changes only
    with a new tensor), format and extension: it depends on those alone."""
    w = draft.fc.weight
    spec, settings = draft.spec, (weights(draft), kernels.extension() is not None, w.dtype, w.device)
    memo = draft.__dict__.get("_why_not")  # read_as views copy it, with their own spec
    if memo is None or memo[0] is not spec or memo[1] is not w or memo[2] != settings:
        memo = draft.__dict__["_why_not"] = (spec, w, settings, _why_not(draft))
    return memo[3]


def _why_not(draft) -> str | None:
    spec, b, w = draft.spec, draft.spec.backbone, draft.fc.weight
    if weights(draft) == "fp32":
        return FP32_REASON
    if w.device.type != "cpu":
        return f"weights on {w.device.type}"
    if w.dtype not in (torch.bfloat16, torch.float32):
        return f"{str(w.dtype).removeprefix('torch.')} weights; the kernels take bf16 or fp32 ones"
    if kernels.extension() is None:
        return kernels.why_unavailable()
    if any(att.sliding_window is not None for att in spec.layer_attention):
        return "sliding-window layers"
    if b.head_dim % 16 or b.hidden_act != "silu":
        return f"head size {b.head_dim}, activation {b.hidden_act}; the kernels take multiples of 16 and SiLU"
    shapes = _shapes(draft)
    bad = [s for s in shapes[:-1] if not packing.tile_applies(*s)] + [s for s in shapes[-1:] if s[0] % 16]
    if bad or draft.layers[0].mlp.gate_proj.weight.shape[0] % 16:
        return f"a matrix of {bad[0] if bad else 'gate/up'} shape; the kernels take outputs in 16s and inputs in 32s"
    if weights(draft) == "bf16" and max(n * k for n, k in shapes[:-1]) > packing.BF16_KERNEL_MAX:
        return "bf16 matrices larger than dspark's bf16 kernel holds (--draft-weights q8 takes them)"
    return None


def check_context(draft, ctx, rows: int) -> None:
    """A context made for the kernels (`ContextCache.kernels`) meets a draft they run and holds one
    row per block row: anything else is a caller's mistake, refused rather than run another way."""
    reason = why_not(draft)
    if reason is not None:
        raise ValueError(
            f"a draft context made for dspark's drafting kernels, given a draft they do not run ({reason})"
        )
    if ctx.lengths.shape[0] != rows:
        raise ValueError(f"the draft context holds {ctx.lengths.shape[0]} rows for a block of {rows} anchors")


def weights(draft) -> str:
    """The format the kernels hold this draft's matrices in (DRAFT_WEIGHTS: "auto", "q4", "q8" or
    "bf16"; `set_weights`), or "fp32": the draft's modules in fp32 instead."""
    return draft._fast.get("weights", "auto")


def set_weights(draft, fmt: str) -> None:
    """Choose the format of the kernels' copy of the draft's matrices (DRAFT_WEIGHTS; the views
    of read_as share it); the copy is rebuilt on its next use."""
    if fmt not in DRAFT_WEIGHTS:
        raise ValueError(f"draft weights must be one of {', '.join(DRAFT_WEIGHTS)}, got {fmt!r}")
    if draft._fast.get("weights", "auto") != fmt:
        draft._fast.pop("fast", None)
    draft._fast["weights"] = fmt


def describe(draft) -> str:
    """One line for the start-up notes: how this draft decodes, and in which numbers."""
    reason = why_not(draft)
    if reason is not None:
        return f"draft decodes through its modules ({reason})"
    w = weights(draft)
    fmt, head = {"auto": ("Q4_1", "Q8_0"), "q4": ("Q4_1", "Q4_1"), "q8": ("Q8_0", "Q8_0"), "bf16": ("bf16", "Q8_0")}[w]
    acts = (
        "8-bit activations in its matmuls" if w != "bf16" and kernels.q4_activations() == "int8" else "bf16 activations"
    )
    return f"draft phase: one call into dspark's CPU kernels ({fmt} matrices, head {head}, {acts})"


def for_draft(draft) -> FastDraft:
    """The draft's registered copy, built once and shared by its views (`read_as`); rebuilt when a
    weight has changed in place since, or the format was changed."""
    held = draft._fast
    fast = held.get("fast")
    if fast is None or fast.stale(draft):
        fast = held["fast"] = FastDraft(draft, weights(draft))
    return fast


def head_applies(draft, grad: bool | None = None) -> bool:
    """Does the modules' draft head run on the kernels' copy here (Q8_0, or Q4_1 with
    `--draft-weights q4`)? (bf16 on a CPU with dspark's matmul tile, no gradient wanted: grad None
    reads torch's current mode.)"""
    w = draft.lm_head.weight
    grad = torch.is_grad_enabled() if grad is None else grad
    return w.dtype == torch.bfloat16 and w.device.type == "cpu" and not grad and packing.tile_applies(*w.shape)
