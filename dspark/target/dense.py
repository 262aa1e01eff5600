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

from dspark import kernels

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


def part_names(i: int, name: str) -> list[str]:
    """The transformers names of decoder layer i's linears that FUSED matrix `name` stacks, in order."""
    block, names = PARTS[name]
    return [f"model.layers.{i}.{block}.{n}" for n in names]


def fused_weight(ck, i: int, name: str) -> torch.Tensor:
    """One of decoder layer i's FUSED matrices (checkpoint `ck`): q | k | v stacked, o, gate | up
    stacked, down."""
    ws = [ck.tensor(f"{n}.weight") for n in part_names(i, name)]
    return ws[0] if len(ws) == 1 else torch.cat(ws)


def fused_bias(ck, i: int, name: str) -> torch.Tensor | None:
    """The bias of `fused_weight(ck, i, name)` (None: none), its parts' end to end (zeros for a part
    without one)."""
    parts = part_names(i, name)
    if not any(ck.has(f"{n}.bias") for n in parts):
        return None
    return torch.cat(
        [ck.tensor(f"{n}.bias") if ck.has(f"{n}.bias") else torch.zeros(ck.shape(f"{n}.weight")[0]) for n in parts]
    )


def make(ck, num_layers: int, stack) -> list[tuple[torch.Tensor, ...]]:
    """Each of the `num_layers` decoder layers' FUSED matrices as dense bf16 [N, K] from checkpoint
    `ck`'s own weights, handed to the layer stack `stack` (None: none); an empty list, with a
    warning, where the copy would take more than DENSE_MEMORY_SHARE of the memory available."""
    shapes = [ck.shape(f"{n}.weight") for i in range(num_layers) for f in FUSED for n in part_names(i, f)]
    need = 2 * sum(s[0] * s[1] for s in shapes)
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
        out = [tuple(fused_weight(ck, i, n).to(torch.bfloat16).contiguous() for n in FUSED) for i in range(num_layers)]
    if stack is not None:
        stack.ext.layers_set_dense(stack.id, [w for ly in out for w in ly])
    return out
