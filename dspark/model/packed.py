"""The draft's linears through oneDNN's prepacked bf16 weights, for decoding on a CPU.

A drafting step is a handful of small matmuls (one layer, the draft head over its vocabulary,
the Markov head once per slot); on SmolLM2 it cost about half a target step. `pack_linears`
turns every bf16 `nn.Linear` of a draft on a CPU into a `PackedLinear` in place: the same
module, parameters and state dict, whose forward uses the packed copy (dspark/packing.py, dspark/ops.py)
whenever no gradient is wanted. Training (grad enabled) runs the plain `nn.Linear` forward,
and a weight changed in place is repacked before its next use.
"""

from __future__ import annotations

import torch
from torch import nn

from dspark import ops, packing


class PackedLinear(nn.Linear):
    _packed: torch.Tensor | None = None
    _packed_version: int = -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (torch.is_grad_enabled() and self.weight.requires_grad) or x.dtype != torch.bfloat16:
            return super().forward(x)
        if self._packed_version != self.weight._version:
            self._packed, self._packed_version = packing.pack_bf16(self.weight), self.weight._version
        if self._packed is None:
            return super().forward(x)
        return ops.packed_linear(x, self._packed, self.bias, self.out_features)


def pack_linears(module: nn.Module) -> int:
    """Every bf16 nn.Linear of `module` on a CPU becomes a PackedLinear (in place); returns how many."""
    n = 0
    for m in module.modules():
        if type(m) is nn.Linear and m.weight.dtype == torch.bfloat16 and m.weight.device.type == "cpu":
            m.__class__ = PackedLinear
            n += 1
    return n
