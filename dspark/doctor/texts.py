"""The text the target writes for the doctor to read the draft against."""

from __future__ import annotations

import json

import torch

from dspark.doctor.report import BUILTIN_PROMPTS, HELDOUT_PROMPTS, Text
from dspark.engine.engine import Engine
from dspark.engine.sampling import SamplingParams
from dspark.ops import argmax
from dspark.target.text import encode_prompt

# ---- text --------------------------------------------------------------------------------------


def prompt_pool(tokenizer, vocab: int, texts: list | None = None):
    """Prompts as token ids, without end: the given ones, then the built-in ones (three short
    prompts, then the held-out training set interleaved by category), then seeded random ids (a
    target without a tokenizer gets random ids from the start)."""
    if tokenizer is not None:
        chat = bool(getattr(tokenizer, "chat_template", None))
        for t in texts or ():
            yield list(t) if isinstance(t, list) else encode_prompt(tokenizer, t, chat=chat)
        for t in builtin_prompts():
            yield encode_prompt(tokenizer, t, chat=chat)
    else:
        for t in texts or ():
            if isinstance(t, list):
                yield list(t)
    g = torch.Generator().manual_seed(0)
    low = min(4, vocab - 1)  # skip the usual special ids (pad/bos/eos/unk)
    while True:
        yield torch.randint(low, vocab, (8,), generator=g).tolist()


def builtin_prompts() -> list[str]:
    by_cat: dict[str, list[str]] = {}
    if HELDOUT_PROMPTS.exists():
        for line in HELDOUT_PROMPTS.read_text(encoding="utf-8").splitlines():
            if line.strip():
                rec = json.loads(line)
                by_cat.setdefault(rec.get("category", ""), []).append(rec["prompt"])
    out, lists = list(BUILTIN_PROMPTS), list(by_cat.values())
    for i in range(max((len(v) for v in lists), default=0)):
        out += [v[i] for v in lists if i < len(v)]
    return out


def generate_texts(target, tokenizer, eos, prompts: list[list[int]], new_tokens: int, tap_indices) -> list[Text]:
    """The target's greedy text through the engine's plain decoding (an Engine without a draft),
    then one forward per text with every tap index the readings need."""
    old = target.tap_indices
    try:
        target.set_taps(())  # plain decoding needs no features
        plain = Engine(target, None, tokenizer, eos, max_batch=len(prompts))
        reqs = plain.generate_many(prompts, SamplingParams(max_new_tokens=new_tokens))
        target.set_taps(tuple(tap_indices))
        texts = []
        with torch.inference_mode():
            for prompt, req in zip(prompts, reqs):
                ids = torch.tensor([prompt + req.output_ids], device=target.device)
                logits, taps = target.forward(target.new_state(1), ids)
                H = target.hidden_size
                per_tap = {i: taps[0, :, j * H : (j + 1) * H] for j, i in enumerate(target.tap_indices)}
                texts.append(Text(ids[0], len(prompt), argmax(logits[0]), per_tap))
    finally:
        target.set_taps(old)
    return texts
