"""Markov heads (vanilla / gated / rnn) and the confidence head (docs/DESIGN.md §1).

Row k's logits are U_k + W2 @ f(W1[x_{k-1}], ...). Training walks a block with the true
previous tokens (teacher forcing, `block_bias`); decoding walks it one row at a time with
the tokens just sampled (`step`). Both share `_row`, so they cannot drift apart.
"""

from __future__ import annotations

import torch
from torch import nn


class MarkovHead(nn.Module):
    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int, hidden_size: int, head_type: str):
        super().__init__()
        self.head_type, self.rank = head_type, rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)
        if head_type == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif head_type == "rnn":
            # [gate; candidate; output] from [state; prev_emb; hidden]
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)
        elif head_type != "vanilla":
            raise ValueError(f"unknown markov_head_type {head_type!r}")

    def w2_transposed(self) -> torch.Tensor:
        """W2 transposed, [r, Vd] in its own dtype: the layout of the compiled greedy walk
        (ops.markov_walk); kept until the weight changes."""
        w = self.markov_w2.weight
        key = (w.data_ptr(), w._version)
        if getattr(self, "_w2t_key", None) != key:
            self._w2t, self._w2t_key = w.detach().t().contiguous(), key
        return self._w2t

    def init_state(self, n: int, like: torch.Tensor) -> torch.Tensor | None:
        return like.new_zeros(n, self.rank) if self.head_type == "rnn" else None

    def _row(self, emb, hidden, state):
        """One row: emb [N, r] (W1 of the previous token), hidden [N, H] -> (bias input [N, r], state)."""
        if self.head_type == "vanilla":
            return emb, state
        if self.head_type == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([hidden, emb], dim=-1))) * emb, state
        gate_raw, cand_raw, out_raw = self.joint_proj(torch.cat([state, emb, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate_raw)
        state = gate * state + (1.0 - gate) * torch.tanh(cand_raw)
        return torch.tanh(out_raw), state

    def step(self, prev_ids: torch.Tensor, hidden: torch.Tensor, state):
        """prev_ids [N], hidden [N, H] -> (bias [N, Vd], prev_emb [N, r], state)."""
        emb = self.markov_w1(prev_ids)
        z, state = self._row(emb, hidden.to(emb.dtype), state)
        return self.markov_w2(z), emb, state

    def block_bias(self, prev_ids: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced: prev_ids [N, S], hidden [N, S, H] -> (bias [N, S, Vd], prev_emb [N, S, r])."""
        emb = self.markov_w1(prev_ids)
        hidden = hidden.to(emb.dtype)
        if self.head_type != "rnn":  # rows are independent: one batched call
            z, _ = self._row(emb, hidden, None)
            return self.markov_w2(z), emb
        state, zs = self.init_state(emb.shape[0], emb), []
        for k in range(emb.shape[1]):
            z, state = self._row(emb[:, k], hidden[:, k], state)
            zs.append(z)
        return self.markov_w2(torch.stack(zs, dim=1)), emb


class ConfidenceHead(nn.Module):
    """c_k = sigmoid(proj([h_k ; W1[x_{k-1}]])): P(row k accepted | earlier rows accepted)."""

    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)  # logits
