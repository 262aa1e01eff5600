"""The DeepSpec objective (docs/DESIGN.md §5) for both checkpoint layouts.

Draft slot i = 0..gamma-1 of an anchor at absolute position a predicts token a+1+i; its
target distribution is the target's softmax at position a+i (T=1) and its teacher-forced
Markov input is token a+i. The layouts differ only in which block row holds slot i:
anchor-first row i, bonus-anchor row i+1 (row 0 is weighted 0 but still runs, because the
rnn Markov head's recurrence passes through it at decode time too).

Per row: w * (0.1*CE(data token) + 0.9*||p_draft - p_target||_1 + 1.0*BCE(conf, clamp(1 - L1/2)))
with w = exp(-i/4) times a contiguous-prefix mask that stops at the end of the response.
Sums are returned unnormalized: the trainer divides by the weight summed over the whole
(possibly multi-process) batch, so splitting a batch never changes the gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dspark.train.errors import TrainError


@dataclass(frozen=True)
class LossWeights:
    ce: float = 0.1
    l1: float = 0.9
    conf: float = 1.0
    decay: float = 4.0  # w_i = exp(-i / decay) for draft slot i


@dataclass
class Blocks:
    """Training blocks of one sequence: one per anchor, spec.query_slots rows each."""

    anchors: torch.Tensor  # [N] absolute anchor positions (= context lengths)
    block_ids: torch.Tensor  # [N, S] anchor then mask tokens: the draft's input
    prev_ids: torch.Tensor  # [N, S] teacher-forced previous token of each row (Markov input)
    label_pos: torch.Tensor  # [N, S] absolute position of the token each row predicts (clamped in range)
    slot_valid: torch.Tensor  # [N, S] bool: row predicts a response token and every earlier slot does too
    decay: torch.Tensor  # [S] exp(-slot/decay), 0 for a bonus-anchor row 0

    @property
    def weight(self) -> torch.Tensor:
        return self.slot_valid.to(self.decay.dtype) * self.decay


def first_row(layout: str) -> int:
    """Block row of draft slot 0."""
    if layout == "anchor_first":
        return 0
    if layout == "bonus_anchor":
        return 1
    raise TrainError(f"layout must be anchor_first or bonus_anchor, got {layout!r}")


def slot_decay(layout: str, gamma: int, decay: float) -> torch.Tensor:
    """[S] per-row weight exp(-slot/decay); bonus-anchor row 0 predicts nothing and weighs 0."""
    start = first_row(layout)
    w = torch.zeros(gamma + start)
    w[start:] = torch.exp(-torch.arange(gamma, dtype=torch.float32) / decay)
    return w


def valid_anchors(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions a that may anchor a block: a response token whose next token is a response token.

    a >= 1 keeps at least one context position, as in decoding (the prompt is never empty).
    """
    m = loss_mask.bool()
    if m.shape[0] < 2:
        return torch.zeros(0, dtype=torch.long)
    ok = m[:-1] & m[1:]
    ok[0] = False
    return ok.nonzero().squeeze(-1)


def sample_anchors(
    loss_mask: torch.Tensor, max_anchors: int | None, generator: torch.Generator | None, window: int = 0
) -> torch.Tensor:
    """Up to max_anchors distinct valid anchors drawn uniformly (all of them when None), sorted;
    window > 0: only anchors among the answer's first `window` tokens (from its first answer token)."""
    cand = valid_anchors(loss_mask)
    if window > 0 and cand.numel():
        cand = cand[cand < int(loss_mask.nonzero()[0]) + window]
    if max_anchors is None or cand.numel() <= max_anchors:
        return cand
    pick = torch.randperm(cand.numel(), generator=generator)[:max_anchors]
    return cand[pick].sort().values


def make_blocks(
    ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    *,
    layout: str,
    gamma: int,
    mask_token_id: int,
    decay: float = 4.0,
) -> Blocks:
    """ids/loss_mask [L] of one sequence, anchors [N] -> the rows, labels and weights of every block."""
    L = ids.shape[0]
    start = first_row(layout)
    S = gamma + start
    if anchors.numel() and (int(anchors.min()) < 1 or int(anchors.max()) >= L - 1):
        raise TrainError(f"anchors must lie in [1, {L - 2}] for a sequence of {L} tokens")
    slot = torch.arange(S) - start  # slot index per row; -1 = bonus-anchor row 0
    label_pos = anchors[:, None] + 1 + slot[None, :]  # [N, S]
    in_range = (label_pos < L) & (slot[None, :] >= 0)
    label_pos = label_pos.clamp(0, L - 1)
    # Contiguous prefix: a slot counts only while every slot before it is a response token.
    resp = loss_mask.bool()[label_pos] & in_range
    resp[:, :start] = True  # the unused row must not break the prefix
    slot_valid = resp.long().cumprod(dim=1).bool()
    slot_valid[:, :start] = False
    prev_pos = (anchors[:, None] + slot.clamp(min=0)[None, :]).clamp(max=L - 1)
    block_ids = torch.full((anchors.numel(), S), mask_token_id, dtype=torch.long)
    block_ids[:, 0] = ids[anchors]
    return Blocks(anchors, block_ids, ids[prev_pos], label_pos, slot_valid, slot_decay(layout, gamma, decay))


def pack_blocks(blocks: list[Blocks], lengths: list[int]) -> tuple[Blocks, torch.Tensor]:
    """Blocks of several sequences as one: label positions index the sequences laid end to end
    (ids and final states concatenated in the same order); anchors stay per sequence, because
    they are context lengths and RoPE positions. Returns (blocks, [N] sequence of each block)."""
    offsets = [0]
    for n in lengths[:-1]:
        offsets.append(offsets[-1] + n)
    cat = lambda name: torch.cat([getattr(b, name) for b in blocks])  # noqa: E731
    label_pos = torch.cat([b.label_pos + o for b, o in zip(blocks, offsets)])
    seq = torch.cat([torch.full((b.anchors.numel(),), k, dtype=torch.long) for k, b in enumerate(blocks)])
    return Blocks(cat("anchors"), cat("block_ids"), cat("prev_ids"), label_pos, cat("slot_valid"), blocks[0].decay), seq


class TargetHead:
    """The frozen target's distribution at the positions a batch predicts: log-probabilities over
    the draft's vocabulary (normalised over the target's whole vocabulary) and the target's argmax.

    With a reduced draft vocabulary a step needs only its columns of the target's head, plus each
    position's whole-vocabulary normaliser and argmax. Given `positions` (how many distinct keys
    the caller will use), those two are computed the first time a key is seen and kept, so later
    visits of a position (every epoch, every overlapping block) cost Vd / V of the full head."""

    def __init__(self, lm_head, draft_ids: torch.Tensor | None = None, positions: int = 0):
        self.lm_head, self.draft_ids = lm_head, draft_ids
        w = lm_head.weight.detach()
        bias = getattr(lm_head, "bias", None)
        self.rows = None if draft_ids is None else w[draft_ids.to(w.device)]
        self.row_bias = None if draft_ids is None or bias is None else bias.detach()[draft_ids.to(w.device)]
        self.lse = torch.full((positions,), float("nan")) if positions and draft_ids is not None else None
        self.top = torch.full((positions,), -1, dtype=torch.long) if self.lse is not None else None

    @torch.no_grad()
    def __call__(self, final: torch.Tensor, keys: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """final [U, H] post-norm target states, keys [U] their memo keys -> (logp [U, Vd], top [U])."""
        x = final.to(self.lm_head.weight.dtype)
        if self.rows is None:
            z = self.lm_head(x).float()
            return F.log_softmax(z, dim=-1), z.argmax(-1)
        part = F.linear(x, self.rows, self.row_bias).float()
        if self.lse is None or self.top is None or keys is None:  # lse and top are made together
            z = self.lm_head(x).float()
            return part - z.logsumexp(-1, keepdim=True), z.argmax(-1)
        keys = keys.cpu()
        new = self.lse[keys].isnan().nonzero().squeeze(-1)
        if new.numel():
            z = self.lm_head(x[new.to(x.device)]).float()
            self.lse[keys[new]] = z.logsumexp(-1).cpu()
            self.top[keys[new]] = z.argmax(-1).cpu()
        return part - self.lse[keys].to(part.device)[:, None], self.top[keys].to(part.device)


@dataclass
class RowOutputs:
    """Draft outputs on the weighted rows of a batch of blocks (flattened)."""

    logits: torch.Tensor  # [M, Vd] fp32 Markov-corrected draft logits (the q that decoding samples from)
    conf_logits: torch.Tensor | None  # [M]
    target_logp: (
        torch.Tensor
    )  # [U, Vd] fp32 target log-probabilities over the draft vocabulary, one per distinct position
    target_top: torch.Tensor  # [U] the target's argmax there (a target id, maybe outside the draft vocabulary)
    target_index: torch.Tensor  # [M] row -> its entry of target_logp
    labels: torch.Tensor  # [M] data tokens
    weight: torch.Tensor  # [M]
    rows: torch.Tensor  # [M, 2] (block, row) of each output
    draft_ids: torch.Tensor | None = None  # [Vd] target id of each draft-vocabulary entry (reduced vocab)

    def draft_argmax(self) -> torch.Tensor:
        """[M] the draft's greedy token per row, as a target id."""
        top = self.logits.argmax(-1)
        return top if self.draft_ids is None else self.draft_ids[top]


def draft_rows(
    draft,
    ctx_kv,
    blocks: Blocks,
    ids: torch.Tensor,
    final_hidden: torch.Tensor,
    target,
    head_weight: torch.Tensor | None = None,
    seq: torch.Tensor | None = None,
    keys: torch.Tensor | None = None,
) -> RowOutputs:
    """Run the draft on all blocks of one sequence (or of several, see pack_blocks); keep the rows
    that carry weight.

    ctx_kv: draft.context_kv of the sequences (one entry per position, masked per anchor), one row
    per sequence, seq [N] the row of each block (None: row 0, or each block its own row);
    final_hidden [L, H]: the target's post-norm last hidden states; target: a TargetHead (or the
    target's LM head module) that maps them to the target's distribution; keys [L]: each
    position's key in the TargetHead's memo.
    head_weight: a low-precision copy of the draft's frozen (borrowed) LM head. Its matmul is most
    of the training FLOPs, and a bf16 target runs the draft head in bf16 at decode time anyway.
    """
    dev = draft.fc.weight.device
    h = draft(blocks.block_ids.to(dev), ctx_kv, blocks.anchors.to(dev), seq)  # [N, S, H]
    prev_emb, bias = None, None
    if draft.markov_head is not None:
        bias, prev_emb = draft.markov_head.block_bias(blocks.prev_ids.to(dev), h)
    conf = draft.confidence_logits(h, prev_emb)
    weight = blocks.weight.to(dev)
    rows = weight.nonzero()
    b, r = rows[:, 0], rows[:, 1]
    every = rows.shape[0] == weight.numel()  # the common anchor-first case: views instead of [rows, V] copies

    def pick(x):
        return x.reshape(-1, x.shape[-1]) if every else x[b, r]

    hr = pick(h)
    if head_weight is not None:
        logits = F.linear(hr.to(head_weight.dtype), head_weight).float()
    else:
        logits = draft.lm_head(hr).float()
    if bias is not None:
        logits = logits + pick(bias).float()
    label_pos = blocks.label_pos.to(dev)[b, r]
    if not isinstance(target, TargetHead):
        vocab_ids = None if draft.d2t is None else draft.to_target_ids(torch.arange(draft.d2t.numel(), device=dev))
        target = TargetHead(target, vocab_ids)
    draft_ids = target.draft_ids
    # Overlapping blocks predict the same positions many times: the target head runs once per position.
    positions, index = torch.unique(label_pos - 1, return_inverse=True)
    logp, top = target(final_hidden.to(dev)[positions], None if keys is None else keys[positions.cpu()])
    return RowOutputs(
        logits=logits,
        conf_logits=conf[b, r].float() if conf is not None else None,
        target_logp=logp,
        target_top=top,
        target_index=index,
        labels=ids.to(dev)[label_pos],
        weight=weight[b, r],
        rows=rows,
        draft_ids=draft_ids,
    )


@dataclass
class LossSums:
    """Weighted sums over rows; divide by a batch-wide `weight` to get the mean loss."""

    total: torch.Tensor  # differentiable
    ce: float
    l1: float
    conf: float
    weight: float


def row_terms(out: RowOutputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Per row: (CE, L1 distance, confidence BCE or None, confidence label)."""
    logp = F.log_softmax(out.logits, dim=-1)
    p_target = out.target_logp.exp()
    labels = out.labels
    outside = None
    if out.draft_ids is not None:
        # q is 0 outside the draft vocabulary, so the target mass there counts fully in ||p - q||_1;
        # a data token outside it has no draft logit and adds no CE (the L1 term still penalizes it)
        outside = (1.0 - p_target.sum(dim=-1)).clamp_min(0.0)[out.target_index]
        size = max(int(labels.max()), int(out.draft_ids.max())) + 1 if labels.numel() else 1
        to_draft = torch.full((size,), -100, dtype=torch.long, device=labels.device)
        to_draft[out.draft_ids] = torch.arange(out.draft_ids.numel(), device=labels.device)
        labels = to_draft[labels]
    p_target = p_target[out.target_index]
    ce = F.nll_loss(logp, labels, reduction="none", ignore_index=-100)
    l1 = (logp.exp() - p_target).abs().sum(dim=-1)
    if outside is not None:
        l1 = l1 + outside
    label = (1.0 - 0.5 * l1.detach()).clamp(0.0, 1.0)  # the slot's acceptance probability at T=1
    bce = None
    if out.conf_logits is not None:
        bce = F.binary_cross_entropy_with_logits(out.conf_logits, label, reduction="none")
    return ce, l1, bce, label


def loss_sums(out: RowOutputs, w: LossWeights, terms=None) -> LossSums:
    ce, l1, bce, _ = terms if terms is not None else row_terms(out)
    per_row = w.ce * ce + w.l1 * l1
    if bce is not None:
        per_row = per_row + w.conf * bce
    total = (out.weight * per_row).sum()
    if not torch.isfinite(total):
        raise TrainError("the loss is not finite (NaN/inf): lower --lr or check the features")

    def s(x):
        return float((out.weight * x.detach()).sum()) if x is not None else 0.0

    return LossSums(total, s(ce), s(l1), s(bce), float(out.weight.sum()))
