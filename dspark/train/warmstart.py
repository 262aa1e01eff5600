"""The draft's starting weights before training: a small-normal init, the final norm at the
target's, optionally the target's last layers as the draft's (`--init-layers target`), a warm
start from an existing draft (`--init`), and a reduced draft vocabulary chosen from the training
answers (`--draft-vocab`). The loop that trains from them is dspark.train.trainer."""

from __future__ import annotations

import torch

from dspark.formats.load import load_spec, load_weights
from dspark.train.errors import TrainError
from dspark.train.vocab import d2t_offsets, select_draft_vocab

# a warm start's file must agree with the run's draft on these (init_adapt frees gamma and the tap layers)
INIT_KEYS = (
    "layout",
    "gamma",
    "num_layers",
    "markov_rank",
    "markov_head_type",
    "hidden_state_indices",
    "draft_vocab_size",
    "vocab_size",
    "mask_token_id",
    "confidence_head",
    "confidence_head_with_markov",
)


def init_weights(draft, seed: int) -> None:
    """Small-normal init (std 0.02; Markov W1 0.01 as in speculators) so the Markov bias starts near zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name in draft.borrowed:
                continue
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                std = 0.01 if name.startswith("markov_head.markov_w1") else 0.02
                p.copy_(torch.randn(p.shape, generator=g) * std)


def init_output_norm(draft, target_model) -> bool:
    """Start the draft's final norm at the target's: the borrowed LM head was trained on states scaled
    that way (SmolLM2's final-norm gains average 1.8, not 1). Returns whether it applied."""
    norm = getattr(target_model.get_decoder(), "norm", None)
    w = getattr(norm, "weight", None)
    kind = type(norm).__name__
    # same formula as the draft's Qwen3 RMSNorm (x_normed * w); Gemma's norms scale by (1 + w)
    if w is None or not kind.endswith("RMSNorm") or "Gemma" in kind or tuple(w.shape) != tuple(draft.norm.weight.shape):
        return False
    with torch.no_grad():
        draft.norm.weight.copy_(w.detach().float())
    return True


def init_layers_from_target(draft, target_model) -> list[str]:
    """`--init-layers target`: the draft's N decoder layers start as the target's last N (attention
    projections, MLP, the two norms). Those layers already map late hidden states to the next
    token, which is what the draft's block must learn; the draft's own q/k norms (Qwen3-style
    layers) have no counterpart in a Llama target and stay at 1. Returns the parameters copied."""
    source = list(target_model.get_decoder().layers)[-len(draft.layers) :]
    copied, skipped = [], []
    with torch.no_grad():
        for i, (mine, theirs) in enumerate(zip(draft.layers, source)):
            src = theirs.state_dict()
            for name, p in mine.named_parameters():
                w = src.get(name)
                if w is not None and tuple(w.shape) == tuple(p.shape):
                    p.copy_(w.detach().to(p.dtype))
                    copied.append(f"layers.{i}.{name}")
                elif not name.startswith(("self_attn.q_norm", "self_attn.k_norm")):
                    skipped.append(f"layers.{i}.{name}")
    if skipped or not copied:
        raise TrainError(
            f"--init-layers target: the target's last layers do not fit the draft's ({skipped[:4]} "
            "have no same-shaped counterpart; --intermediate-size must be the target's)"
        )
    return copied


def load_init(path: str, adapt: bool, spec, draft) -> tuple[dict, dict]:
    """Warm start: the weights of an existing draft of the same architecture (its d2t vocabulary too)
    copied into `draft` (of `spec`). Returns the file's tensors and what `adapt` let differ
    ({key: (file, run)})."""
    theirs = load_spec(path)
    diff = {
        k: (getattr(theirs, k, None), getattr(spec, k, None))
        for k in INIT_KEYS
        if getattr(theirs, k, None) != getattr(spec, k, None)
    }
    adapted: dict[str, tuple] = {}
    if adapt:
        # what the weights do not fix: the block size, and which layer each of the same number of taps reads
        adapted = {k: diff.pop(k) for k in ("gamma", "hidden_state_indices") if k in diff}
        if "hidden_state_indices" in adapted and len(theirs.hidden_state_indices) != len(spec.hidden_state_indices):
            diff["hidden_state_indices"] = adapted.pop("hidden_state_indices")
        # a deeper draft grown from a shallower one: the file's layers first, the new ones after them
        if "num_layers" in diff and theirs.num_layers < spec.num_layers:
            adapted["num_layers"] = diff.pop("num_layers")
    if diff:
        raise TrainError(
            f"--init {path} does not fit this run's draft {diff} (file, run): "
            "choose matching --layers/--markov-rank/--taps/--draft-vocab/..."
        )
    tensors = load_weights(theirs)
    own = draft.own_state_dict()
    grown = _grown_layers(own, theirs.num_layers) if "num_layers" in adapted else {}
    missing = sorted(set(own) - set(tensors) - set(grown))
    if missing:
        raise TrainError(f"--init {path} lacks weights {missing[:4]}")
    with torch.no_grad():
        for k, v in grown.items():
            if k.endswith(_LAYER_OUTPUTS):
                v.zero_()
        for k, v in own.items():
            if k in grown:
                continue
            if tuple(tensors[k].shape) != tuple(v.shape):
                raise TrainError(f"--init {path}: {k} has shape {tuple(tensors[k].shape)}, this draft {tuple(v.shape)}")
            v.copy_(tensors[k].to(v.dtype))
    return tensors, adapted


# the two matrices that write a decoder layer's result into the residual stream
_LAYER_OUTPUTS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def _grown_layers(own: dict, kept: int) -> dict:
    """The parameters of the layers past the file's first `kept`. Their output projections start at
    zero, so each new layer adds nothing to the residual stream: the grown draft computes exactly
    what the file's draft does, and training moves it from there (its other matrices keep their
    small-normal init, which the zero projections' gradients reach after the first step)."""
    out = {}
    for k, v in own.items():
        parts = k.split(".")
        if parts[0] == "layers" and int(parts[1]) >= kept:
            out[k] = v
    return out


def reduce_vocab(draft, spec, seqs, head: torch.Tensor) -> tuple[int, float]:
    """Draft vocabulary from the training answers `seqs`; its head = the target's rows (`head`), frozen.

    Frozen because the draft's states live in the target's final space (the target's head reads
    them); the rows and d2t are saved with the draft (a reduced head cannot be borrowed).
    Returns the vocabulary's size and the share of the training answer tokens it covers.
    """
    ids = select_draft_vocab(seqs, spec.vocab_size, spec.draft_vocab_size)
    d2t = draft.d2t
    if d2t is None:
        raise TrainError("a reduced draft vocabulary needs a draft with d2t (has_d2t)")
    with torch.no_grad():
        d2t.copy_(d2t_offsets(ids).to(d2t.device))
        draft.lm_head.weight.copy_(head.detach()[ids.to(head.device)].float())
    draft.lm_head.weight.requires_grad_(False)
    answers = sum(int(s.loss_mask.sum()) for s in seqs)
    covered = sum(int(torch.isin(s.ids[s.loss_mask.bool()], ids).sum()) for s in seqs)
    return ids.numel(), covered / max(answers, 1)
