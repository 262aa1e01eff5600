"""Reduced draft vocabulary: which target tokens the draft's head may propose.

The draft's LM head and Markov W2 are [Vd, .] instead of [V, .]; that is most of a training
step and of a draft pass on a small target. Tokens are ranked by how often the training answers
use them (what the draft must predict), then by how often the prompts do, then by id (BPE ids
grow with rarity). A token outside the set can still be the target's choice: the draft then
misses that slot, and the loss says so (its target mass counts fully in the L1 term).
"""

from __future__ import annotations

import numpy as np
import torch

from dspark.train.errors import TrainError


def select_draft_vocab(seqs, vocab_size: int, size: int) -> torch.Tensor:
    """[size] sorted target ids: the `size` tokens most used by the answers of `seqs`."""
    if not 1 <= size <= vocab_size:
        raise TrainError(f"draft vocabulary of {size} tokens for a target vocabulary of {vocab_size}")
    answer = torch.zeros(vocab_size, dtype=torch.float64)
    prompt = torch.zeros(vocab_size, dtype=torch.float64)
    for s in seqs:
        m = s.loss_mask.bool()
        answer += torch.bincount(s.ids[m], minlength=vocab_size).double()
        prompt += torch.bincount(s.ids[~m], minlength=vocab_size).double()
    # rank by answer count, then prompt count (both descending), then id (ascending)
    order = np.lexsort((np.arange(vocab_size), -prompt.numpy(), -answer.numpy()))[:size]
    return torch.from_numpy(np.sort(order)).long()


def d2t_offsets(ids: torch.Tensor) -> torch.Tensor:
    """speculators/EAGLE-3 convention: target id = draft id + d2t[draft id]."""
    return ids - torch.arange(ids.numel(), dtype=ids.dtype)


def t2d_mask(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[ids] = True
    return mask
