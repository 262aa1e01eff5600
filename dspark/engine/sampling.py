"""Logits -> probabilities, and the two acceptance rules (docs/DESIGN.md §2).

p (target) and q (draft) always go through the same `probs` with the same parameters:
rejection sampling is exact only when q is the distribution the draft token was drawn from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dspark.errors import RequestError
from dspark.ops import argmax, sample_accept

# The smallest temperature above 0 (vLLM's floor too): logits are divided by it, and below this
# they overflow to inf, the probabilities turn NaN and sampling fails.
MIN_TEMPERATURE = 1e-5
# Any top_p at or below 1 / vocabulary keeps the most likely token alone, so raising a smaller one
# to this changes nothing, while one below float32's range (1e-300) would read as 0 in `probs`'
# comparison and keep no token at all.
MIN_TOP_P = 1e-9


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # in addition to the tokenizer's EOS
    stop: tuple[str, ...] = ()  # stop strings (text is cut before them)
    ignore_eos: bool = False

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not (
            isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0
        ):
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise RequestError(
                f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {self.temperature!r}"
            )
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_p < MIN_TOP_P:
            object.__setattr__(self, "top_p", MIN_TOP_P)  # the same tokens kept (see MIN_TOP_P)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] after temperature, top-k (every entry below the
    k-th largest dropped), top-p (every entry whose mass strictly before it, in descending order,
    ties the lower index first, reaches top_p dropped) (fp32). csrc/sample.cpp shapes the same way."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)  # ties: lower index first
        sorted_p = sorted_logits.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p (the first always stays)
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def greedy_accept(target_logits: torch.Tensor, drafts: torch.Tensor, n: torch.Tensor):
    """target_logits [B, S, V] on [anchor, d_1..d_{S-1}], drafts [B, S-1], n [B] drafts verified.

    Returns (accepted [B], next_token [B]): the target's argmax after the last accepted draft.
    """
    if drafts.shape[1] == 0:  # a step without drafts (plain decoding): the target's token, nothing to compare
        return torch.zeros_like(n), argmax(target_logits[:, 0])
    return greedy_accept_ids(argmax(target_logits), drafts, n)


def greedy_accept_ids(best: torch.Tensor, drafts: torch.Tensor, n: torch.Tensor):
    """`greedy_accept` from the target's argmax alone: best [B, S] its token at each position.
    On plain ints: a few rows of a few tokens, read right after a forward evicted the caches,
    where each tensor op costs tens of microseconds."""
    rows, drafted, lengths = best.tolist(), drafts.tolist(), n.tolist()
    accepted, nxt = [], []
    for row, d, k in zip(rows, drafted, lengths):
        a = 0
        while a < k and row[a] == d[a]:
            a += 1
        accepted.append(a)
        nxt.append(row[a])
    return (
        torch.tensor(accepted, dtype=torch.long, device=best.device),
        torch.tensor(nxt, dtype=best.dtype, device=best.device),
    )


def rejection_accept(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, u: torch.Tensor) -> tuple[int, int]:
    """One request. p [n+1, V] target probs, q [n, V] draft probs, drafts [n], uniforms u [n+1].

    Accept d_i while u[i] < p/q; at the first rejection draw (by u[n]) from norm(max(p - q, 0));
    when all are accepted draw the bonus from p[n]. Returns (accepted, next_token).
    """
    n = drafts.shape[0]
    if n:
        idx = torch.arange(n, device=drafts.device)
        ratio = p[idx, drafts] / q[idx, drafts].clamp_min(1e-30)
        rejected = (u[:n].to(p.device) >= ratio).nonzero()
        if rejected.numel():
            i = int(rejected[0])
            residual = (p[i] - q[i]).clamp_min(0)
            mass = residual.sum()
            dist = residual / mass if mass > 0 else p[i]
            return i, draw(dist, float(u[n]))
    return n, draw(p[n], float(u[n]))


def speculative_sample(
    logits: torch.Tensor,
    params: SamplingParams,
    q: torch.Tensor | None,
    drafts: torch.Tensor,
    gen: torch.Generator | None,
) -> tuple[int, int]:
    """One sampled request's verification: logits [n+1, V] of the target on [anchor, drafts[:n]],
    q [n, V] the distributions the drafts were drawn from (None: n = 0, plain sampling) ->
    (accepted, next token), the target's distribution exactly (`rejection_accept`). The n+1
    uniforms come from the request's generator; on a CPU with dspark's kernels the shaping and the
    draws run in one call (csrc/sample.cpp: no sort of the whole vocabulary, no multinomial)."""
    n = drafts.shape[0]
    u = torch.rand(n + 1, generator=gen)
    out = sample_accept(logits, params.temperature, params.top_k, params.top_p, q, drafts, u)
    if out is not None:
        return out
    return rejection_accept(probs(logits, params), q if q is not None else logits[:0].float(), drafts, u)


def sample_token(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """Plain sampling of one token from logits [V]: a verification of no drafts (`speculative_sample`)."""
    return speculative_sample(logits[None], params, None, logits.new_zeros(0, dtype=torch.long), gen)[1]


def draw(prob: torch.Tensor, u: float) -> int:
    """The entry of prob [V] that the uniform u in [0, 1) draws: the first whose cumulative
    probability exceeds u (u at the top of the sum's rounding: the last entry with mass). The
    drafting phase's rule, in torch and in the compiled walk (csrc/markov.cpp `sample_slot`)."""
    cum = prob.double().cumsum(0)
    # cum rises only at entries with mass, so the first entry above u is one
    i = int(torch.searchsorted(cum, torch.tensor([u], dtype=torch.float64, device=cum.device), right=True))
    return i if i < prob.shape[0] else int((prob > 0).nonzero()[-1])
