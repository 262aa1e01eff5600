"""CPU matmul kernels chosen by measurement (docs/BENCHMARKS.md, "Target runtimes").

bf16 weights on a CPU run through oneDNN's prepacked linear instead of `F.linear`: measured on
Zen 4 (AVX512-BF16) 1.3-1.8x faster at 1-8 rows on SmolLM2's shapes, with the same numbers bit
for bit there. The target's native runtime and the draft (inference only) both use it.

Greedy choices (`argmax`) widen bf16 logits to fp32 first: exact (every bf16 value is an fp32
value, and ties still go to the first index), and torch's CPU argmax runs 3-4x faster on fp32
(measured on Zen 4, one thread: 214 -> 50 us over SmolLM2's 49 152 logits, 1.4 -> 0.44 ms for an
8-token verify, 61 -> 19 us over the draft's 16 384).
"""

from __future__ import annotations

import os

import torch

# DSPARK_PACK_BF16=0: plain F.linear everywhere (for comparisons)
PACK_BF16 = os.environ.get("DSPARK_PACK_BF16", "1") != "0"


def pack_bf16(w: torch.Tensor) -> torch.Tensor | None:
    """w [N, K] on a CPU -> oneDNN's prepacked bf16 weight; None where it does not apply (another
    device, packing turned off, a torch build without oneDNN)."""
    if not PACK_BF16 or w.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w.detach().to(torch.bfloat16).contiguous())
    except (RuntimeError, AttributeError):
        return None


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [..., K] bf16 @ packed.T (+ bias) -> [..., out_features]."""
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
    return y.reshape(*x.shape[:-1], out_features)


def argmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """x.argmax(dim), with half-precision logits widened to fp32 first (module docstring)."""
    if x.dtype in (torch.bfloat16, torch.float16) and x.device.type == "cpu":
        x = x.float()
    return x.argmax(dim)
