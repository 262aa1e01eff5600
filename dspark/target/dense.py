"""A long prefill's matmuls on AMX: dense bf16 copies of a NativeTarget's layer weights.

On CPUs with AMX-BF16, torch's bf16 matmul (oneDNN's tiles) runs a prompt's many rows several times
faster than dspark's packed int4 / Q8_0 tiles, which are built for the few rows of a decode step
(docs/BENCHMARKS.md). So a prefill of PREFILL_MM_ROWS+ rows runs each layer's four matrices on a
dense bf16 copy of the model's own weights, made once at the first such prompt and handed to the
extension's layer stack (csrc/layers.cpp `layers_set_dense`). The copy holds the model's values
rounded to bf16, as transformers' bf16 model holds them (a Q4_1 value needs more than bf16's 8
bits): a prompt's numbers, which no verification compares with a decode step's (docs/DESIGN.md).
It costs 2 bytes a weight of memory, so it is made only where that is at most DENSE_MEMORY_SHARE
of the memory available; refused, it is said once and prompts keep the packed tiles.
"""

from __future__ import annotations

import logging

import torch

from dspark import kernels, packing

log = logging.getLogger("dspark")

# a decoder layer's matrices as NativeTarget packs them (and the layer stack holds them), in that
# order: each the linears of one of the layer's blocks, stacked
PARTS = {
    "wqkv": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "wo": ("self_attn", ("o_proj",)),
    "w13": ("mlp", ("gate_proj", "up_proj")),
    "w2": ("mlp", ("down_proj",)),
}
FUSED = tuple(PARTS)
# a prefill of this many rows (batch x positions) runs its matmuls on the dense copies (csrc/dspark.h)
PREFILL_MM_ROWS = 64
DENSE_MEMORY_SHARE = 0.25


def dense_prefill() -> bool:
    """Does a long prefill run on dense bf16 copies here: the AVX-512 build on a CPU with AMX-BF16,
    its tiles not switched off (`kernels.amx_tiles`)."""
    return kernels.amx_tiles()


def available_memory() -> int | None:
    """Bytes of memory the OS says are available (/proc/meminfo MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def fused_parts(layer, name: str) -> list[torch.nn.Linear]:
    """The linears of an HF decoder layer that FUSED matrix `name` stacks, in order."""
    block, names = PARTS[name]
    sub = getattr(layer, block)
    return [getattr(sub, n) for n in names]


def fused_weight(layer, name: str) -> torch.Tensor:
    """One of an HF decoder layer's FUSED matrices: q | k | v stacked, o, gate | up stacked, down."""
    parts = fused_parts(layer, name)
    return parts[0].weight if len(parts) == 1 else torch.cat([p.weight for p in parts])


def fused_bias(layer, name: str) -> torch.Tensor | None:
    """The bias of `fused_weight(layer, name)` (None: none), its parts' end to end."""
    parts = fused_parts(layer, name)
    return parts[0].bias if len(parts) == 1 else packing.fused_bias(*parts)


def make(model, stack) -> list[tuple[torch.Tensor, ...]]:
    """Each decoder layer's FUSED matrices as dense bf16 [N, K] from `model`'s own weights, handed to
    the layer stack `stack` (None: none); an empty list, with a warning, where the copy would take
    more than DENSE_MEMORY_SHARE of the memory available."""
    layers = model.model.layers
    need = 2 * sum(w.numel() for ly in layers for w in ly.parameters() if w.dim() == 2)
    avail = available_memory()
    if avail is not None and need > DENSE_MEMORY_SHARE * avail:
        log.warning(
            "prefill keeps dspark's packed matmuls: a bf16 copy of the layers (%.1f GiB) would take more "
            "than %d%% of the memory available (%.1f GiB)",
            need / 2**30,
            round(100 * DENSE_MEMORY_SHARE),
            avail / 2**30,
        )
        return []
    with torch.no_grad():
        out = [tuple(fused_weight(ly, n).detach().to(torch.bfloat16).contiguous() for n in FUSED) for ly in layers]
    if stack is not None:
        stack.ext.layers_set_dense(stack.id, [w for ly in out for w in ly])
    return out
