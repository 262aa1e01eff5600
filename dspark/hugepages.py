"""Weights and caches in 2 MB pages: a decode step streams every weight once, and in 4 KB pages
that is tens of thousands of TLB misses a step (docs/history/benchmarks.md, "... huge pages, ...").
Where the OS gives no huge pages (or DSPARK_HUGE_PAGES=0), tensors are allocated as usual."""

from __future__ import annotations

import mmap

import torch

from dspark import envs

HUGE = 2 << 20  # a transparent huge page (x86-64)


def _huge_buffer(nbytes: int) -> torch.Tensor | None:
    """nbytes of zeros (uint8) in an anonymous mapping asked to be backed by 2 MB pages (madvise
    MADV_HUGEPAGE: Linux with transparent huge pages in `madvise` or `always` mode), starting on
    a huge page boundary; None where it cannot be had (the caller allocates as usual)."""
    if not (envs.huge_pages() and hasattr(mmap, "MADV_HUGEPAGE")):
        return None
    try:
        mm = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mm.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return None
    arena = torch.frombuffer(mm, dtype=torch.uint8)  # its views keep the mapping alive
    at = (-arena.data_ptr()) % HUGE
    return arena[at : at + nbytes]


def huge_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype) on the CPU, in 2 MB pages where the OS gives them (a KV cache
    that attention reads every step: fewer TLB misses on a long context, docs/history/benchmarks.md)."""
    n = 1
    for d in shape:
        n *= d
    buf = _huge_buffer(n * torch.empty(0, dtype=dtype).element_size()) if n else None
    return torch.zeros(shape, dtype=dtype) if buf is None else buf.view(dtype).view(shape)


def into_huge_pages(holders) -> int:
    """Move the weights held at obj.field (a tensor or a tuple of tensors; (obj, field) pairs) into
    one mapping in 2 MB pages (`_huge_buffer`), in place; -> the bytes moved (0 where it cannot:
    the tensors then stay as they are).

    A decode step streams every weight once (SmolLM2: ~114 MB); in 4 KB pages that is ~28 000
    TLB misses a step, and the matmuls stream measurably slower than in 2 MB pages
    (docs/history/benchmarks.md, "... huge pages, ..."). Only plain CPU tensors move (not oneDNN's packed ones)."""

    def held(obj, field):
        val = getattr(obj, field)
        return val if isinstance(val, tuple) else (val,)

    # each movable tensor once, however many holders share it
    tensors = {
        id(t): t
        for obj, field in holders
        for t in held(obj, field)
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided and t.numel() > 0
    }
    sizes = [-(-t.numel() * t.element_size() // 64) * 64 for t in tensors.values()]
    arena = _huge_buffer(sum(sizes)) if tensors else None
    if arena is None:
        return 0
    moved, at = {}, 0
    for (key, t), n in zip(tensors.items(), sizes):
        moved[key] = arena[at : at + t.numel() * t.element_size()].view(t.dtype).view(t.shape).copy_(t)
        at += n
    for obj, field in holders:
        val = getattr(obj, field)
        if isinstance(val, tuple):
            setattr(obj, field, tuple(moved.get(id(t), t) for t in val))
        elif id(val) in moved:
            setattr(obj, field, moved[id(val)])
    return sum(sizes)
