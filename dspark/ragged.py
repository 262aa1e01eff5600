"""Ragged appends on left-aligned, right-padded caches (shared by the target and draft caches).

Row b of a cache holds lengths[b] valid entries at [0, lengths[b]); the rest is padding that
every attention mask hides. Appending counts[b] of n new entries per row is one gather.
"""

from __future__ import annotations

import torch


def append_index(lengths: torch.Tensor, old_len: int, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Index into cat([old (old_len), new], dim=T) that packs each row's valid entries left.

    lengths, counts: [B] long. Returns (idx [B, T_new], new_lengths [B]); padded slots point at 0.
    """
    new_lengths = lengths + counts
    t_new = int(new_lengths.max().item()) if new_lengths.numel() else 0
    j = torch.arange(t_new, device=lengths.device).unsqueeze(0)  # [1, T_new]
    length = lengths.unsqueeze(1)
    idx = torch.where(j < length, j, old_len + (j - length))
    idx = torch.where(j < new_lengths.unsqueeze(1), idx, torch.zeros_like(idx))
    return idx, new_lengths


def gather_time(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D], idx [B, T'] -> [B, heads, T', D]."""
    B, h, _, D = x.shape
    return x.gather(2, idx[:, None, :, None].expand(B, h, idx.shape[1], D))


def merge_rows(xs: list[torch.Tensor]) -> torch.Tensor:
    """[b_i, heads, T_i, D] tensors -> one [sum b_i, heads, max T_i, D], right-padded."""
    T = max(x.shape[2] for x in xs)
    return torch.cat([torch.nn.functional.pad(x, (0, 0, 0, T - x.shape[2])) for x in xs])
