"""Tiny random targets and drafts for fast tests (no downloads)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dspark.model.factory import make_spec
from dspark.model.load import build_draft
from dspark.target.hf import HFTarget


def tiny_target(seed: int = 0, vocab: int = 96, layers: int = 4, hidden: int = 64, dtype=torch.float32):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    return LlamaForCausalLM(cfg).to(dtype).eval()


def tiny_draft(model, seed: int = 1, **kw):
    torch.manual_seed(seed)
    kw.setdefault("gamma", 4)
    kw.setdefault("num_layers", 1)
    kw.setdefault("markov_rank", 16)
    kw.setdefault("n_taps", 2)
    kw.setdefault("mask_token_id", 3)
    return build_draft(make_spec(model.config, **kw), model)


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def engine_for(model, draft=None, runtime: str = "hf", **kw):
    """An engine on `model` through the given target runtime ('hf' or 'native', fp32 weights as loaded)."""
    from dspark.engine.engine import Engine
    from dspark.target.load import make_target

    return Engine(make_target(model, runtime), draft, **kw)
