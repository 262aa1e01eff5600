"""The probe: what a draft's first slot could reach from the information it is given.

At a decoding step of the anchor-first layout the anchor a is the token committed last, not yet
run through the target. The draft's first slot must name the token at a+1 from the target's
hidden states of the positions <= a-1 and the anchor token itself: nothing else exists yet. The
probe trains a small network on exactly that input and nothing more,

    [hidden states at a-1 ; the target's embedding of a] -> Linear -> SiLU -> Linear -> RMS norm
    -> the target's own frozen LM head (full vocabulary),

with cross-entropy on the data's token at a+1, and reports how often its argmax is that token on
held-out answers it never trained on. Held-out answers are the target's greedy answers, so this
is the first-slot greedy acceptance a draft given that input could reach (at the probe's
training budget: a lower bound on what the input allows, an estimate once its curve is flat).
The inputs: `final` (the post-norm last hidden state at a-1), `tap:N` (the input of decoder
layer N at a-1, HF hidden_states[N]; N = the layer count is the last layer's output before the
final norm) and `embed` (the target's input embedding of the anchor).

Why: a draft costs hours of CPU to train and its first slot mixes what its inputs carry with how
well it was trained. The probe answers the first question alone in minutes, beside two figures
on the same held-out anchors for scale: a bigram of the training answers (the most frequent
next token after the anchor) and a draft's own first slot (`engine.drafting.teacher_forced`, the
block `propose` runs, read on the same bf16 taps).

Only the answers the training anchors come from are run through the target (whole answers drawn
with the seed, every anchor of each: the target's pass costs per answer, not per anchor), and
only the rows the probe reads are kept (bf16). Training answers to a held-out prompt are
dropped before anything is drawn.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from dspark.train.dataset import Sequence
from dspark.train.errors import TrainError


def parse_inputs(text: str) -> tuple[str, ...]:
    """'final,tap:28,embed' -> ('final', 'tap:28', 'embed'); a bad name is a TrainError naming it."""
    names = tuple(x.strip() for x in str(text).split(","))
    if any(not n for n in names):
        raise TrainError(f"--inputs {text!r}: a comma list of final, embed, tap:N (an empty name in it)")
    for n in names:
        kind, colon, num = n.partition(":")
        if n not in ("final", "embed") and not (kind == "tap" and colon and num.isdigit()):
            raise TrainError(f"--inputs {n!r}: each input is final, embed or tap:N (N a layer index)")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise TrainError(f"--inputs {text!r}: {', '.join(dup)} given twice")
    return names


@dataclass
class ProbeSettings:
    inputs: tuple[str, ...] = ("final", "embed")
    pairs: int = 100_000  # training anchors, from whole answers drawn with the seed
    heldout_anchors: int | None = None  # None: every answer anchor of the held-out set
    width: int = 1024
    batch: int = 512
    lr: float = 1e-3
    weight_decay: float = 0.01
    steps: int | None = None  # None: the time budget, or five passes over the pairs without one
    time_budget: float | None = None  # seconds of optimization (the curve points' evaluations not counted)
    seed: int = 0
    curve_points: int = 10
    curve_anchors: int = 2048  # held-out (and training) anchors a curve point reads; the figure reads all

    def check(self, num_layers: int | None = None) -> None:
        """TrainError on a bad setting; the taps' range too once the target's layer count is known."""
        parse_inputs(",".join(self.inputs))
        if num_layers is not None:
            for n in self.taps():
                if not 0 <= n <= num_layers:
                    raise TrainError(
                        f"--inputs 'tap:{n}': N must be in 0..{num_layers} for this {num_layers}-layer "
                        f"target ({num_layers}: the last layer's output before the final norm)"
                    )
        for k in ("pairs", "width", "batch", "curve_points", "curve_anchors"):
            if getattr(self, k) < 1:
                raise TrainError(f"--{k.replace('_', '-')} must be >= 1, got {getattr(self, k)}")
        for k in ("heldout_anchors", "steps"):
            if getattr(self, k) is not None and getattr(self, k) < 1:
                raise TrainError(f"--{k.replace('_', '-')} must be >= 1, got {getattr(self, k)}")
        if self.time_budget is not None and not self.time_budget > 0:
            raise TrainError(f"--time-budget must be > 0 seconds, got {self.time_budget}")
        if not self.lr > 0 or self.weight_decay < 0:
            raise TrainError(f"--lr must be > 0 and the weight decay >= 0, got {self.lr}, {self.weight_decay}")

    def taps(self) -> tuple[int, ...]:
        return tuple(int(n[4:]) for n in self.inputs if n.startswith("tap:"))

    def to_json(self) -> dict:
        d = asdict(self)
        d["inputs"] = list(self.inputs)
        return d


@dataclass
class Pairs:
    states: torch.Tensor  # [N, S] bf16: the chosen hidden states at a-1, side by side (S = 0: embed only)
    anchors: torch.Tensor  # [N] the anchor token a
    labels: torch.Tensor  # [N] the data's token at a+1
    where: torch.Tensor  # [N, 2] (sequence index, a)

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def take(self, idx: torch.Tensor) -> Pairs:
        return Pairs(self.states[idx], self.anchors[idx], self.labels[idx], self.where[idx])

    def sample(self, n: int | None, seed: int) -> Pairs:
        """A seeded subset of n pairs (all of them when n is None or >= their count), kept in order."""
        if n is None or n >= len(self):
            return self
        pick = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed))[:n].sort().values
        return self.take(pick)


def answer_anchors(seq: Sequence) -> torch.Tensor:
    """Anchor positions a of an answer: a-1 exists, a and a+1 are answer tokens."""
    m = seq.loss_mask.bool()
    a = torch.arange(1, len(seq.ids) - 1)
    return a[m[a] & m[a + 1]]


def _prompt_signature(seq: Sequence) -> tuple:
    answer = seq.loss_mask.nonzero()
    p = int(answer[0]) if answer.numel() else len(seq.ids)
    return tuple(seq.ids[:p].tolist()) if p else ("whole",) + tuple(seq.ids.tolist())


def without_heldout(train: list[Sequence], held: list[Sequence]) -> tuple[list[Sequence], int]:
    """The training sequences that do not answer a held-out prompt (the same prompt tokens; for a
    sequence without a prompt, the same tokens), and how many were dropped."""
    banned = {_prompt_signature(s) for s in held}
    kept = [s for s in train if _prompt_signature(s) not in banned]
    return kept, len(train) - len(kept)


def draw_sequences(seqs: list[Sequence], pairs: int, seed: int) -> list[int]:
    """Sequences in a seeded order until they hold `pairs` anchors (every anchor of a drawn answer is
    used: whole answers keep the target's feature pass to the answers drawn)."""
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


def collect(
    features,
    seqs: list[Sequence],
    indices: list[int],
    inputs: tuple[str, ...],
    taps: tuple[int, ...],
    hidden: int,
    progress: bool = False,
    desc: str = "probe features",
) -> Pairs:
    """The pairs of the sequences `indices`, one target pass each (`features.get([i])` ->
    (taps [L, n*H] in the order `taps`, final [L, H])); only the rows at a-1 of the chosen inputs
    are kept, in bf16."""
    states, anchors, labels, where = [], [], [], []
    bar = tqdm(total=sum(len(seqs[i].ids) for i in indices), desc=desc, unit="tok", disable=not progress)
    for i in indices:
        a = answer_anchors(seqs[i])
        if not len(a):
            bar.update(len(seqs[i].ids))
            continue
        t, fin = features.get([i])[0]
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
        bar.update(len(seqs[i].ids))
    bar.close()
    if not labels:
        return Pairs(
            torch.zeros(0, 0, dtype=torch.bfloat16),
            torch.zeros(0, dtype=torch.long),
            torch.zeros(0, dtype=torch.long),
            torch.zeros(0, 2, dtype=torch.long),
        )
    return Pairs(torch.cat(states), torch.cat(anchors), torch.cat(labels), torch.cat(where))


class Remembered:
    """Features computed once per sequence and kept (the held-out set is read by the probe and by
    the draft's first slot: one target pass)."""

    def __init__(self, inner):
        self.inner, self.kept = inner, {}

    def get(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        missing = [i for i in dict.fromkeys(indices) if i not in self.kept]
        if missing:
            self.kept.update(zip(missing, self.inner.get(missing)))
        return [self.kept[i] for i in indices]


class Probe(nn.Module):
    """[states ; embed(anchor)] -> Linear -> SiLU -> Linear -> RMS norm -> the target's frozen LM head.

    Every input column is standardized with fixed statistics of the training pairs (`fit_inputs`):
    an embedding (std ~0.05) beside a post-norm state (RMS ~1) or a residual-stream tap (a few
    "massive" dimensions in the hundreds) would otherwise be read at scales hundreds of times
    apart. The norm's gain starts at 1 / RMS of the head's row norms, so the first logits are
    ~N(0, 1) (the target's own final-norm gain would start them at std ~6 on SmolLM2: confidently
    wrong). The head matmul runs in `head_dtype` (bf16: a third less time on a CPU with bf16
    units), the loss in fp32."""

    def __init__(
        self,
        in_states: int,
        embed: torch.Tensor | None,
        head: torch.Tensor,
        width: int,
        eps: float = 1e-5,
        head_dtype=torch.bfloat16,
    ):
        super().__init__()
        H = head.shape[1]
        # buffers (torch's Module stub would read them as Tensor | Module)
        self.head: torch.Tensor
        self.embed: torch.Tensor | None
        self.shift: torch.Tensor
        self.scale: torch.Tensor
        self.register_buffer("head", head.detach().to(head_dtype), persistent=False)
        self.register_buffer("embed", None if embed is None else embed.detach().to(torch.bfloat16), persistent=False)
        d_in = in_states + (0 if embed is None else embed.shape[1])
        self.register_buffer("shift", torch.zeros(d_in), persistent=False)
        self.register_buffer("scale", torch.ones(d_in), persistent=False)
        self.mlp = nn.Sequential(nn.Linear(d_in, width), nn.SiLU(), nn.Linear(width, H))
        self.norm = nn.RMSNorm(H, eps=eps)
        with torch.no_grad():
            self.norm.weight.fill_(float(head.detach().float().pow(2).sum(1).mean().rsqrt()))

    def inputs(self, states: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        x = states.float()
        if self.embed is not None:
            x = torch.cat([x, self.embed[anchors].float()], -1)
        return x

    @torch.no_grad()
    def fit_inputs(self, p: Pairs, n: int = 20_000, seed: int = 0) -> None:
        """Per-column mean and standard deviation of the inputs over (up to n seeded) training pairs."""
        s = p.sample(n, seed)
        x = self.inputs(s.states, s.anchors)
        self.shift.copy_(x.mean(0))
        self.scale.copy_(x.std(0, correction=0).clamp_min(1e-6))

    def forward(self, states: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        x = (self.inputs(states, anchors) - self.shift) / self.scale
        return (self.norm(self.mlp(x)).to(self.head.dtype) @ self.head.T).float()


@torch.no_grad()
def agreement(probe: Probe, p: Pairs, batch: int = 1024) -> tuple[int, float]:
    """(pairs whose argmax is the label, mean cross-entropy)."""
    hits, loss = 0, 0.0
    for s in range(0, len(p), batch):
        logits = probe(p.states[s : s + batch], p.anchors[s : s + batch])
        y = p.labels[s : s + batch]
        hits += int((logits.argmax(-1) == y).sum())
        loss += float(F.cross_entropy(logits, y, reduction="sum"))
    return hits, loss / max(len(p), 1)


@dataclass
class FitResult:
    curve: list[dict]
    steps: int
    fit_seconds: float  # optimization only
    curve_seconds: float  # the curve points' evaluations


def fit(probe: Probe, train: Pairs, held: Pairs, cfg: ProbeSettings, progress: bool = False) -> FitResult:
    """The input statistics (`Probe.fit_inputs`), then AdamW: 20 warm-up steps and a cosine decay to
    zero over the plan: `steps`, else the time budget (the decay follows the clock, so a run the
    budget ends is annealed), else five passes over the pairs; both given, whichever ends first.
    A curve point (mean training loss since the last, held-out and training agreement on
    `curve_anchors` seeded pairs) every 1/curve_points of the plan and at the end."""
    if not len(train):
        raise TrainError("the probe has no training anchors")
    probe.fit_inputs(train, seed=cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    steps = cfg.steps or (None if cfg.time_budget else max(1, math.ceil(5 * len(train) / cfg.batch)))
    budget = cfg.time_budget
    opt = torch.optim.AdamW(
        [p for p in probe.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=cfg.weight_decay
    )
    held_c, train_c = held.sample(cfg.curve_anchors, cfg.seed + 1), train.sample(cfg.curve_anchors, cfg.seed + 2)

    def done(step: int, elapsed: float) -> float:
        return min(1.0, max(step / steps if steps else 0.0, elapsed / budget if budget else 0.0))

    curve, fit_s, curve_s, step, next_point, losses = [], 0.0, 0.0, 0, 1, []
    if not steps and budget is None:
        raise TrainError("a probe fit needs steps or a time budget")  # steps is None only under a time budget
    bar = tqdm(
        total=steps or int(math.ceil(budget or 0)),
        desc="probe fit",
        unit="step" if steps else "s",
        disable=not progress,
    )
    while True:
        t0 = time.perf_counter()
        lr = cfg.lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * done(step, fit_s)))
        for group in opt.param_groups:
            group["lr"] = lr
        idx = torch.randint(0, len(train), (cfg.batch,), generator=gen)
        loss = F.cross_entropy(probe(train.states[idx], train.anchors[idx]), train.labels[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        losses.append(float(loss.detach()))
        dt = time.perf_counter() - t0
        fit_s += dt
        bar.update(1 if steps else min(dt, max(0.0, bar.total - bar.n)))
        f = done(step, fit_s)
        if f >= 1.0 or f * cfg.curve_points >= next_point:
            t1 = time.perf_counter()
            next_point = int(f * cfg.curve_points) + 1
            h_hits, h_loss = agreement(probe, held_c)
            t_hits, t_loss = agreement(probe, train_c)
            curve.append(
                {
                    "step": step,
                    "seconds": round(fit_s, 2),
                    "lr": lr,
                    "train_loss": sum(losses) / len(losses),
                    "train_top1": t_hits / max(len(train_c), 1),
                    "heldout_loss": h_loss,
                    "heldout_top1": h_hits / max(len(held_c), 1),
                    "heldout_anchors": len(held_c),
                }
            )
            losses = []
            curve_s += time.perf_counter() - t1
        if f >= 1.0:
            break
    bar.close()
    return FitResult(curve, step, fit_s, curve_s)


def bigram_hits(seqs: list[Sequence], held: Pairs, vocab: int) -> int:
    """Held-out pairs whose label is the most frequent next token after their anchor in the answers
    `seqs` (anchor and next token both answer tokens; ties: the smaller id; an anchor never seen
    there never agrees)."""
    if not len(held) or not seqs:
        return 0
    a = torch.cat([s.ids[answer_anchors(s)] for s in seqs])
    b = torch.cat([s.ids[answer_anchors(s) + 1] for s in seqs])
    uniq, n = (a * vocab + b).unique(return_counts=True)  # sorted by key: anchor, then next token
    ua, ub = uniq // vocab, uniq % vocab
    # per anchor the most frequent next token, the smaller id on ties: stable sorts, the last key first
    order = torch.argsort(n, descending=True, stable=True)
    order = order[torch.argsort(ua[order], stable=True)]
    first = torch.ones(len(order), dtype=torch.bool)
    first[1:] = ua[order][1:] != ua[order][:-1]
    best = torch.full((vocab,), -1, dtype=torch.long)
    best[ua[order][first]] = ub[order][first]
    return int((best[held.anchors] == held.labels).sum())


@torch.inference_mode()
def draft_slot1_tokens(
    draft,
    features,
    taps: tuple[int, ...],
    hidden: int,
    seqs: list[Sequence],
    held: Pairs,
    chunk: int = 256,
    progress: bool = False,
) -> torch.Tensor:
    """A draft's own first-slot greedy token at each pair's anchor ([N], the pairs' order).

    Per sequence its context keys/values are computed once from the draft's taps (taken out of
    `features`, whose columns are the taps `taps`), and every anchor a reads the positions < a of
    that shared context (as `dspark doctor` does); the block is `engine.drafting.teacher_forced`, the
    one `propose` runs, so slot 1 is what greedy decoding drafts there (with the draft's own
    weights: not the engine's q4/q8 kernel copy)."""
    from dspark.engine.drafting import teacher_forced
    from dspark.model.draft import ContextCache

    dev, dtype = draft.fc.weight.device, draft.fc.weight.dtype
    g = draft.spec.gamma
    cols = [taps.index(i) for i in draft.spec.hidden_state_indices]
    out = torch.zeros(len(held), dtype=torch.long)
    for i in tqdm(held.where[:, 0].unique().tolist(), desc="draft slot 1", unit="seq", disable=not progress):
        rows = (held.where[:, 0] == i).nonzero().squeeze(-1)
        t, _ = features.get([i])[0]
        feats = torch.cat([t[:, j * hidden : (j + 1) * hidden] for j in cols], -1)[None].to(dev, dtype)
        ctx = draft.context_kv(feats, torch.arange(feats.shape[1], device=dev)[None])
        ids = seqs[i].ids.to(dev)
        for part in rows.split(chunk):
            a = held.where[part, 1].to(dev)
            want = ids[(a[:, None] + 1 + torch.arange(g, device=dev)[None, :]).clamp(max=len(ids) - 1)]
            tokens, _ = teacher_forced(draft, ids[a], ContextCache(ctx, a.clone(), shared=True), want)
            out[part] = tokens[:, 0].cpu()
    return out
