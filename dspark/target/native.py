"""A native runtime for Llama-family targets (Llama/SmolLM2, Qwen2, Qwen3, Mistral), gpt-fast style.

The Hugging Face model stays the source of the weights (every loading path keeps working);
this file re-runs its forward pass with less machinery, because at batch 1 on a CPU a decode
step is bound by reading the weights and by per-op overhead, not by FLOPs:
- q/k/v and gate/up are fused into one matmul each (fewer, larger weight reads);
- RoPE cos/sin come from a table precomputed once from the model's own rotary module (so every
  static rope variant it implements is honoured; length-dependent ones are refused);
- one KV cache per batch row, preallocated with a capacity and a length per row: `commit` is a
  length update, rejected drafts are simply overwritten by the next forward, and a ragged batch
  is never repacked (each row writes at its own offset, a mask hides what lies past its length);
- the hidden-state taps are written in-line into the buffer the draft reads (tap i = the input
  of decoder layer i = HF hidden_states[i]; tap num_layers = the last layer's output BEFORE the
  final norm);
- with dspark's CPU extension (bf16; dspark/kernels.py) the whole layer loop is one call
  (csrc/layers.cpp), the same kernels in the same order as `_layers`, bit for bit;
- the LM head runs only on the positions whose logits are used;
- weights in the format that is fastest on the machine: fp32, bf16, or weight-only int8 /
  int4 (group 32, the layout of the GGUF Q4_0/Q4_1 files, so a model dequantised from such a
  file is held exactly as shipped) through torch's CPU weight-only kernels.

The `dspark.target.base.Target` interface, as `dspark.target.hf.HFTarget`: new_state / forward / commit /
select / merge /
set_taps, so `Engine(NativeTarget(model), draft)` runs unchanged.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from dspark import kernels
from dspark.kernels import NO_TENSOR, q8_groups
from dspark.errors import DSparkError, RequestError
from dspark.target.base import check_finite

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
# rope variants whose inv_freq does not depend on the sequence length: a table computed once
# from the model's rotary module is exact for them
STATIC_ROPE = ("default", "linear", "llama3", "yarn")
WEIGHTS = ("auto", "fp32", "bf16", "fp16", "int8", "int4")
FLOATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FLOAT_NAMES = {v: k for k, v in FLOATS.items()}  # a float dtype -> its weight-format name
GROUP = 32  # int4 group size along the input dimension (GGUF Q4_0/Q4_1 blocks are 32 weights)
CACHE_CHUNK = 256  # KV capacity grows in multiples of this (doubling), so growth copies are rare


def _rope_type(cfg) -> str:
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    return str(params.get("rope_type", params.get("type", "default")) or "default")


def supports(model) -> tuple[bool, str]:
    """(True, "") when this runtime reproduces `model`; else (False, why)."""
    cfg = getattr(model, "config", None)
    mt = getattr(cfg, "model_type", None)
    if mt not in FAMILIES:
        return False, f"architecture {type(model).__name__} (model_type {mt!r}) is not one of {', '.join(FAMILIES)}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return False, f"{type(model).__name__}: activation {cfg.hidden_act!r} (only silu is implemented)"
    rope = _rope_type(cfg)
    if rope not in STATIC_ROPE:
        return (
            False,
            f"{type(model).__name__}: rope type {rope!r} depends on the sequence length "
            f"(static variants: {', '.join(STATIC_ROPE)})",
        )
    layer_types = getattr(cfg, "layer_types", None) or []
    window = getattr(cfg, "sliding_window", None)
    sliding = any(t != "full_attention" for t in layer_types) or (
        mt == "mistral" and window is not None and window < getattr(cfg, "max_position_embeddings", 1 << 30)
    )
    if sliding:
        return False, f"{type(model).__name__}: sliding-window attention layers are not implemented"
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
        return False, f"{type(model).__name__}: no .model.layers/.rotary_emb (not a standard causal-LM layout)"
    attn = base.layers[0].self_attn
    if not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return False, f"{type(model).__name__}: attention without q/k/v/o projections"
    return True, ""


# ---- weight formats -----------------------------------------------------------------------
def int4_groups(w: torch.Tensor, group: int = GROUP):
    """Asymmetric 4-bit quantisation per `group` inputs (the GGUF Q4_1 rule: min and (max-min)/15).

    w [N, K] -> (q [N, K] int32 in 0..15, scale [N, K/group], minimum [N, K/group]) all fp32.
    A weight that already is 4-bit (dequantised from Q4_0/Q4_1) has its minimum and maximum on
    the grid, so this recovers its exact values.
    """
    N, K = w.shape
    g = w.float().reshape(N, K // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    d = (hi - lo) / 15
    q = ((g - lo[..., None]) / torch.where(d > 0, d, 1.0)[..., None]).round().clamp(0, 15)
    return q.reshape(N, K).to(torch.int32), d, lo


def is_int4_exact(w: torch.Tensor, group: int = GROUP, rows: int | None = None) -> bool:
    """Are w's values exactly 4-bit groups (as dequantised from a Q4 GGUF)? fp32 tolerance.

    rows: check only the first `rows` output rows, a quick screen (one inexact row settles it;
    the int4 Linear re-checks the whole matrix as it packs it).
    """
    if w.shape[1] % group or w.shape[0] % 16:  # the int4 kernels take 16 output columns at a time
        return False
    w = w if rows is None else w[:rows]
    return _int4_exact(w, *int4_groups(w, group), group)


def is_q8_exact(w: torch.Tensor, rows: int | None = None, group: int = GROUP) -> bool:
    """Are w's values exactly Q8_0 groups (int8 times a scale per 32 inputs)? fp32 tolerance."""
    if w.shape[1] % group or w.shape[0] % 16:
        return False
    w = w if rows is None else w[:rows]
    q, d = q8_groups(w, group)
    N, K = w.shape
    err = (q.reshape(N, K // group, group).float() * d[..., None] - w.float().reshape(N, K // group, group)).abs()
    return bool((err <= 1e-6 * d[..., None] + 1e-12).all())


def _int4_exact(w, q, d, lo, group: int = GROUP) -> bool:
    N, K = w.shape
    rec = q.reshape(N, K // group, group).float() * d[..., None] + lo[..., None]
    err = (rec - w.float().reshape(N, K // group, group)).abs()
    return bool((err <= 1e-6 * (d.abs() + lo.abs())[..., None] + 1e-12).all())


class Linear:
    """y = x @ W.T (+ b) with W held in one format. x [..., K] in the activation dtype -> [..., N]."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, fmt: str, act: torch.dtype, ops: str = "auto"):
        self.fmt, self.out_features, self.exact = fmt, w.shape[0], fmt in FLOATS
        self.b = None if b is None else b.detach().to(act)
        self.packed = self.q4 = self.q8 = None
        w = w.detach()
        if fmt == "bf16" and act == torch.bfloat16:
            self.packed = kernels.pack_bf16(w)  # only the packed copy is kept
        if self.packed is not None:
            self.w = None
        elif fmt in FLOATS:
            self.w = w.to(FLOATS[fmt]).contiguous()
        elif fmt == "int8":  # symmetric, one scale per output channel
            s = w.float().abs().amax(1).clamp_min(1e-12) / 127
            self.w = (w.float() / s[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
            self.s = s.to(act)
        elif fmt == "q8_0":  # group 32, w = q * d (the GGUF Q8_0 rule), dspark's kernel only
            if not (act == torch.bfloat16 and w.device.type == "cpu" and kernels.tile_applies(*w.shape)):
                raise DSparkError(
                    f"q8_0 weights need dspark's matmul tile (AVX2 or AVX512-BF16 builds) and bf16 "
                    f"activations ({kernels.q4_status()})"
                )
            q, d = q8_groups(w)
            self.exact = is_q8_exact(w)
            self.q8, self.w, self.kernel = kernels.pack_q8(q, d), None, kernels.tile_name()
        elif fmt == "int4":  # group 32, kernel convention w = (q - 8) * scale + zero
            if w.shape[1] % GROUP or w.shape[0] % 16:
                raise DSparkError(
                    f"int4 weights need an input size divisible by {GROUP} and an output size "
                    f"divisible by 16, got {w.shape[0]} x {w.shape[1]}"
                )
            q, d, lo = int4_groups(w)
            self.exact = _int4_exact(w, q, d, lo)  # the packed values are w's own (a Q4 GGUF's)
            if ops == "auto" and act == torch.bfloat16 and w.device.type == "cpu" and kernels.tile_applies(*w.shape):
                # dspark's kernel: d and lo kept exact (fp32, or fp16 where every value is one, as
                # GGUF's; torch's rounds them to bf16), and a verify of 8 rows costs far less than 8
                # single rows (kernels.py)
                self.q4, self.w = kernels.pack_q4(q, d, lo), None
                self.kernel = kernels.tile_name()
            else:  # torch's kernel, whose scale and zero are rounded to the activation dtype
                self.kernel = (
                    "torch (asked for)"
                    if ops == "torch"
                    else kernels.q4_status()
                    if act == torch.bfloat16
                    else "torch (fp32 activations)"
                )
                self.w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
                self.s = torch.stack([d, lo + 8 * d], -1).transpose(0, 1).contiguous().to(act)  # [K/32, N, 2]
        else:
            raise DSparkError(f"unknown weight format {fmt!r} (choose from {', '.join(WEIGHTS)})")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return kernels.packed_linear(x, self.packed, self.b, self.out_features)
        if self.fmt in FLOATS:
            return F.linear(x, self.w, self.b)
        if self.q4 is not None or self.q8 is not None:  # dspark's tile takes x's own shape
            y = kernels.q4_linear(x, self.q4) if self.q4 is not None else kernels.q8_linear(x, self.q8)
            return y if self.b is None else y + self.b
        x2 = x.reshape(-1, x.shape[-1])
        if self.fmt == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x2, self.w, self.s)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.w, GROUP, self.s)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.b is None else y + self.b


@dataclass
class Layer:
    ln1: torch.Tensor  # [H]
    wqkv: Linear  # H -> (Hq + 2 Hkv) * D
    qk_norm: torch.Tensor | None  # [Hq + Hkv, D]: Qwen3's q_norm per query head, k_norm per key head
    wo: Linear  # Hq*D -> H
    ln2: torch.Tensor
    w13: Linear  # H -> 2 I (gate | up)
    w2: Linear  # I -> H


class _LayerStack:
    """The layers handed to the extension's `layers_forward` (csrc/layers.cpp: the decoder's layer
    loop in one call, the Python loop's kernels in its order); released with the last target
    view that holds it."""

    def __init__(self, ext, layers: list[Layer], head: "Linear | None" = None):
        def weight(lin):
            packed = lin.q4 or lin.q8 or lin.packed
            return [
                packed[0],
                packed[1],
                packed[2] if len(packed) > 2 else NO_TENSOR,
                NO_TENSOR if lin.b is None else lin.b,
            ]

        flat = []
        for ly in layers:
            flat += [ly.ln1, NO_TENSOR if ly.qk_norm is None else ly.qk_norm, ly.ln2]
            for lin in (ly.wqkv, ly.wo, ly.w13, ly.w2):
                flat += weight(lin)
        # the head too where the tile holds it: a greedy plain step then takes its argmax in the same call
        self.head = head is not None and _on_tile(head)
        flat += weight(head) if self.head else [NO_TENSOR] * 4
        self.ext, self.id = ext, ext.layers_register(flat)

    def __del__(self):
        try:
            self.ext.layers_release(self.id)
        except Exception:  # at interpreter exit the extension may be gone first; nothing to free then
            pass

    @staticmethod
    def of(target: "NativeTarget") -> "_LayerStack | None":
        """Where every piece of the forward runs on the extension's kernels (bf16 with the matmul
        tile, heads of a multiple of 16, a gate/up width of a multiple of 32), else None."""
        if target._ext is None or target.head_dim % 16:
            return None
        for ly in target.layers:
            if not all(_on_tile(lin) for lin in (ly.wqkv, ly.wo, ly.w13, ly.w2)) or ly.w13.out_features % 32:
                return None
        return _LayerStack(target._ext, target.layers, target.head)  # a head on the tile runs in bf16, as the layers


def _on_tile(lin: "Linear") -> bool:
    """Is this weight on dspark's matmul tile (int4, Q8_0 or packed bf16)?"""
    return lin.q4 is not None or lin.q8 is not None or isinstance(lin.packed, tuple)


@dataclass
class NativeState:
    """KV cache of B requests: kv [L, 2, B, Hkv, C, D]; row b holds lengths[b] committed entries.

    Entries at >= lengths[b] are garbage (rejected drafts, padding) that the next forward
    overwrites; `pending` counts the entries the last forward appended, awaiting commit.
    """

    kv: torch.Tensor | None
    lengths: torch.Tensor  # [B] long
    pending: int = 0
    # (kv, [(K, V) of each layer]): made once per kv tensor, not 2 selects a layer every forward
    _views: tuple = field(default=(), repr=False, compare=False)

    def layer_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """[(keys, values) [B, Hkv, C, D] of each layer], views of kv."""
        if not self._views or self._views[0] is not self.kv:
            self._views = (self.kv, [(layer[0], layer[1]) for layer in self.kv])
        return self._views[1]

    @property
    def batch(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def capacity(self) -> int:
        return 0 if self.kv is None else int(self.kv.shape[4])


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # HF's RMSNorm: normalise in fp32, cast back to the activation dtype, then scale
    return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, S, h, D], cos/sin [B, S, 1, D]; HF's rotate_half convention (halves, not pairs)
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat((-x2, x1), -1) * sin


def resolve_weights(model, weights: str, device) -> str:
    """'auto': keep the model's own numbers, only repacking them where that is exact and faster.

    A model whose decoder weights are exactly 4-bit groups of 32 (dequantised from a Q4 GGUF,
    like the shipped SmolLM2) runs as int4 on CPU: the same values, a quarter of the bytes of
    bf16 to stream per token (measured fastest at 1 and 8 rows, docs/BENCHMARKS.md). Any other
    model keeps its dtype: fp32 stays fp32, bf16 stays bf16; quantising it is an explicit choice.
    """
    if weights not in WEIGHTS:
        raise DSparkError(f"unknown weights {weights!r} (choose from {', '.join(WEIGHTS)})")
    if weights != "auto":
        if weights in ("int8", "int4") and torch.device(device).type != "cpu":
            raise DSparkError(f"weights {weights!r} use torch's CPU kernels; the model is on {device}")
        return weights
    dtype = next(model.parameters()).dtype
    if torch.device(device).type == "cpu" and dtype == torch.float32:
        # a screen of 64 rows per matrix; NativeTarget falls back to fp32 if packing finds otherwise
        if all(is_int4_exact(m.weight, rows=64) for layer in model.model.layers for m in _linears(layer)):
            return "int4"
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


def _linears(layer):
    a, m = layer.self_attn, layer.mlp
    return (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)


class NativeTarget:
    """A Llama-family causal LM run natively; see the module docstring.

    model: the loaded HF model (weights are copied into the chosen format; the model itself
      is kept as `.model` for code that wants the reference path).
    weights: 'auto' | 'fp32' | 'bf16' | 'fp16' | 'int8' | 'int4' (see `resolve_weights`).
    head: format of the LM head; None = the decoder's format, except under 'auto' int4, where
      a head that is not itself 4-bit (SmolLM2's is Q8_0 in the GGUF) stays in float (the
      activation dtype) rather than being quantised further.
    act_dtype: activation/KV dtype; default fp32 for fp32 weights, else bf16 (torch's CPU
      int8/int4 kernels are vectorised for bf16 activations only). fp32 activations with
      int4/int8 weights are exact but slow: for tests.
    ops: 'auto' (dspark's compiled CPU ops where they run: the int4 and Q8_0 matmuls, the fused
      norms, attention by position; dspark.kernels) | 'torch' (torch's ops throughout, to compare).
    """

    def __init__(
        self,
        model,
        tap_indices: tuple[int, ...] = (),
        weights: str = "auto",
        head: str | None = None,
        act_dtype: torch.dtype | None = None,
        ops: str = "auto",
    ):
        if ops not in ("auto", "torch"):
            raise DSparkError(f"unknown ops {ops!r} (choose auto or torch)")
        self.ops = ops
        ok, why = supports(model)
        if not ok:
            raise DSparkError(f"the native runtime does not support this model: {why}")
        self.model = model.eval()
        self.config = cfg = model.config
        self.device = next(model.parameters()).device
        requested = weights
        self.weights = resolve_weights(model, weights, self.device)
        self.dtype = act_dtype or FLOATS.get(self.weights, torch.bfloat16)
        if self.weights in FLOATS and self.dtype != FLOATS[self.weights]:
            raise DSparkError(f"weights {self.weights!r} run with {self.weights} activations, not {self.dtype}")
        act = self.dtype
        base = model.model
        self.num_layers = len(base.layers)
        self.hidden_size = cfg.hidden_size
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.eps = cfg.rms_norm_eps
        self.max_length = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 30)
        lm_head = model.get_output_embeddings()
        self.vocab_size = lm_head.weight.shape[0]
        with torch.no_grad():
            self.embed = base.embed_tokens.weight.detach().to(act)  # [V, H]: a gather, any format is cheap
            self.layers = self._build(base, self.weights, act)
            if requested == "auto" and not all(
                lin.exact for ly in self.layers for lin in (ly.wqkv, ly.wo, ly.w13, ly.w2)
            ):
                # the 64-row screen passed but a later row is not 4-bit: keep the model's own numbers
                self.weights, self.dtype = "fp32", torch.float32
                act = self.dtype
                self.embed = base.embed_tokens.weight.detach().to(act)
                self.layers = self._build(base, self.weights, act)
            self.norm = base.norm.weight.detach().to(act)
            # the norms and attention of dspark's extension (bf16 only; torch's ops otherwise)
            self._ext = (
                kernels.extension() if ops == "auto" and act == torch.bfloat16 and self.device.type == "cpu" else None
            )
            auto_int4_head = head is None and requested == "auto" and self.weights == "int4"
            if auto_int4_head and not is_int4_exact(lm_head.weight, rows=64):
                # not 4-bit: an exact Q8_0 head (the GGUF's, for SmolLM2) runs on dspark's int8
                # kernel where it can, else the head stays in float; it is never re-quantised
                q8 = (
                    ops == "auto"
                    and act == torch.bfloat16
                    and kernels.tile_applies(*lm_head.weight.shape)
                    and is_q8_exact(lm_head.weight, rows=64)
                )
                head = "q8_0" if q8 else "fp32" if act == torch.float32 else "bf16"
            head = head or self.weights
            if (
                head == "int4" and lm_head.weight.shape[0] % 16
            ):  # no int4 kernel holds it: the head stays float (describe() says so)
                head = "fp32" if act == torch.float32 else "bf16"
            self.head = Linear(lm_head.weight, lm_head.bias, head, FLOATS.get(head, act), ops)
            if auto_int4_head and not self.head.exact:
                head = "fp32" if act == torch.float32 else "bf16"
                self.head = Linear(lm_head.weight, lm_head.bias, head, FLOATS[head])
            self.head_format = head
            self._head_act = FLOATS.get(head, act)  # a float head runs in its own dtype
            # RoPE table [P, D] from the model's own rotary module (inv_freq + attention scaling),
            # computed in fp32 as HF does, then cast to the activation dtype as HF does
            rot = base.rotary_emb
            inv = rot.inv_freq.float().to(self.device)
            t = torch.arange(self.max_length + CACHE_CHUNK, device=self.device, dtype=torch.float32)
            freqs = torch.outer(t, inv)
            emb = torch.cat([freqs, freqs], -1)
            scale = float(getattr(rot, "attention_scaling", 1.0))
            self.cos = (emb.cos() * scale).to(act)
            self.sin = (emb.sin() * scale).to(act)
            # every weight a step streams in 2 MB pages, where the OS gives them (before the
            # extension's layer stack takes its references)
            lins = [lin for ly in self.layers for lin in (ly.wqkv, ly.wo, ly.w13, ly.w2)] + [self.head]
            self.huge_pages = (
                kernels.into_huge_pages([(lin, f) for lin in lins for f in ("q4", "q8", "packed", "w")]) > 0
            )
        self._stack = _LayerStack.of(self)
        self.set_taps(tap_indices)

    def _build(self, base, fmt: str, act: torch.dtype) -> list[Layer]:
        layers = []
        for layer in base.layers:
            a, m = layer.self_attn, layer.mlp
            layers.append(
                Layer(
                    ln1=layer.input_layernorm.weight.detach().to(act),
                    wqkv=Linear(
                        torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                        kernels.fused_bias(a.q_proj, a.k_proj, a.v_proj),
                        fmt,
                        act,
                        self.ops,
                    ),
                    qk_norm=torch.cat(
                        [
                            a.q_norm.weight.detach().expand(self.n_heads, -1),
                            a.k_norm.weight.detach().expand(self.n_kv, -1),
                        ]
                    ).to(act)
                    if hasattr(a, "q_norm")
                    else None,
                    wo=Linear(a.o_proj.weight, a.o_proj.bias, fmt, act, self.ops),
                    ln2=layer.post_attention_layernorm.weight.detach().to(act),
                    w13=Linear(
                        torch.cat([m.gate_proj.weight, m.up_proj.weight]),
                        kernels.fused_bias(m.gate_proj, m.up_proj),
                        fmt,
                        act,
                        self.ops,
                    ),
                    w2=Linear(m.down_proj.weight, m.down_proj.bias, fmt, act, self.ops),
                )
            )
        return layers

    def _int4_linears(self) -> list[Linear]:
        lins = [lin for ly in self.layers for lin in (ly.wqkv, ly.wo, ly.w13, ly.w2)] + [self.head]
        return [lin for lin in lins if lin.fmt == "int4"]

    def int4_kernels(self) -> str | None:
        """Which int4 kernel the matmuls run on ('dspark', 'torch', 'dspark+torch'), None without int4."""
        return "+".join(sorted({"dspark" if lin.q4 is not None else "torch" for lin in self._int4_linears()})) or None

    def extension(self) -> str | None:
        """The build of dspark's extension this target's norms, attention and RoPE run on (its ISA
        and source hash), or None."""
        return kernels.build_tag() if self._ext is not None else None

    def describe(self) -> str:
        kernel = ""
        int4 = self._int4_linears()
        if int4:
            ours = sum(lin.q4 is not None for lin in int4)
            kernel = (
                f", int4 kernel: {kernels.tile_name()} ({ours} of {len(int4)} matrices{kernels.q4_note()})"
                if ours
                else f", int4 kernel: {int4[0].kernel}"
            )
        ext = f", norms and attention: dspark {kernels.extension_isa()}" if self._ext is not None else ""
        return (
            f"native runtime, weights {self.weights} (head {self.head_format}), "
            f"activations {str(self.dtype).removeprefix('torch.')}{kernel}{ext}"
        )

    # ---- hidden-state taps -------------------------------------------------------------
    def view(self, tap_indices: tuple[int, ...] = ()) -> "NativeTarget":
        """Another target over the same packed weights with its own taps (nothing is copied)."""
        other = copy.copy(self)
        other.set_taps(tap_indices)
        return other

    def set_taps(self, tap_indices: tuple[int, ...]) -> None:
        """Tap i = input of decoder layer i = HF hidden_states[i]; i = num_layers is the last
        layer's output before the final norm (HF's hidden_states[-1] is after it)."""
        for i in tap_indices:
            if not 0 <= i <= self.num_layers:
                raise RequestError(f"hidden_state_index {i} is outside 0..{self.num_layers} for this target")
        self.tap_indices = tuple(tap_indices)
        # the forward writes tap i (i >= 1) into its columns of the taps as layer i - 1 adds its
        # MLP output: _tap_cols[li] = those columns' offset for layer li's output, else -1
        H = self.embed.shape[1]
        self._tap_width = len(self.tap_indices) * H  # the taps' columns, n * H
        self._tap_cols = [-1] * self.num_layers
        for k, i in enumerate(self.tap_indices):
            if i >= 1 and self._tap_cols[i - 1] < 0:
                self._tap_cols[i - 1] = k * H
        # the rest, copied after the layers: tap 0 (the embeddings: source None) and repeats of an index
        self._tap_fill = [
            (k * H, None if i == 0 else self._tap_cols[i - 1])
            for k, i in enumerate(self.tap_indices)
            if i == 0 or self._tap_cols[i - 1] != k * H
        ]

    # ---- cache ---------------------------------------------------------------------------
    def new_state(self, batch: int = 1) -> NativeState:
        return NativeState(None, torch.zeros(batch, dtype=torch.long, device=self.device))

    def _alloc(self, batch: int, capacity: int) -> torch.Tensor:
        shape = (self.num_layers, 2, batch, self.n_kv, capacity, self.head_dim)
        if self.device.type == "cpu":  # attention reads it every step: in 2 MB pages where the OS gives them
            return kernels.huge_zeros(shape, self.dtype)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _reserve(self, state: NativeState, need: int) -> None:
        """Make room for `need` entries per row (rare: capacity doubles, in CACHE_CHUNK steps)."""
        if need <= state.capacity:
            return
        cap = max(need, 2 * state.capacity)
        cap = -(-cap // CACHE_CHUNK) * CACHE_CHUNK
        kv = self._alloc(state.batch, cap)
        if state.kv is not None:
            kv[..., : state.capacity, :] = state.kv
        state.kv = kv

    @torch.inference_mode()
    def forward(
        self, state: NativeState, tokens: torch.Tensor, counts: torch.Tensor | None = None, logits: str = "all"
    ):
        """tokens [B, S] (row b valid for counts[b] <= S) -> logits [B, S, V] fp32, taps [B, S, n*H].

        logits="last": only each row's last valid position -> [B, 1, V] (prefill needs no more).
        logits="final": no LM head: the post-norm final hidden states [B, S, H] instead (what
        training's features store; padding positions hold whatever padding computes).
        logits="argmax": each position's greedy token [B, S] int64 (torch's argmax of its logits,
        padding positions included; a greedy plain step needs no more, and on the extension's
        layer stack it comes out of the same call, with no fp32 logits made).
        Padding positions (>= counts[b]) get zero logits: nothing reads them.
        taps is a new tensor on every call, as HFTarget.forward's (the engine keeps it).
        """
        if state.pending:
            raise RuntimeError("commit() the previous forward before running another")
        B, S = tokens.shape
        dev = self.device
        tokens = tokens.to(dev, torch.long)  # the layer stack reads int64 ids (F.embedding took int32 too)
        full = counts is None
        lengths = state.lengths
        L0 = int(lengths.max())
        if (L0 + S if full else int((lengths + counts.to(dev)).max())) > self.max_length:
            raise RequestError(f"sequence would exceed the target's context of {self.max_length} tokens")
        self._reserve(state, L0 + S)
        H, width = self.embed.shape[1], self._tap_width
        ids = None
        if self._stack is not None:  # the embedding, `_layers` (and the head's argmax) in one call (csrc/layers.cpp)
            argmax = logits == "argmax" and self._stack.head
            # the call makes the taps [B, S, n*H] and writes each tap as its layer runs
            out = self._ext.layers_forward(
                self._stack.id,
                tokens,
                self.embed,
                state.kv,
                self.cos,
                self.sin,
                lengths,
                self.norm,
                self.eps,
                self.n_heads,
                self.n_kv,
                width,
                self._tap_cols,
                argmax,
            )
            embedded, x, h = out[:3]
            tapped = out[3] if width else None
            ids = out[4] if argmax else None
        else:
            # taps [B, S, n*H]: each tap written in place as its layer runs (a new buffer each call)
            tapped = torch.empty(B, S, width, dtype=self.embed.dtype, device=dev) if width else None
            pos = lengths[:, None] + torch.arange(S, device=dev)[None, :]  # [B, S]
            x = embedded = F.embedding(tokens, self.embed)  # [B, S, H]
            x, h = self._layers(x, state, pos, L0, tapped)
        for col, src in self._tap_fill:
            tapped[..., col : col + H] = embedded if src is None else tapped[..., src : src + H]
        state.pending = S
        # a NaN / inf row must end its own request, not become tokens (engine.Engine._recover); on the
        # final states, which every logits mode derives from: [B, S, H], far cheaper than the logits
        check_finite(h, "final hidden states")
        # h: the final norm of every position (a per-row op: selecting rows first changes nothing)
        if logits == "final":
            return h, tapped
        if logits == "argmax":
            return (ids if ids is not None else kernels.argmax(self._logits(h))), tapped
        if logits == "last":
            if full:
                return self._logits(h[:, -1:]), tapped  # [B, 1, V]
            h = h[torch.arange(B, device=dev), counts.to(dev) - 1][:, None]  # [B, 1, H]
            return self._logits(h), tapped
        if full or bool((counts == S).all()):
            return self._logits(h), tapped
        valid = torch.arange(S, device=dev)[None, :] < counts.to(dev)[:, None]  # [B, S]
        out = torch.zeros(B, S, self.vocab_size, device=dev)
        out[valid] = self._logits(h[valid])
        return out, tapped

    def _layers(self, x, state, pos, L0: int, tapped):
        """The decoder layers over the embeddings x [B, S, H] at positions pos [B, S] (L0: the
        longest row's committed length) -> (the last layer's output, its final norm); the
        extension's `layers_forward` runs the fused_attn branch in one call."""
        B, S, _ = x.shape
        dev = x.device
        T = L0 + S  # keys read: every row's committed entries + the S new ones (shorter rows masked)
        lengths = state.lengths
        uniform = B == 1 or bool((lengths == lengths[0]).all())
        Hq, Hkv, D = self.n_heads, self.n_kv, self.head_dim
        G = Hq // Hkv
        # dspark's RoPE and attention kernels (bf16 on a CPU with the extension) read positions:
        # no RoPE rows to gather, no mask to build
        fused_attn = self._ext is not None and D % 16 == 0
        if fused_attn:
            cos = sin = None
        elif uniform:
            cos, sin = self.cos[L0 : L0 + S][None, :, None], self.sin[L0 : L0 + S][None, :, None]  # [1, S, 1, D]
        else:
            p = pos.clamp(max=self.cos.shape[0] - 1)  # padding may run past the table; never read
            cos, sin = self.cos[p][:, :, None], self.sin[p][:, :, None]  # [B, S, 1, D]
        if fused_attn or (uniform and S == 1):
            mask = None  # one new query per row sees every entry up to itself
        else:
            # key j visible to new position i of row b iff j <= lengths[b] + i: committed entries
            # plus the causal part of the new ones; stale entries past a row's length are hidden
            m = torch.arange(T, device=dev)[None, None, :] <= pos[:, :, None]  # [B, S, T]
            # GQA without copying K/V: the G query heads sharing a KV head are folded into the
            # query axis ([B, Hkv, G*S, D]), so the mask repeats per group
            mask = m[:, None].repeat(1, 1, G, 1)  # [B, 1, G*S, T]
        bidx = None if fused_attn or uniform else torch.arange(B, device=dev)[:, None]  # ragged cache writes
        layer_kv = state.layer_kv()
        h = self._norm(x, self.layers[0].ln1)
        for li, layer in enumerate(self.layers):
            qkv = layer.wqkv(h).view(B, S, Hq + 2 * Hkv, D)  # heads: Hq queries | Hkv keys | Hkv values
            kc, vc = layer_kv[li]  # [B, Hkv, C, D]
            if fused_attn and layer.qk_norm is None:
                qk, v = qkv, NO_TENSOR  # the kernel reads the value heads from qkv: no slices
            else:
                qk, v = qkv[:, :, : Hq + Hkv], qkv[:, :, Hq + Hkv :]
                if layer.qk_norm is not None:  # Qwen3: q_norm on query heads, k_norm on key heads, one call
                    qk = self._norm(qk, layer.qk_norm)  # a weight row per head
            if fused_attn:
                # RoPE and the cache write in one call, then each query (b, s) over keys 0..pos[b, s]:
                # no mask to build, no transposes
                q = self._ext.rope_cache_bf16(qk, v, self.cos, self.sin, kc, vc, pos)  # [B, S, Hq, D]
                o = self._ext.attn_bf16(q, kc, vc, pos, D**-0.5)  # [B, S, Hq*D]
            else:
                qk = _rope(qk, cos, sin)  # queries and keys rotated together: half the small ops
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
            x, h = self._add_norm(x, layer.wo(o), layer.ln2)
            # the residual add and the next layer's input norm (the final norm after the last)
            # the last layer's output is tapped before the final norm, like the HF target's hook
            x, h = self._add_norm(
                x,
                layer.w2(kernels.silu_mul(layer.w13(h), self._ext)),
                self.layers[li + 1].ln1 if li + 1 < self.num_layers else self.norm,
                tapped,
                self._tap_cols[li],
            )
        return x, h

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self._ext.rms_bf16(x, w, self.eps) if self._ext is not None else _rms(x, w, self.eps)

    def _add_norm(
        self, x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, taps: torch.Tensor | None = None, col: int = -1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + r, its norm with weight w): one call on dspark's extension. With col >= 0, x + r
        is also written to taps[..., col : col + H]."""
        if self._ext is not None:
            return self._ext.add_rms_bf16(x, r, w, self.eps, NO_TENSOR if col < 0 else taps, max(col, 0))
        x = x + r
        if col >= 0:
            taps[..., col : col + x.shape[-1]] = x
        return x, _rms(x, w, self.eps)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """h: final-normed hidden states -> fp32 logits."""
        return self.head(h.to(self._head_act)).float()

    def commit(self, state: NativeState, keep: torch.Tensor) -> None:
        """Keep the first keep[b] pending entries of each row: a length update, nothing moves."""
        state.lengths = state.lengths + keep.to(state.lengths.device)
        state.pending = 0

    def select(self, state: NativeState, rows: torch.Tensor) -> NativeState:
        """The sub-batch of `rows` (requests leaving drop out of the batch)."""
        kv = None if state.kv is None else state.kv[:, :, rows.to(self.device)]
        return NativeState(kv, state.lengths[rows])

    def merge(self, states: list[NativeState]) -> NativeState:
        """One batch from several states (a request joins after its own prefill)."""
        cap = max(s.capacity for s in states)
        kvs = [s.kv if s.kv is not None else self._alloc(s.batch, cap) for s in states]
        kvs = [F.pad(kv, (0, 0, 0, cap - kv.shape[4])) if kv.shape[4] < cap else kv for kv in kvs]
        return NativeState(torch.cat(kvs, 2), torch.cat([s.lengths for s in states]))
