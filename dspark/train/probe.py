"""The probe: what a draft's first slot could reach from the information it is given.

In the anchor-first layout the first slot predicts the token at position a+1 from the target's
hidden states of positions <= a-1 and the anchor token a itself (the target has not run on the
anchor yet). The probe trains a small network on exactly that input - chosen hidden states at
a-1 (`final`: the post-norm last state, `tap:N`: the input of layer N) and, with `embed`, the
target's embedding of the anchor - read out by the target's own frozen LM head, and reports how
often its choice is the data's next token on held-out answers (the target's greedy answers: so
the first-slot greedy acceptance a draft with that input could reach at this training budget).
Beside it, on the same anchors: a bigram of the training answers and a draft's own first slot.
Minutes on a CPU against hours for a draft: the cheap way to know what an input is worth.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from dspark.train.dataset import Sequence
from dspark.train.errors import TrainError


@dataclass
class ProbeSettings:
    inputs: tuple[str, ...] = ("final", "embed")
    pairs: int = 100_000  # training anchors (answer positions), from whole sequences drawn with the seed
    heldout_anchors: int | None = None  # None: every answer anchor of the held-out set
    width: int = 1024
    batch: int = 512
    lr: float = 1e-3
    steps: int | None = None  # None: five passes over the pairs (or the time budget)
    time_budget: float | None = None
    seed: int = 0

    def check(self, num_layers: int) -> None:
        if not self.inputs:
            raise TrainError("--inputs: give at least one of final, embed, tap:N")
        for name in self.inputs:
            if name in ("final", "embed"):
                continue
            kind, _, n = name.partition(":")
            if kind != "tap" or not n.isdigit() or not 0 <= int(n) <= num_layers:
                raise TrainError(f"--inputs {name!r}: each input is final, embed or tap:N with N in 0..{num_layers}")
        if self.inputs == ("embed",):
            raise TrainError("--inputs embed alone is a bigram: add final or a tap:N")
        for k in ("pairs", "width", "batch"):
            if getattr(self, k) < 1:
                raise TrainError(f"--{k} must be >= 1, got {getattr(self, k)}")

    def taps(self) -> tuple[int, ...]:
        return tuple(int(n.partition(":")[2]) for n in self.inputs if n.startswith("tap:"))


@dataclass
class Pairs:
    states: torch.Tensor  # [N, S] bf16: the chosen hidden states at a-1, side by side
    anchors: torch.Tensor  # [N] the anchor token a
    labels: torch.Tensor  # [N] the token at a+1
    where: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 2, dtype=torch.long))  # [N, 2] (sequence, a)
    keys: list[str] = field(default_factory=list)  # the sequences they come from


def answer_anchors(seq: Sequence) -> torch.Tensor:
    """Anchor positions a of an answer: a-1 >= 0, a and a+1 answer tokens."""
    m = seq.loss_mask.bool()
    a = torch.arange(1, len(seq.ids) - 1)
    return a[m[a] & m[a + 1]]


def draw_sequences(seqs: list[Sequence], pairs: int, seed: int) -> list[int]:
    """Sequences in a seeded order until they hold `pairs` anchors (all of their anchors are used:
    whole sequences keep the target's feature pass to the sequences drawn)."""
    order = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(seed)).tolist()
    chosen, total = [], 0
    for i in order:
        if total >= pairs:
            break
        n = len(answer_anchors(seqs[i]))
        if n:
            chosen.append(i)
            total += n
    return chosen


def collect(features, seqs: list[Sequence], indices: list[int], inputs: tuple[str, ...], taps: tuple[int, ...],
            hidden: int, limit: int | None = None, seed: int = 0, progress: bool = False) -> Pairs:
    """The probe's pairs of the sequences `indices` (features.get -> (taps [L, n*H], final [L, H]))."""
    states, anchors, labels, where, keys = [], [], [], [], []
    for i in tqdm(indices, desc="probe features", unit="seq", disable=not progress):
        t, fin = features.get([i])[0]
        a = answer_anchors(seqs[i])
        cols = []
        for name in inputs:
            if name == "final":
                cols.append(fin[a - 1])
            elif name.startswith("tap:"):
                j = taps.index(int(name[4:]))
                cols.append(t[a - 1, j * hidden : (j + 1) * hidden])
        states.append(torch.cat(cols, -1).to(torch.bfloat16) if cols else torch.zeros(len(a), 0, dtype=torch.bfloat16))
        anchors.append(seqs[i].ids[a])
        labels.append(seqs[i].ids[a + 1])
        where.append(torch.stack([torch.full_like(a, i), a], 1))
        keys.append(seqs[i].key)
    p = Pairs(torch.cat(states), torch.cat(anchors), torch.cat(labels), torch.cat(where), keys)
    if limit is not None and limit < len(p.labels):
        pick = torch.randperm(len(p.labels), generator=torch.Generator().manual_seed(seed))[:limit]
        p = Pairs(p.states[pick], p.anchors[pick], p.labels[pick], p.where[pick], keys)
    return p


class Probe(nn.Module):
    """[states ; embed(anchor)] -> 2-layer MLP -> RMS norm -> the target's frozen LM head."""

    def __init__(self, in_states: int, embed: torch.Tensor | None, head: torch.Tensor, width: int):
        super().__init__()
        H = head.shape[1]
        self.embed = None if embed is None else embed.detach().float()
        d_in = in_states + (0 if embed is None else embed.shape[1])
        self.mlp = nn.Sequential(nn.Linear(d_in, width), nn.SiLU(), nn.Linear(width, H))
        self.norm = nn.RMSNorm(H)
        self.head = head.detach().float()

    def forward(self, states: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        x = states.float()
        if self.embed is not None:
            x = torch.cat([x, self.embed[anchors]], -1)
        return self.norm(self.mlp(x)) @ self.head.T


@torch.no_grad()
def agreement(probe: Probe, p: Pairs, batch: int = 2048) -> tuple[float, float]:
    """(share of pairs whose argmax is the label, mean cross-entropy)."""
    hits, loss = 0, 0.0
    for s in range(0, len(p.labels), batch):
        logits = probe(p.states[s : s + batch], p.anchors[s : s + batch])
        y = p.labels[s : s + batch]
        hits += int((logits.argmax(-1) == y).sum())
        loss += float(F.cross_entropy(logits, y, reduction="sum"))
    n = max(len(p.labels), 1)
    return hits / n, loss / n


def fit(probe: Probe, train: Pairs, held: Pairs, cfg: ProbeSettings, progress: bool = False) -> list[dict]:
    """AdamW with a cosine decay over the planned steps; a held-out point every tenth of them."""
    gen = torch.Generator().manual_seed(cfg.seed)
    steps = cfg.steps or max(1, math.ceil(5 * len(train.labels) / cfg.batch))
    params = [p for p in probe.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    curve, t0, every = [], time.perf_counter(), max(1, steps // 10)
    for step in tqdm(range(1, steps + 1), desc="probe fit", unit="step", disable=not progress):
        idx = torch.randint(0, len(train.labels), (cfg.batch,), generator=gen)
        loss = F.cross_entropy(probe(train.states[idx], train.anchors[idx]), train.labels[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        out_of_time = cfg.time_budget is not None and time.perf_counter() - t0 > cfg.time_budget
        if step % every == 0 or step == steps or out_of_time:
            acc, held_loss = agreement(probe, held)
            curve.append({"step": step, "train_loss": loss.item(), "heldout_loss": held_loss, "heldout_top1": acc,
                          "seconds": time.perf_counter() - t0})
        if out_of_time:
            break
    return curve


def bigram(seqs: list[Sequence], indices: list[int], held: Pairs, vocab: int) -> float:
    """Share of held-out pairs whose label is the most frequent next token after the anchor in the
    training answers `indices` (ties: the smallest id; an unseen anchor never agrees)."""
    flat_a, flat_b = [], []
    for i in indices:
        a = answer_anchors(seqs[i])
        flat_a.append(seqs[i].ids[a])
        flat_b.append(seqs[i].ids[a + 1])
    a, b = torch.cat(flat_a), torch.cat(flat_b)
    key = a * vocab + b
    uniq, n = key.unique(return_counts=True)
    best = torch.full((vocab,), -1, dtype=torch.long)
    order = torch.argsort(n, descending=True, stable=True)  # most frequent first, smaller key on ties
    for k in uniq[order].tolist():
        if best[k // vocab] < 0:
            best[k // vocab] = k % vocab
    return float((best[held.anchors] == held.labels).float().mean()) if len(held.labels) else 0.0


@torch.inference_mode()
def draft_first_slot(draft, target, seqs: list[Sequence], held: Pairs) -> float:
    """A draft's own first-slot greedy agreement on the held-out pairs' anchors (its taps from the
    target, its context the committed positions before each anchor; the engine's propose)."""
    from dspark.engine.sampling import SamplingParams
    from dspark.engine.step import Batch, propose

    target.set_taps(draft.spec.hidden_state_indices)
    hits = total = 0
    by_seq: dict[int, list[int]] = {}
    for i, a in held.where.tolist():
        by_seq.setdefault(i, []).append(a)
    for i, positions in by_seq.items():
        seq = seqs[i]
        _, taps = target.forward(target.new_state(1), seq.ids[None, :], None, logits="final")
        for a in positions:
            ctx = draft.new_context_cache(1, "cpu")
            batch = Batch(None, ctx, seq.ids[a : a + 1].clone(), [SamplingParams()], [None], [taps[:, :a]])
            hits += int(propose(draft, batch, 1).tokens[0, 0] == seq.ids[a + 1])
            total += 1
    return hits / max(total, 1)


def settings_json(cfg: ProbeSettings) -> dict:
    d = asdict(cfg)
    d["inputs"] = list(cfg.inputs)
    return d
