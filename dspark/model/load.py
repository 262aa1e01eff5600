"""Build a DSparkDraft from a checkpoint (or a DraftSpec) for a given target."""

from __future__ import annotations

import logging

from dspark.errors import FormatError
from dspark.formats.load import load_spec, load_weights
from dspark.formats.spec import DraftSpec
from dspark.model.draft import DSparkDraft
from dspark.model.packed import pack_linears
from dspark.target.checkpoint import checkpoint_of

log = logging.getLogger("dspark")


def check_compatible(spec: DraftSpec, target_model) -> None:
    """The draft must fit the target it will run against: vocab, taps, hidden width.
    target_model: a transformers model or its dspark.target.checkpoint.Checkpoint."""
    ck = checkpoint_of(target_model)
    cfg = ck.config
    vocab = ck.head().shape[0]
    if spec.vocab_size != vocab:
        raise FormatError(f"draft vocab_size {spec.vocab_size} != target vocabulary {vocab}")
    if not 0 <= spec.mask_token_id < vocab:
        raise FormatError(f"mask_token_id {spec.mask_token_id} is outside the target vocabulary [0, {vocab})")
    n_layers = cfg.num_hidden_layers
    bad = [i for i in spec.hidden_state_indices if not 0 <= i <= n_layers]
    if bad:
        raise FormatError(f"hidden_state_indices {bad} outside 0..{n_layers} for this {n_layers}-layer target")
    hidden = ck.embedding().shape[1]
    if spec.target_hidden_size and spec.target_hidden_size != hidden:
        raise FormatError(f"draft target_hidden_size {spec.target_hidden_size} != target hidden size {hidden}")


def build_draft(spec: DraftSpec, target_model, tensors: dict | None = None, dtype=None) -> DSparkDraft:
    """A draft on the target's device; `tensors` None means random init (training, tests).
    target_model: a transformers model or its dspark.target.checkpoint.Checkpoint."""
    ck = checkpoint_of(target_model)
    check_compatible(spec, ck)
    dtype = dtype or ck.dtype
    draft = DSparkDraft(spec)
    embed, head = ck.embedding(), ck.head()
    if tensors is None:
        own = {k: v for k, v in draft.state_dict().items() if not k.startswith("rope.")}
        tensors = {k: v for k, v in own.items() if k not in ("embed_tokens.weight", "lm_head.weight")}
        if spec.draft_vocab_size != spec.vocab_size:
            tensors["lm_head.weight"] = own["lm_head.weight"]
    draft.load_tensors(tensors, target_embed=embed, target_lm_head=head)
    draft = draft.to(device=embed.device, dtype=dtype)
    for name, p in draft.named_parameters():
        if name in draft.borrowed:
            p.requires_grad_(False)  # the target's own weights stay frozen
    pack_linears(draft)  # bf16 on a CPU: decoding runs oneDNN's packed weights (training is unaffected)
    return draft.eval()


def load_draft(path: str, target_model, layout: str | None = None, dtype=None) -> DSparkDraft:
    spec = load_spec(path, layout=layout, check_values=False)  # load_weights checks values once
    for w in spec.warnings:
        log.warning("WARNING: draft %s: %s", path, w)
    return build_draft(spec, target_model, load_weights(spec), dtype)
