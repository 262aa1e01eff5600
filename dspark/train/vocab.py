"""Reduced draft vocabulary: which target tokens the draft's head may propose.

The draft's LM head and Markov W2 are [Vd, .] instead of [V, .]; that is most of a training
step and of a draft pass on a small target. Tokens are ranked by how often the training answers
use them (what the draft must predict), then by how often the prompts do, then by id (BPE ids
grow with rarity). A token outside the set can still be the target's choice: the draft then
misses that slot, and the loss says so (its target mass counts fully in the L1 term).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from dspark.formats.convert import file_verifier, write_speculators
from dspark.formats.load import load_spec, load_weights, locate
from dspark.formats.spec import DraftSpec
from dspark.train.errors import TrainError


def token_counts(seqs, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """How often each target token occurs in the answers and in the prompts of `seqs` ([V] each)."""
    answer = torch.zeros(vocab_size, dtype=torch.float64)
    prompt = torch.zeros(vocab_size, dtype=torch.float64)
    for s in seqs:
        m = s.loss_mask.bool()
        answer += torch.bincount(s.ids[m], minlength=vocab_size).double()
        prompt += torch.bincount(s.ids[~m], minlength=vocab_size).double()
    return answer, prompt


def rank_tokens(ids: torch.Tensor, answer: torch.Tensor, prompt: torch.Tensor) -> torch.Tensor:
    """Positions into `ids` (target ids) from the most used token to the least: by answer count,
    then prompt count (both descending), then id (ascending)."""
    i = ids.numpy()
    return torch.from_numpy(np.lexsort((i, -prompt.numpy()[i], -answer.numpy()[i]))).long()


def select_draft_vocab(seqs, vocab_size: int, size: int) -> torch.Tensor:
    """[size] sorted target ids: the `size` tokens most used by the answers of `seqs`."""
    if not 1 <= size <= vocab_size:
        raise TrainError(f"draft vocabulary of {size} tokens for a target vocabulary of {vocab_size}")
    answer, prompt = token_counts(seqs, vocab_size)
    order = rank_tokens(torch.arange(vocab_size), answer, prompt)[:size]
    return order.sort().values


def d2t_offsets(ids: torch.Tensor) -> torch.Tensor:
    """speculators/EAGLE-3 convention: target id = draft id + d2t[draft id]."""
    return ids - torch.arange(ids.numel(), dtype=ids.dtype)


def t2d_mask(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[ids] = True
    return mask


@dataclass(frozen=True)
class Shrunk:
    """What `shrink_draft_vocab` wrote: the new draft's description and how much of the answers'
    tokens the draft vocabulary covered before and after."""

    spec: DraftSpec
    coverage_before: float
    coverage_after: float


def shrink_draft_vocab(src, dst, seqs, size: int, target_head: Callable[[], torch.Tensor] | None = None) -> Shrunk:
    """Write the draft at `src` to `dst` (speculators format) with only the `size` tokens of its
    vocabulary that the answers of `seqs` use most (`rank_tokens`). Nothing is retrained: the kept
    rows of its head and of its Markov head's W2 are copied, d2t/t2d are rewritten. The draft's
    states do not depend on its vocabulary, so a kept token is drafted exactly as before; a dropped
    one can no longer be. What it buys: the head over the draft vocabulary is most of a drafting
    phase's weights. target_head: reads the target's LM head [V, H], called only for a draft that
    borrows it (a draft over the whole target vocabulary may store no head of its own)."""
    spec = load_spec(src, check_values=False)
    if not 1 <= size < spec.draft_vocab_size:
        raise TrainError(
            f"--draft-vocab {size}: the draft's vocabulary has {spec.draft_vocab_size} tokens; "
            "choose fewer (and at least 1)"
        )
    dst = Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise TrainError(f"{dst} exists and is not an empty directory: refusing to overwrite")
    tensors = load_weights(spec)
    head = tensors.get("lm_head.weight")
    if head is None:
        if target_head is None:
            raise TrainError(f"{src} borrows the target's LM head: give the target (--target) to copy its rows from")
        borrowed = target_head()
        if tuple(borrowed.shape) != (spec.vocab_size, spec.hidden_size):
            raise TrainError(
                f"the target's LM head is {list(borrowed.shape)}, the draft needs "
                f"[{spec.vocab_size}, {spec.hidden_size}]: another target than the draft's"
            )
        head = borrowed.detach().to(tensors["norm.weight"].dtype)
    d2t = tensors.get("d2t")
    ids = torch.arange(spec.draft_vocab_size) if d2t is None else torch.arange(d2t.numel()) + d2t.long()
    answer, prompt = token_counts(seqs, spec.vocab_size)
    keep = rank_tokens(ids, answer, prompt)[:size].sort().values  # draft rows kept, in id order
    new_ids = ids[keep]
    tensors["lm_head.weight"] = head[keep].contiguous()
    if "lm_head.bias" in tensors:
        tensors["lm_head.bias"] = tensors["lm_head.bias"][keep].contiguous()
    if "markov_head.markov_w2.weight" in tensors:
        tensors["markov_head.markov_w2.weight"] = tensors["markov_head.markov_w2.weight"][keep].contiguous()
    dtype = torch.int64 if d2t is None else d2t.dtype
    tensors["d2t"] = d2t_offsets(new_ids).to(dtype)
    tensors["t2d"] = t2d_mask(new_ids, spec.vocab_size)
    verifier = file_verifier(spec, locate(src)[1])
    write_speculators(replace(spec, draft_vocab_size=size, has_d2t=True), tensors, dst, verifier=verifier)
    total = float(answer.sum()) or 1.0
    return Shrunk(
        load_spec(dst, check_values=False), float(answer[ids].sum()) / total, float(answer[new_ids].sum()) / total
    )
