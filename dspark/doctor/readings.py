"""The readings of a draft (declared and alternatives) and what one reading scores on a text."""

from __future__ import annotations

from dataclasses import replace

import torch

from dspark.doctor.report import (
    ANCHOR_CHUNK,
    FACTORS,
    MAX_MASK_ALTERNATIVES,
    PRETTY_LAYOUT,
    Reading,
    Text,
)
from dspark.engine.drafting import draft_block, teacher_forced
from dspark.formats.load import force_layout
from dspark.formats.spec import DraftSpec, Layout, query_slots_for
from dspark.model import fast
from dspark.model.draft import ContextCache, LayerKV

WALK_BYTES = 1 << 26  # context copies one walked chunk of anchors may hold (bounds its anchors)

# ---- one reading -------------------------------------------------------------------------------


def score_anchors(draft, spec, text: Text, g_max: int, ctx=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted [anchors], loglik [anchors, gamma]) at each anchor of `text` when the draft is read
    as `spec`: the drafts greedy verification accepts, and the log-probability of the target's
    token per slot, from the draft's own block forward (`engine.drafting.teacher_forced`, which shares
    it with `propose`), all anchors of the text batched.

    Anchor i is position prompt_len + i (the engine's anchors: the token committed last, not yet
    run through the target); its context is every position before it (the draft's context mask
    over one shared context cache). Anchors stop where a block of g_max would leave the text, so
    every reading is measured on the same anchors."""
    view = draft.read_as(spec)
    dev = draft.fc.weight.device
    ids, argmax = text.ids.to(dev), text.argmax.to(dev)
    T = int(ids.shape[0])
    anchors = torch.arange(text.prompt_len, max(text.prompt_len, T - g_max + 1), device=dev)
    g = spec.gamma
    if anchors.numel() == 0:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, g)
    if ctx is None:
        ctx = context_for(draft, spec, text)
    acc, lls = [], []
    walked = engines_walk(view, spec, text, anchors, argmax)  # None: the engine drafts on the modules here
    for chunk in anchors.split(ANCHOR_CHUNK):
        pos = chunk[:, None] + torch.arange(g, device=dev)[None, :]  # [n, g], inside the text (see above)
        want = argmax[pos]  # the target's token at each slot
        tokens, ll = teacher_forced(view, ids[chunk], ContextCache(ctx, chunk.clone(), shared=True), want)
        if walked is None:
            acc.append((tokens == want).long().cumprod(1).sum(1).cpu())
        lls.append(ll.float().cpu())
    return (torch.cat(acc) if walked is None else walked), torch.cat(lls)


@torch.inference_mode()
def engines_walk(view, spec, text: Text, anchors: torch.Tensor, argmax: torch.Tensor) -> torch.Tensor | None:
    """What the engine's greedy steps accept at each anchor where its drafting phase runs on dspark's
    kernels (None elsewhere): the very computation of `engine.drafting.propose`, not a re-derivation.
    The context is built by the kernels' own context update (every op computes a position on its
    own, so committing the whole text at once gives the bits of committing it step by step), each
    anchor reads a copy of it cut at its position, and the block is `draft_block` on those rows:
    the compiled walk, whatever the Markov head's kind."""
    if fast.why_not(view) is not None:
        return None  # the engine would make its contexts for the modules (`new_context_cache`)
    dev, g = view.fc.weight.device, spec.gamma
    ids = text.ids.to(dev)
    feats = torch.cat([text.taps[i] for i in spec.hidden_state_indices], dim=-1)[None].to(dev)
    one = view.new_context_cache(1, dev)
    view.extend_context(one, feats, torch.tensor([feats.shape[1]], device=dev))
    per_row = sum(kv.k.numel() * kv.k.element_size() * 2 for kv in one.layers)
    rows = max(1, min(ANCHOR_CHUNK, WALK_BYTES // max(per_row, 1)))
    out = []
    for chunk in anchors.split(rows):
        n = chunk.numel()
        ctx = ContextCache(
            [LayerKV(kv.k.expand(n, -1, -1, -1).clone(), kv.v.expand(n, -1, -1, -1).clone()) for kv in one.layers],
            chunk.clone(),
            kernels=one.kernels,
        )
        want = argmax[chunk[:, None] + torch.arange(g, device=dev)[None, :]]
        tokens = draft_block(view, ids[chunk], ctx, walk=True).tokens
        assert tokens is not None  # the kernels walk in the call
        out.append((tokens == want).long().cumprod(1).sum(1).cpu())
    return torch.cat(out)


@torch.inference_mode()
def context_for(draft, spec, text: Text):
    """The draft's context keys/values of the whole text under `spec`'s taps (one row, shared)."""
    dev, dtype = draft.fc.weight.device, draft.fc.weight.dtype
    feats = torch.cat([text.taps[i] for i in spec.hidden_state_indices], dim=-1)[None].to(dev, dtype)
    return draft.context_kv(feats, torch.arange(feats.shape[1], device=dev)[None])


# ---- the readings ------------------------------------------------------------------------------


def layout_readings(spec: DraftSpec) -> list[tuple[DraftSpec, str]]:
    """(spec, label): the declared layout, the other layout keeping gamma (a consistent file with
    the layout flag flipped), and the other layout keeping block_size (a flag read wrongly)."""
    other: Layout = "bonus_anchor" if spec.layout == "anchor_first" else "anchor_first"
    out = [(spec, PRETTY_LAYOUT[spec.layout])]
    keep_gamma = replace(
        spec,
        layout=other,
        gamma=spec.gamma,
        query_slots=query_slots_for(other, spec.gamma),
        block_size=query_slots_for(other, spec.gamma),
    )
    out.append((keep_gamma, PRETTY_LAYOUT[other]))
    if spec.block_size - (1 if other == "bonus_anchor" else 0) >= 1:
        keep_block = replace(force_layout(spec, other), layout_source=spec.layout_source, warnings=spec.warnings)
        out.append((keep_block, f"{PRETTY_LAYOUT[other]}(block_size {spec.block_size})"))
    return out


def readings_for(spec, num_layers: int, mask_candidates: list[int], full_grid: bool = True) -> list[Reading]:
    """Layout (declared, flipped keeping gamma, flipped keeping block_size) x taps (declared,
    -1, +1) x mask (declared, others); declared first.

    Combinations, not only single changes: a file wrong in two ways scores low under every
    single change. full_grid=False (load time) keeps layout x taps and the single mask changes."""
    shifts = [0] + [d for d in (-1, +1) if all(0 <= i + d <= num_layers for i in spec.hidden_state_indices)]
    out = []
    for li, (lay, label) in enumerate(layout_readings(spec)):
        for d in shifts:
            for m in [spec.mask_token_id, *mask_candidates]:
                factors = tuple(f for f, changed in zip(FACTORS, (li > 0, d != 0, m != spec.mask_token_id)) if changed)
                if not full_grid and len(factors) > 1 and "mask_token_id" in factors:
                    continue
                taps = tuple(i + d for i in spec.hidden_state_indices)
                out.append(Reading(replace(lay, hidden_state_indices=taps, mask_token_id=m), d, factors, label))
    return out


def mask_candidates(spec, tokenizer, target_config, vocab: int, extra=()) -> list[int]:
    """Other plausible mask ids: the given ones, the tokenizer's mask/pad/eos/bos/unk, the config's, 0."""
    cands = list(extra)
    if tokenizer is not None:
        cands += [getattr(tokenizer, f"{k}_token_id", None) for k in ("mask", "pad", "eos", "bos", "unk")]
    for k in ("pad_token_id", "eos_token_id", "bos_token_id"):
        v = getattr(target_config, k, None)
        cands += v if isinstance(v, (list, tuple)) else [v]
    cands.append(0)
    seen, out = {spec.mask_token_id}, []
    for c in cands:
        if isinstance(c, int) and 0 <= c < vocab and c not in seen:
            seen.add(c)
            out.append(c)
    return out[: max(MAX_MASK_ALTERNATIVES, len(set(extra)))]
