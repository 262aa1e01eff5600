"""Target runtimes side by side: plain greedy decoding and the cost of verification.

    dspark bench-runtime [--threads 1] [--tokens 64] [--rounds 3] [--arms ...]

On SmolLM2, batch 1, in one process with the arms alternated round by round (the machine is
shared and noisy: only a side-by-side figure means anything), it prints per arm:
- tokens/s of plain greedy decoding: transformers `generate` (bf16, fp32) and dspark's engine
  without a draft on each runtime/weight format;
- the cost of one forward of 1, 2, 4 and 8 tokens on a cache of --context tokens, and the ratio
  8 tokens / 1 token (what speculation has to pay to verify gamma+1 = 8 tokens);
- the weight format `auto` picks for this model on this machine.
Medians over the rounds; the CPU class and thread count head the table.
"""

from __future__ import annotations

import os
import platform
import statistics
import time

import torch

from dspark.errors import DSparkError
from dspark.target.hf import HFTarget
from dspark.target.load import cpu_model_and_flags, load_target
from dspark.target.native import WEIGHTS, NativeTarget

DEFAULT_ARMS = "hf-bf16,hf-fp32,native-fp32,native-bf16,native-int8,native-int4,native-auto"
PROMPT = ("Explain in a few paragraphs how a hash table works, what a collision is and how open addressing "
          "and chaining resolve it.")


def cpu_class() -> str:
    """'<model name>, <n> cores, <ISA features that decide bf16/int kernels>'."""
    name, flags = cpu_model_and_flags()
    name = name or platform.processor() or "cpu"
    feats = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8") if f in flags]
    return f"{name}, {os.cpu_count()} cores, {' '.join(feats) or 'no AVX2'}, torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()})"


def _hf_decode(model, ids: torch.Tensor, n: int) -> float:
    t = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                   pad_token_id=0, eos_token_id=None)
    return n / (time.perf_counter() - t)


def _engine_decode(target, ids: torch.Tensor, n: int) -> float:
    from dspark.engine.engine import Engine
    from dspark.engine.sampling import SamplingParams

    eng = Engine(target, None)
    t = time.perf_counter()
    req = eng.generate(ids[0].tolist(), SamplingParams(max_new_tokens=n, ignore_eos=True))
    dt = time.perf_counter() - t
    assert len(req.output_ids) == n
    return n / dt


def _verify_costs(target, context: int, sizes=(1, 2, 4, 8), reps: int = 5) -> dict[int, float]:
    """Median seconds of a forward of s tokens on a cache of `context` committed tokens (then dropped)."""
    gen = torch.Generator().manual_seed(0)
    state = target.new_state(1)
    target.forward(state, torch.randint(4, target.vocab_size, (1, context), generator=gen))
    target.commit(state, torch.tensor([context]))
    out = {}
    for s in sizes:
        x = torch.randint(4, target.vocab_size, (1, s), generator=gen)
        times = []
        for _ in range(reps + 1):
            t = time.perf_counter()
            target.forward(state, x)
            times.append(time.perf_counter() - t)
            target.commit(state, torch.zeros(1, dtype=torch.long))
        out[s] = statistics.median(times[1:])
    return out


def run(arms: list[str], threads: int, tokens: int, rounds: int, context: int) -> list[dict]:
    torch.set_num_threads(threads)
    m32, tok = load_target("smollm2", "fp32", "cpu")
    m16 = load_target("smollm2", "bf16", "cpu")[0] if any(a.endswith("bf16") and a.startswith("hf") for a in arms) else None
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
    runners = {}
    for a in arms:
        kind, _, fmt = a.partition("-")
        if kind == "hf":
            model = m16 if fmt == "bf16" else m32
            runners[a] = (model, HFTarget(model))
        elif kind == "native":
            runners[a] = (None, NativeTarget(m32, weights=fmt))
        else:
            raise DSparkError(f"unknown arm {a!r} (hf-bf16, hf-fp32, native-<{'|'.join(WEIGHTS)}>)")
    tps = {a: [] for a in arms}
    cost = {a: [] for a in arms}
    with torch.inference_mode():
        for a in arms:  # warm-up: first calls pay allocator and kernel selection
            model, target = runners[a]
            (_hf_decode(model, ids, 8) if model is not None else _engine_decode(target, ids, 8))
            _verify_costs(target, 32, reps=1)
        for r in range(rounds):
            order = arms if r % 2 == 0 else arms[::-1]  # alternate: no arm always runs first or last
            for a in order:
                model, target = runners[a]
                tps[a].append(_hf_decode(model, ids, tokens) if model is not None else _engine_decode(target, ids, tokens))
                cost[a].append(_verify_costs(target, context))
    rows = []
    for a in arms:
        t = {s: statistics.median(c[s] for c in cost[a]) for s in cost[a][0]}
        target = runners[a][1]
        rows.append({
            "arm": a,
            "runtime": "transformers generate" if a.startswith("hf") else "dspark engine, native",
            "format": getattr(target, "weights", str(target.dtype).removeprefix("torch.")),
            "head": getattr(target, "head_format", ""),
            "tokens_per_s": statistics.median(tps[a]),
            "ms": {s: 1e3 * v for s, v in t.items()},
            "verify8_over_1": t[8] / t[1],
        })
    return rows


def table(rows: list[dict], threads: int, tokens: int, context: int) -> str:
    best_hf = max((r["tokens_per_s"] for r in rows if r["arm"].startswith("hf")), default=None)
    out = [f"CPU: {cpu_class()}; torch threads {threads}; SmolLM2-135M-Instruct, batch 1, "
           f"{tokens} greedy tokens; forward costs on a {context}-token cache",
           "",
           "| arm | weights (head) | plain decode tok/s | x best HF generate | 1 tok ms | 2 tok ms | 4 tok ms | 8 tok ms | 8-token verify / 1-token step |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        x = f"{r['tokens_per_s'] / best_hf:.2f}x" if best_hf else "-"
        fmt = r["format"] + (f" ({r['head']})" if r["head"] and r["head"] != r["format"] else "")
        ms = " | ".join(f"{r['ms'][s]:.1f}" for s in (1, 2, 4, 8))
        out.append(f"| {r['arm']} | {fmt} | {r['tokens_per_s']:.1f} | {x} | {ms} | {r['verify8_over_1']:.2f}x |")
    return "\n".join(out)
