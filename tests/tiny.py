"""Tiny random targets and drafts for fast tests (no downloads)."""

from __future__ import annotations

import torch
from dspark.model.factory import make_spec
from dspark.model.load import build_draft
from transformers import LlamaConfig, LlamaForCausalLM

# a tiny decoder of any family (LlamaConfig, Qwen2Config, ...: their shared fields)
FAMILY_SIZES = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def tiny_target(seed: int = 0, vocab: int = 96, layers: int = 4, hidden: int = 64, dtype=torch.float32):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
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
    return out[0, len(prompt) :].tolist()


def engine_for(model, draft=None, runtime: str = "hf", **kw):
    """An engine on `model` through the given target runtime ('hf' or 'native', fp32 weights as loaded)."""
    from dspark.engine.engine import Engine
    from dspark.target.load import make_target

    return Engine(make_target(model, runtime), draft, **kw)


def bigram_draft(engine, extra_prompts=(), **kw):
    """A draft whose Markov head is the greedy bigram table of `engine`'s target: it accepts
    whole blocks inside the target's loops and fails at their edges (every partial accept)."""
    from dspark.engine.sampling import SamplingParams

    model = engine.target.model
    V = model.config.vocab_size
    draft = tiny_draft(model, markov_rank=V, **kw)
    gen = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(4, V, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(16)
    ]
    prompts = list(extra_prompts) + prompts
    counts = torch.zeros(V, V)
    for p, r in zip(prompts, engine.generate_many(prompts, SamplingParams(max_new_tokens=24))):
        seq = p + r.output_ids
        for a, b in zip(seq, seq[1:]):
            counts[a, b] += 1
    with torch.no_grad():
        draft.markov_head.markov_w1.weight.copy_(torch.eye(V) * 10)
        draft.markov_head.markov_w2.weight.copy_(torch.nn.functional.one_hot(counts.argmax(1), V).float().T * 10)
    return draft


def q4_exact(model):
    """Every decoder linear made exactly 4-bit groups of 32, as a Q4 GGUF dequantises (in place)."""
    with torch.no_grad():
        for layer in model.model.layers:
            for m in (*layer.self_attn.children(), *layer.mlp.children()):
                if isinstance(m, torch.nn.Linear):
                    w = m.weight.reshape(m.weight.shape[0], -1, 32)
                    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
                    q = ((w - lo) / ((hi - lo) / 15)).round()
                    m.weight.copy_((q * ((hi - lo) / 15) + lo).reshape_as(m.weight))
    return model
