"""Training a draft against the numbers the engine runs it in (`dspark train fit --quant-aware q4`).

The engine's default draft format (`--draft-weights auto`) holds the draft's matrices (fc and each
layer's projections) in Q4_1, rounded from the file's bf16 values when the draft loads; that
rounding costs a draft trained in float 0.01-0.03 of mean acceptance length (docs/TRAINING.md). A
quant-aware fit computes each of those matrices' forward with the values the engine will hold
(`fast.q4_1_values` of the weight as the export writes it: bf16, fc with the tap scale folded in)
and passes the gradient straight through to the float weights, which stay what the optimizer
updates and the export writes. The head, the Markov and confidence heads keep their numbers (the
engine runs the head in Q8_0, near exact, and the small heads in bf16)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspark.model import fast
from dspark.train.config import QUANT_AWARE
from dspark.train.features import fold_tap_scale


def _straight_through(w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """w's forward as the engine's Q4_1 matrix (scale: the tap scale fc is trained with; the file's
    fc is w / scale), its gradient w's own."""
    with torch.no_grad():
        file = (w if scale is None else fold_tap_scale(w, scale)).to(torch.bfloat16)
        held = fast.q4_1_values(file)
        if scale is not None:
            held = held * scale[None, :]
    return held.to(w.dtype) + (w - w.detach())  # exactly the held values; d/dw = 1


def _linear_forward(linear: nn.Linear, scale: torch.Tensor | None):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, _straight_through(linear.weight, scale), linear.bias)

    return forward


def matrices(draft) -> list[nn.Linear]:
    """The draft's linears the engine holds in Q4_1: fc, and each layer's q/k/v/o and MLP."""
    out = [draft.fc]
    for layer in draft.layers:
        a, m = layer.self_attn, layer.mlp
        out += [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]
    return out


def make_quant_aware(draft, fmt: str, tap_scale: torch.Tensor | None = None) -> int:
    """Route the forward of the draft's Q4_1 matrices through their Q4_1 values (fmt "q4"); "none"
    leaves them. -> how many matrices. The weights, the state dict and the export are unchanged."""
    if fmt not in QUANT_AWARE:
        raise ValueError(f"quant-aware format must be one of {', '.join(QUANT_AWARE)}, got {fmt!r}")
    if fmt == "none":
        return 0
    lins = matrices(draft)
    for lin in lins:
        if lin.in_features % 32:
            raise ValueError(f"a Q4_1 matrix needs inputs in groups of 32, this one has {lin.in_features}")
        scale = tap_scale.to(lin.weight.device).float() if lin is draft.fc and tap_scale is not None else None
        lin.forward = _linear_forward(lin, scale)  # type: ignore[method-assign]
    return len(lins)
