"""Held-out, teacher-forced acceptance of a draft being trained (no decoding loop needed).

Only blocks whose gamma slots all predict response tokens are scored, so a short answer's end
does not pose as a rejection. Per slot i, teacher-forced with the data's previous tokens:
- greedy: draft argmax == target argmax. With greedily generated data the data tokens are the
  target's own argmax, so "slots < i accepted" is exactly the teacher-forced context, and
  conditional/marginal rates and tau_greedy = 1 + sum(marginal) estimate greedy decoding.
- sampling at T=1: slot acceptance probability 1 - ||p_draft - p_target||_1 / 2, and
  tau_t1 = 1 + mean over blocks of sum_k prod_{i<=k} of it (expected length under rejection sampling).

Those figures weigh every anchor alike; decoding does not. It anchors where the last verify ended,
so right after each position the draft got wrong. With `walk=True` every full block of an answer is
scored (no sampling) and the answer is also walked as greedy decoding with full verification walks
it: from its first anchor a, accept the k leading matching slots, commit k + 1 tokens and anchor at
a + k + 1, until a block no longer fits. `walk_first_slot` and `walk_mal` (tokens committed a step)
are the figures `dspark train eval` measures in the engine, read on the same text.
"""

from __future__ import annotations

import torch

from dspark.train.loss import LossWeights, draft_rows, loss_sums, make_blocks, row_terms, valid_anchors


@torch.no_grad()
def evaluate(
    draft,
    features,
    seqs,
    target,
    *,
    max_anchors: int,
    weights: LossWeights,
    seed: int = 0,
    head_weight=None,
    walk: bool = False,
) -> dict:
    """target: a TargetHead over `seqs` laid end to end (its memo keys), or the target's LM head.

    walk: score every full block (max_anchors is ignored) and add the decoding walk's figures.
    """
    spec = draft.spec
    g = spec.gamma
    was_training = draft.training
    draft.eval()
    gen = torch.Generator().manual_seed(seed)
    match, accept, conf, walked = [], [], [], []
    loss = ce = l1 = bce = wsum = 0.0
    offset = 0
    for i, seq in enumerate(seqs):
        keys = torch.arange(offset, offset + len(seq.ids))
        offset += len(seq.ids)
        anchors = valid_anchors(seq.loss_mask)
        if anchors.numel() == 0:
            continue
        blocks = make_blocks(
            seq.ids,
            seq.loss_mask,
            anchors,
            layout=spec.layout,
            gamma=g,
            mask_token_id=spec.mask_token_id,
            decay=weights.decay,
        )
        full = blocks.slot_valid.sum(dim=1) == g
        if not bool(full.any()):
            continue
        keep = full.nonzero().squeeze(-1)
        if not walk and keep.numel() > max_anchors:
            keep = keep[torch.randperm(keep.numel(), generator=gen)[:max_anchors]].sort().values
        blocks = make_blocks(
            seq.ids,
            seq.loss_mask,
            anchors[keep],
            layout=spec.layout,
            gamma=g,
            mask_token_id=spec.mask_token_id,
            decay=weights.decay,
        )
        taps, final = features.get([i])[0]
        dev = draft.fc.weight.device
        ctx = draft.context_kv(taps[None].to(dev, draft.fc.weight.dtype), torch.arange(len(seq.ids), device=dev)[None])
        out = draft_rows(draft, ctx, blocks, seq.ids, final, target, head_weight, keys=keys)
        terms = row_terms(out)
        acc = terms[3]
        s = loss_sums(out, weights, terms)
        loss, ce, l1, bce, wsum = loss + float(s.total), ce + s.ce, l1 + s.l1, bce + s.conf, wsum + s.weight
        hits = (out.draft_argmax() == out.target_top[out.target_index]).view(-1, g).cpu()
        match.append(hits)
        if walk:
            walked.append(walk_blocks(anchors[keep], hits))
        accept.append(acc.view(-1, g).cpu())
        if out.conf_logits is not None:
            conf.append((torch.sigmoid(out.conf_logits) - acc).abs().view(-1, g).cpu())
    draft.train(was_training)
    if not match:
        return {"blocks": 0}
    m, a = torch.cat(match).float(), torch.cat(accept)
    marginal = m.cumprod(dim=1).mean(dim=0)
    reached = torch.cat([torch.ones(1), marginal[:-1]])
    conditional = torch.where(reached > 0, marginal / reached.clamp_min(1e-12), torch.zeros_like(marginal))
    result = {
        "blocks": int(m.shape[0]),
        "loss": loss / wsum,
        "ce": ce / wsum,
        "l1": l1 / wsum,
        "conf_bce": bce / wsum,
        "greedy_conditional": [round(float(x), 4) for x in conditional],
        "greedy_marginal": [round(float(x), 4) for x in marginal],
        "tau_greedy": 1.0 + float(marginal.sum()),
        "t1_accept": [round(float(x), 4) for x in a.mean(dim=0)],
        "tau_t1": 1.0 + float(a.cumprod(dim=1).sum(dim=1).mean()),
    }
    if conf:
        result["conf_abs_error"] = float(torch.cat(conf).mean())
    if walk:
        w = torch.cat(walked)
        result["walk_blocks"] = int(w.shape[0])
        result["walk_first_slot"] = float(w[:, 0].float().mean()) if w.numel() else 0.0
        result["walk_mal"] = 1.0 + float(w.cumprod(dim=1).sum(dim=1).float().mean()) if w.numel() else 0.0
    return result


def walk_blocks(anchors: torch.Tensor, hits: torch.Tensor) -> torch.Tensor:
    """The rows of `hits` ([anchors, gamma] draft == target, one per sorted anchor position) that
    greedy decoding with full verification visits: from the first anchor a, the k leading hits
    commit k + 1 tokens and the next block anchors at a + k + 1; the walk ends where no block
    anchors (the answer's end, or a position whose block does not fit)."""
    row = {int(a): i for i, a in enumerate(anchors.tolist())}
    lead = hits.int().cumprod(dim=1).sum(dim=1).tolist()
    seen: list[int] = []
    a = int(anchors[0]) if anchors.numel() else -1
    while a in row:
        i = row[a]
        seen.append(i)
        a += lead[i] + 1
    return hits[seen]


def eval_line(step: int, ev: dict | None) -> str:
    """One line for the user: an `evaluate` result at a training step."""
    if not ev or not ev.get("blocks"):
        return f"step {step}: held-out set has no complete block to score"
    curve = " ".join(f"{x:.2f}" for x in ev["greedy_conditional"])
    walk = (
        f"  decoding walk: first slot {ev['walk_first_slot']:.3f}, mean acceptance length {ev['walk_mal']:.3f}"
        if "walk_mal" in ev
        else ""
    )
    return (
        f"step {step}: held-out loss {ev['loss']:.4f}  tau_greedy {ev['tau_greedy']:.3f}  "
        f"tau_t1 {ev['tau_t1']:.3f}  per-slot greedy accept {curve}{walk}"
    )
