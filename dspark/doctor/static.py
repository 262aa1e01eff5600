"""What the doctor checks from the files alone: vocabulary, storage dtype, finite weights."""

from __future__ import annotations

from pathlib import Path

import torch

from dspark.doctor.report import EMBED_COSINE_MIN, Check
from dspark.errors import FormatError
from dspark.formats.load import load_weights
from dspark.formats.weights import FLOAT_STORAGE, WeightsMeta, iter_tensors
from dspark.model.load import check_compatible
from dspark.target.checkpoint import checkpoint_of

# ---- static checks -----------------------------------------------------------------------------


def static_checks(spec, target_model, tokenizer, run_dtype) -> tuple[list[Check], dict | None]:
    """Vocabulary, dtype and finiteness of the stored weights. Returns (checks, tensors or None)."""

    checks: list[Check] = []
    target_model = checkpoint_of(target_model)  # a transformers model or its Checkpoint
    vocab = target_model.head().shape[0]
    try:
        check_compatible(spec, target_model)
        checks.append(
            Check(
                "vocabulary",
                "ok",
                f"draft vocab {spec.vocab_size} (draft head {spec.draft_vocab_size}) "
                f"= target vocab {vocab}; mask_token_id {spec.mask_token_id} in range",
            )
        )
    except FormatError as exc:
        checks.append(Check("vocabulary", "fail", str(exc)))
    if tokenizer is not None:
        n = len(tokenizer)
        st = "ok" if n <= vocab else "fail"
        checks.append(
            Check(
                "tokenizer",
                st,
                f"tokenizer has {n} tokens, target vocabulary {vocab}"
                + ("" if st == "ok" else ": token ids past the vocabulary"),
            )
        )
    if spec.verifier:
        checks.append(
            Check(
                "verifier",
                "ok",
                f"the draft names its verifier {spec.verifier!r} (not compared: "
                "names differ between hubs and local copies)",
            )
        )

    meta = WeightsMeta.from_dir(Path(spec.path)) if spec.path else None
    if meta is None:
        checks.append(Check("weights", "fail", f"no weights found for {spec.path}"))
        return checks, None
    maps = {"d2t", "t2d"}
    kinds = sorted({i.dtype for n, i in meta.infos.items() if n not in maps})
    quant = sorted(
        {f"{n} ({i.dtype})" for n, i in meta.infos.items() if n not in maps and i.dtype not in FLOAT_STORAGE}
    )
    if quant:  # the weights are not loaded: load_weights refuses such storage
        checks.append(
            Check(
                "dtype",
                "fail",
                f"non-float draft weights {quant[:4]}: quantised storage (integers, "
                "float8) without its scales, which no engine can run as it is",
            )
        )
        return checks, None
    run = str(run_dtype).replace("torch.", "")
    note = "" if len(kinds) == 1 else "; mixed storage dtypes"
    checks.append(Check("dtype", "warn" if len(kinds) > 1 else "ok", f"stored {', '.join(kinds)}, run in {run}{note}"))
    try:
        tensors = load_weights(spec)
    except FormatError:
        bad = []
        for name, t in iter_tensors(meta):
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                bad.append(f"{name} ({int((~torch.isfinite(t)).sum())})")
        if not bad:
            raise
        checks.append(Check("finite weights", "fail", f"NaN/inf values in {', '.join(bad[:5])}"))
        return checks, None
    checks.append(Check("finite weights", "ok", f"{len(tensors)} tensors, no NaN/inf"))
    emb = tensors.get("embed_tokens.weight")
    tgt = target_model.embedding()
    table = emb if emb is not None else tgt.detach().cpu()
    if 0 <= spec.mask_token_id < table.shape[0] and float(table[spec.mask_token_id].float().abs().max()) == 0.0:
        # a padding row: every mask row then enters the draft as the same zero vector, and the
        # rows can no longer tell their slots apart
        checks.append(
            Check(
                "mask embedding",
                "warn",
                f"mask_token_id {spec.mask_token_id} has an all-zero embedding "
                "(a padding row?): mask rows carry no signal",
            )
        )
    if emb is not None and tuple(emb.shape) == tuple(tgt.shape):
        cos = float(torch.nn.functional.cosine_similarity(emb.float(), tgt.detach().float().cpu(), dim=-1).mean())
        st = "ok" if cos >= EMBED_COSINE_MIN else "warn"
        checks.append(
            Check(
                "embeddings",
                st,
                f"the draft's own embed_tokens vs the target's: mean cosine {cos:.3f}"
                + ("" if st == "ok" else ": trained against another target or tokenizer?"),
            )
        )
    return checks, tensors
