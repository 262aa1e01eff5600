"""Weights in the layouts the CPU matmuls read: dspark's tiles (int4 / Q4_1, Q8_0 and bf16, the layout
of the extension's build: `kernels`) and oneDNN's prepacked bf16.

bf16 weights on a CPU run through a packed linear instead of `F.linear`: oneDNN's prepacked one
(measured on Zen 4, AVX512-BF16: faster at 1-8 rows on SmolLM2's shapes, the same numbers bit for
bit there), and where dspark's extension is built, its own tile for all but the largest weights
(`BF16_KERNEL_MAX`). Group scales and minimums that are all fp16 numbers (GGUF's: "group scales in
fp16", docs/history/benchmarks.md) are held in fp16. Packed weights are made where they run and
never stored, except by the pack cache (`target/packcache.py`), which keys them by build.
"""

from __future__ import annotations

import torch

from dspark import kernels
from dspark.errors import DSparkError

# bf16 weights up to this many elements run on dspark's kernel (csrc/q4_avx*.cpp `bf16_mm`) where it is
# built: faster than oneDNN's packed matmul at 1-8 rows on SmolLM2's layer and draft shapes (measured
# on Zen 4, docs/history/benchmarks.md). Larger ones (an LM head over the vocabulary) stay on oneDNN:
# at 8 rows it is ahead there, while the tile is ahead at 1-3 rows; a bf16 head is rare (a float
# target head; the draft's is Q8_0).
BF16_KERNEL_MAX = 1 << 22


def pack_bf16(w: torch.Tensor):
    """w [N, K] on a CPU -> its packed bf16 weight for `packed_linear` (dspark's layout, or oneDNN's
    prepacked one); None where neither applies (another device, a torch build without oneDNN) or
    where plain F.linear is faster: fewer than 16 outputs (the draft's confidence head, one output:
    oneDNN's packed call costs several times F.linear's in a drafting step, most of it set-up)."""
    if w.device.type != "cpu" or w.shape[0] < 16:
        return None
    N, K = w.shape
    if N * K <= BF16_KERNEL_MAX and tile_applies(N, K):
        G = K // 32  # [N/16, K/32, 16 input pairs, 16 columns x 2]: csrc/q4_avx512.cpp's bf16_mm layout
        P = w.detach().to(torch.bfloat16).reshape(N // 16, 16, G, 16, 2).permute(0, 2, 3, 1, 4)
        return P.reshape(N // 16, G, 16, 32).contiguous(), torch.ones(N // 16, G, 16)
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w.detach().to(torch.bfloat16).contiguous())
    except (RuntimeError, AttributeError):
        return None


def fused_bias(*linears) -> torch.Tensor | None:
    """The bias of linears whose weights are concatenated into one matmul (q/k/v, gate/up): theirs
    end to end, zeros for one without; None when none has one."""
    bs = [m.bias for m in linears]
    if all(b is None for b in bs):
        return None
    return torch.cat(
        [
            b.detach() if b is not None else torch.zeros(m.weight.shape[0], dtype=m.weight.dtype)
            for b, m in zip(bs, linears)
        ]
    )


def tile_applies(n: int, k: int) -> bool:
    """Can dspark's matmul tile (int4, Q8_0 and bf16 weights; AVX512-BF16 or AVX2 builds) hold an
    [n, k] weight (blocks of 16 output columns, groups of 32 inputs)?"""
    return n % 16 == 0 and k % 32 == 0 and kernels.tile_name() is not None


def _group_scales(d: torch.Tensor, lo: torch.Tensor | None, N: int, G: int) -> tuple[torch.Tensor, ...]:
    """Per-group scales (and minimums) [N, G] -> csrc/q4.h's [N/16, G, 16] `Scales`: fp16 where
    every value is an fp16 number (GGUF stores Q4_1's and Q8_0's so: the kernels widen them to the
    same fp32 values, and a 1-row int4 matmul streams a sixth fewer bytes), fp32 otherwise."""
    ts = [t.float() for t in (d, lo) if t is not None]
    dtype = torch.float16 if all(torch.equal(t.half().float(), t) for t in ts) else torch.float32
    return tuple(t.reshape(N // 16, 16, G).permute(0, 2, 1).to(dtype).contiguous() for t in ts)


def pack_q4(q: torch.Tensor, d: torch.Tensor, lo: torch.Tensor):
    """q [N, K] in 0..15, d / lo [N, K/32] (w = q * d + lo) -> (P, D, L) in the layout of the
    extension's build (csrc/q4_avx512.cpp's header: the AVX2 build reads 8-input octets; D, L:
    `_group_scales`). Packed weights are made where they run and never stored."""
    N, K = q.shape
    G = K // 32
    qi = q.to(torch.int32)
    if _octets():
        qb = qi.reshape(N // 16, 16, G, 4, 4, 2)  # [N/16, column, G, octet, nibble j, word i]: input 8o + 2j + i
        b0 = qb[..., 0, :] | (qb[..., 1, :] << 4)
        b1 = qb[..., 2, :] | (qb[..., 3, :] << 4)  # [N/16, column, G, octet, i]: a word's two bytes
        P = torch.stack([b0, b1], -1).permute(0, 2, 3, 1, 4, 5)  # [N/16, G, octet, column, i, byte]
    else:
        qb = qi.reshape(N // 16, 16, G, 8, 4).permute(0, 2, 3, 1, 4)  # [N/16, G, step, column, 4]
        P = torch.stack([qb[..., 0] | (qb[..., 2] << 4), qb[..., 1] | (qb[..., 3] << 4)], -1)
    return (P.reshape(N // 16, G, 8, 32).to(torch.uint8).contiguous(), *_group_scales(d, lo, N, G))


# the layouts each build's matmuls read, by `_build_key` (an ISA, with "-int8" where its int4 /
# Q8_0 matmuls take 8-bit activations and that changes the layout): int4 "steps" (q4_avx512.cpp's
# header) or "octets" (8-input octets, each column's dword in the order (0, 4, 1, 5) / (2, 6, 3, 7)),
# Q8_0 "pairs" (input pairs, 16 columns x 2 bytes) or "vnni" (4 inputs a column's dword, q + 128).
# A new build adds one row.
LAYOUTS = {
    "avx512": ("steps", "pairs"),
    "avx512-int8": ("octets", "vnni"),
    "avx2": ("octets", "pairs"),
    "avx2-int8": ("octets", "pairs"),
    "generic-int8": ("octets", "pairs"),
}


def _build_key() -> str:
    isa = kernels.extension_isa()
    if isa is None:
        raise DSparkError(f"weights are packed for dspark's kernels, and none runs here ({kernels.why_unavailable()})")
    return f"{isa}-int8" if kernels.q4_activations() == "int8" else isa


def _octets() -> bool:
    """Does this build's int4 tile read the octet layout (`pack_q4`, `LAYOUTS`)?"""
    return LAYOUTS[_build_key()][0] == "octets"


def q8_groups(w: torch.Tensor, group: int = 32):
    """Symmetric 8-bit quantisation per `group` inputs (the GGUF Q8_0 rule: d = max|w| / 127).
    w [N, K] -> (q [N, K] in -127..127, d [N, K/group]); a Q8_0 weight gets its exact values back."""
    N, K = w.shape
    g = w.float().reshape(N, K // group, group)
    d = g.abs().amax(-1) / 127
    q = (g / torch.where(d > 0, d, 1.0)[..., None]).round().clamp(-127, 127)
    return q.reshape(N, K).to(torch.int8), d


def pack_q8(q: torch.Tensor, d: torch.Tensor):
    """q [N, K] int8 values, d [N, K/32] (w = q * d, GGUF Q8_0) -> (P, D), csrc/q4_avx512.cpp's q8 layout,
    or on the AVX-512 build with 8-bit activations csrc/q4_avx512_vnni.cpp's (4 inputs a column's
    dword in the rows' byte order, q + 128: vpdpbusd's unsigned operand); D: `_group_scales`."""
    N, K = q.shape
    G = K // 32
    if LAYOUTS[_build_key()][1] == "vnni":
        order = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])  # each octet's inputs in the rows' byte order
        qo = q.to(torch.int16).reshape(N // 16, 16, G, 4, 8)[..., order] + 128  # [N/16, column, G, octet, 8]
        qs = qo.reshape(N // 16, 16, G, 8, 4).permute(0, 2, 3, 1, 4)  # [N/16, G, step, column, 4]
        return (
            qs.to(torch.uint8).view(torch.int8).reshape(N // 16, G, 16, 32).contiguous(),
            *_group_scales(d, None, N, G),
        )
    qb = q.to(torch.int8).reshape(N // 16, 16, G, 16, 2).permute(0, 2, 3, 1, 4)  # [N/16, G, pair, column, 2]
    return (qb.reshape(N // 16, G, 16, 32).contiguous(), *_group_scales(d, None, N, G))
