"""Ragged appends on left-aligned, right-padded caches (`pack`: the HF target's cache; `merge_rows`:
it and the draft's context cache, whose appends write in place instead, model/draft.py).

Row b of a cache holds lengths[b] valid entries at [0, lengths[b]); the rest is padding that
every attention mask hides. Keeping counts[b] of the n entries appended after position
old_len is one gather per tensor; when every row is full and keeps the same count (always the
case at batch 1) it is a plain slice.
"""

from __future__ import annotations

import torch


def pack(x: torch.Tensor, lengths: torch.Tensor, old_len: int, counts: torch.Tensor) -> torch.Tensor:
    """x [B, heads, old_len + n, D] = [old entries | appended] -> [B, heads, max(lengths+counts), D]."""
    if bool((lengths == old_len).all()) and bool((counts == counts[0]).all()):
        return x[:, :, : old_len + int(counts[0])]
    idx = pack_index(lengths, old_len, counts)
    B, h, _, D = x.shape
    return x.gather(2, idx[:, None, :, None].expand(B, h, idx.shape[1], D))


def pack_index(lengths: torch.Tensor, old_len: int, counts: torch.Tensor) -> torch.Tensor:
    """Index into the time axis that packs each row's valid entries left; padding points at 0."""
    new_lengths = lengths + counts
    j = torch.arange(int(new_lengths.max()), device=lengths.device).unsqueeze(0)  # [1, T_new]
    length = lengths.unsqueeze(1)
    idx = torch.where(j < length, j, old_len + (j - length))
    return torch.where(j < new_lengths.unsqueeze(1), idx, torch.zeros_like(idx))


def merge_rows(xs: list[torch.Tensor]) -> torch.Tensor:
    """[b_i, heads, T_i, D] tensors -> one [sum b_i, heads, max T_i, D], right-padded."""
    T = max(x.shape[2] for x in xs)
    return torch.cat([torch.nn.functional.pad(x, (0, 0, 0, T - x.shape[2])) for x in xs])
