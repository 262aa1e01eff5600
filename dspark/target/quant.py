"""Weight formats of the native runtime: how a matrix is held and multiplied.

fp32 / bf16 / fp16 as loaded; int8 (symmetric, one scale per output channel) and int4 (group
32, the layout of the GGUF Q4_0/Q4_1 files, so a model dequantised from such a file is held
exactly as shipped) on torch's CPU weight-only kernels, or on dspark's matmul tile (int4, Q8_0,
packed bf16: dspark/packing.py) where it runs. `resolve_weights` picks the format for 'auto'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dspark import kernels, ops, packing
from dspark.errors import DSparkError
from dspark.packing import q8_groups
from dspark.target.checkpoint import checkpoint_of

WEIGHTS = ("auto", "fp32", "bf16", "fp16", "int8", "int4")
FLOATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FLOAT_NAMES = {v: k for k, v in FLOATS.items()}  # a float dtype -> its weight-format name
GROUP = 32  # int4 group size along the input dimension (GGUF Q4_0/Q4_1 blocks are 32 weights)


def int4_groups(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
            self.packed = packing.pack_bf16(w)  # only the packed copy is kept
        if self.packed is not None:
            self.w = None
        elif fmt in FLOATS:
            self.w = w.to(FLOATS[fmt]).contiguous()
        elif fmt == "int8":  # symmetric, one scale per output channel
            s = w.float().abs().amax(1).clamp_min(1e-12) / 127
            self.w = (w.float() / s[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
            self.s = s.to(act)
        elif fmt == "q8_0":  # group 32, w = q * d (the GGUF Q8_0 rule), dspark's kernel only
            if not (act == torch.bfloat16 and w.device.type == "cpu" and packing.tile_applies(*w.shape)):
                raise DSparkError(
                    f"q8_0 weights need dspark's matmul tile (AVX2 or AVX512-BF16 builds) and bf16 "
                    f"activations ({kernels.q4_status()})"
                )
            q, d = q8_groups(w)
            self.exact = is_q8_exact(w)
            self.q8, self.w, self.kernel = packing.pack_q8(q, d), None, kernels.tile_name()
        elif fmt == "int4":  # group 32, kernel convention w = (q - 8) * scale + zero
            if w.shape[1] % GROUP or w.shape[0] % 16:
                raise DSparkError(
                    f"int4 weights need an input size divisible by {GROUP} and an output size "
                    f"divisible by 16, got {w.shape[0]} x {w.shape[1]}"
                )
            q, d, lo = int4_groups(w)
            self.exact = _int4_exact(w, q, d, lo)  # the packed values are w's own (a Q4 GGUF's)
            if ops == "auto" and act == torch.bfloat16 and w.device.type == "cpu" and packing.tile_applies(*w.shape):
                # dspark's kernel: d and lo kept exact (fp32, or fp16 where every value is one, as
                # GGUF's; torch's rounds them to bf16), and a verify of 8 rows costs far less than 8
                # single rows (kernels.py)
                self.q4, self.w = packing.pack_q4(q, d, lo), None
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
            return ops.packed_linear(x, self.packed, self.b, self.out_features)
        if self.fmt in FLOATS:
            assert self.w is not None  # a float format not packed keeps its weight as is
            return F.linear(x, self.w, self.b)
        if self.q4 is not None or self.q8 is not None:  # dspark's tile takes x's own shape
            y = ops.q4_linear(x, self.q4) if self.q4 is not None else ops.q8_linear(x, self.q8)
            return y if self.b is None else y + self.b
        x2 = x.reshape(-1, x.shape[-1])
        if self.fmt == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x2, self.w, self.s)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.w, GROUP, self.s)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.b is None else y + self.b


def on_tile(lin: Linear) -> bool:
    """Is this weight on dspark's matmul tile (int4, Q8_0 or packed bf16)?"""
    return lin.q4 is not None or lin.q8 is not None or isinstance(lin.packed, tuple)


def resolve_weights(model, weights: str, device) -> str:
    """'auto': keep the model's own numbers, only repacking them where that is exact and faster
    (model: a transformers model or its dspark.target.checkpoint.Checkpoint).

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
    ck = checkpoint_of(model)
    dtype = ck.dtype
    if torch.device(device).type == "cpu" and dtype == torch.float32:
        # a screen of 64 rows per matrix; NativeTarget falls back to fp32 if packing finds otherwise
        names = [f"model.layers.{i}.{n}.weight" for i in range(ck.config.num_hidden_layers) for n in HF_LINEARS]
        if all(is_int4_exact(ck.tensor(n), rows=64) for n in names):
            return "int4"
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


HF_LINEARS = tuple(f"self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj")) + tuple(
    f"mlp.{n}" for n in ("gate_proj", "up_proj", "down_proj")
)
