"""The CPU ops the runtimes call on packed weights and activations: dspark's extension where it is
built (`kernels`), torch's ops elsewhere.

Greedy choices (`argmax`) widen bf16 logits to fp32 first: exact (every bf16 value is an fp32
value, and ties still go to the first index), and torch's CPU argmax runs several times faster on
fp32. The AVX-512 build's own argmax (two vector passes: the maximum, then its first index; the
first NaN where there is one, as torch) is faster still and reads bf16 logits as they are (a greedy
plain step's head output, argmax'd in the layer stack's own call: docs/history/benchmarks.md "a
greedy plain step in one call").
"""

from __future__ import annotations

import torch

from dspark import kernels

# "no tensor" for the extension's optional arguments (rope_cache_bf16's values inside qk,
# add_rms_bf16's taps): pybind passes no None to a Tensor argument
NO_TENSOR = torch.empty(0, dtype=torch.bfloat16)


def packed_linear(x: torch.Tensor, packed, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [..., K] bf16 @ packed.T (+ bias) -> [..., out_features]."""
    if isinstance(packed, tuple):  # dspark's tile takes x's own shape
        y = kernels.extension().bf16_mm(x, *packed)
        return y if bias is None else y + bias
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
    return y.reshape(*x.shape[:-1], out_features)


def silu_mul(gu: torch.Tensor, ext) -> torch.Tensor:
    """silu(gate) * up of a fused gate/up projection's output [..., 2I] (gate | up): one call of
    the extension `ext` where it is given and the width tiles (csrc/attn.cpp `silu_mul_bf16`,
    torch's rounding steps), torch's ops otherwise."""
    if ext is not None and gu.shape[-1] % 32 == 0:
        return ext.silu_mul_bf16(gu)
    g, u = gu.chunk(2, -1)
    return torch.nn.functional.silu(g) * u


def argmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """x.argmax(dim), with half-precision logits compared as their fp32 values (module docstring);
    over the last dimension of fp32 or bf16 on dspark's AVX-512 build (csrc/markov.cpp
    `argmax_last`: torch's choice in vector passes, bf16 widened in place), elsewhere torch's."""
    if (
        dim in (-1, x.dim() - 1)
        and x.dim() >= 1
        and x.dtype in (torch.float32, torch.bfloat16)
        and x.device.type == "cpu"
        and x.shape[-1] > 0
        and kernels.extension_isa() == "avx512"
    ):
        return kernels.extension().argmax_last(x)
    if x.dtype in (torch.bfloat16, torch.float16) and x.device.type == "cpu":
        x = x.float()
    return x.argmax(dim)


def q4_linear(x: torch.Tensor, packed) -> torch.Tensor:
    """x [..., K] bf16 @ W.T -> [..., N] bf16, W packed by `pack_q4`."""
    return kernels.extension().q4_mm(x, *packed)


def q8_linear(x: torch.Tensor, packed) -> torch.Tensor:
    """x [..., K] bf16 @ W.T -> [..., N] bf16, W packed by `pack_q8`."""
    return kernels.extension().q8_mm(x, *packed)


def markov_walk(
    base: torch.Tensor, w1: torch.Tensor, w2t: torch.Tensor, d2t: torch.Tensor | None, anchors: torch.Tensor
) -> torch.Tensor | None:
    """The vanilla Markov head's greedy walk in one call (csrc/markov.cpp): base [B, g, Vd] draft-head
    logits, w1 [V, r], w2t [r, Vd] (W2 transposed), all bf16 or all fp32, d2t [Vd] or None, anchors
    [B] -> target ids [B, g]; None where the extension does not run (a CPU without it, another
    device or dtype): the caller walks in torch."""
    if base.device.type != "cpu" or {base.dtype, w1.dtype, w2t.dtype} not in ({torch.bfloat16}, {torch.float32}):
        return None
    ext = kernels.extension()
    if ext is None:
        return None
    return ext.markov_walk(base, w1, w2t, torch.zeros(0, dtype=torch.long) if d2t is None else d2t, anchors)


def sample_accept(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    q: torch.Tensor | None,
    drafts: torch.Tensor,
    u: torch.Tensor,
) -> tuple[int, int] | None:
    """One request's speculative sampling in one call (csrc/sample.cpp `sample_accept`): logits
    [n+1, V], q [n, V] fp32 (None: n = 0), drafts [n], uniforms u [n+1] -> (accepted, token); None
    where the extension does not run (another device, a CPU without it): the caller runs torch."""
    if logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.bfloat16):
        return None
    ext = kernels.extension()
    if ext is None:
        return None
    out = ext.sample_accept(
        logits,
        float(temperature),
        int(top_k),
        float(top_p),
        q.float() if q is not None else _NO_Q,
        drafts.cpu(),
        u.float(),
    )
    return int(out[0]), int(out[1])


_NO_Q = torch.zeros(0, dtype=torch.float32)
