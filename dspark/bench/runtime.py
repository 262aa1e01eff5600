"""Target runtimes side by side: plain greedy decoding and the cost of verification.

    dspark bench-runtime [--target T] [--threads 1] [--tokens 64] [--rounds 3] [--arms ...]
    dspark bench ... --runtimes ARMS     (the same table inside a bench run's results)

On one target (SmolLM2 by default), batch 1, in one process with the arms alternated round by
round (the machine is shared and noisy: only a side-by-side figure means anything), per arm:
- tokens/s of plain greedy decoding: transformers `generate` (bf16, fp32) and dspark's engine
  without a draft on each runtime/weight format, with the engine's overhead (the share of its
  wall time spent outside target forwards);
- optionally (arm `llamacpp`, when llama-cpp-python is installed), llama.cpp's own greedy decoding
  of the target's GGUF file: the native-code bar (dspark.bench.llamacpp);
- the cost of one forward of 1, 2, 4 and 8 tokens on a cache of --context tokens, and the ratio
  8 tokens / 1 token (what speculation has to pay to verify gamma+1 = 8 tokens);
- the weight format `auto` picks for this model on this machine;
- with a draft (the bundled one for SmolLM2; `draft=None` for none), on the native arms: one
  drafting phase of 1, 2 and 3 slots timed right after a target step, as decoding meets it (the
  context update of two committed positions included, `step.draft_phase_seconds`), and its ratio
  to the arm's 1-token step: what a drafted slot must win back.
Medians over the rounds (forward costs: each round's fastest, sizes interleaved); the CPU class and
thread count head the table.
"""

from __future__ import annotations

import os
import platform
import statistics

import torch

from dspark import kernels
from dspark.bench import llamacpp
from dspark.bench.runner import ForwardTimer
from dspark.engine.costs import forward_times
from dspark.engine.drafting import draft_phase_seconds, target_step
from dspark.engine.engine import Engine
from dspark.engine.sampling import SamplingParams
from dspark.engine.timing import now
from dspark.errors import DSparkError
from dspark.model import fast
from dspark.model.draft import DSparkDraft
from dspark.model.load import load_draft
from dspark.target.hf import HFTarget
from dspark.target.load import SMOLLM2, cpu_model_and_flags, load_target
from dspark.target.native import NativeTarget
from dspark.target.quant import WEIGHTS

DEFAULT_ARMS = "hf-bf16,hf-fp32,native-fp32,native-bf16,native-int8,native-int4,native-auto,native-auto@torch"
LLAMACPP = llamacpp.ARM  # optional: llama.cpp decoding the target's GGUF file (dspark.bench.llamacpp)
DRAFT_DEPTHS = (1, 2, 3)
PROMPT = (
    "Explain in a few paragraphs how a hash table works, what a collision is and how open addressing "
    "and chaining resolve it."
)


PREFILL = (512, 2000)  # prompt lengths whose prefill the arms time by default


def cpu_class() -> str:
    """'<model name>, <n> cores, <ISA features that decide bf16/int kernels>'."""
    name, flags = cpu_model_and_flags()
    name = name or platform.processor() or "cpu"
    feats = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8") if f in flags]
    isa = torch.backends.cpu.get_cpu_capability()
    return f"{name}, {os.cpu_count()} cores, {' '.join(feats) or 'no AVX2'}, torch {torch.__version__} ({isa})"


def _prompt_ids(tok) -> torch.Tensor:
    if getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_tensors="pt"
        )
        return ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
    return torch.tensor([tok.encode(PROMPT)])


def _hf_decode(model, ids: torch.Tensor, n: int, device) -> float:
    ids = ids.to(device)
    t = now(device)
    model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    return n / (now(device) - t)


def _engine_decode(target, ids: torch.Tensor, n: int, timer: ForwardTimer, device) -> tuple[float, float]:
    """(tokens/s, engine overhead: the share of the wall time outside target forwards)."""
    eng = Engine(target, None)
    before = timer.seconds
    t = now(device)
    req = eng.generate(ids[0].tolist(), SamplingParams(max_new_tokens=n, ignore_eos=True))
    dt = now(device) - t
    if len(req.output_ids) != n:
        raise DSparkError(f"the engine wrote {len(req.output_ids)} tokens, asked for {n}")
    return n / dt, max(0.0, 1.0 - (timer.seconds - before) / dt)


def _verify_costs(target, context: int, sizes=(1, 2, 4, 8), reps: int = 5) -> dict[int, float]:
    """Fastest seconds of a forward of s tokens on a cache of `context` committed tokens (then dropped):
    s = 1 a greedy plain step, s > 1 a greedy verify of s tokens, both reading the target's argmax
    alone, the sizes taking turns within each rep, as the engine's cost curve times them
    (`costs.forward_times`; load from other processes only ever adds time)."""
    return {s: min(ts) for s, ts in forward_times(target, list(sizes), repeats=reps, context=context).items()}


def _prefill_seconds(model, target, ids: torch.Tensor, device) -> float:
    """Seconds of one forward over a whole prompt `ids` [1, n] from an empty cache, only the last
    position's logits made (what a prompt costs before its first token): transformers' own model
    (`logits_to_keep=1`) where `model` is given, else dspark's target (`forward_last`)."""
    t = now(device)
    if model is not None:
        model(ids.to(device), logits_to_keep=1, use_cache=True)
    else:
        target.forward_last(target.new_state(1), ids.to(device))
    return now(device) - t


def arm_kind(arm: str) -> tuple[str, str]:
    """'native-int4' -> ('native', 'int4'); 'llamacpp' -> ('llamacpp', 'gguf'); an unknown arm is refused by name."""
    if arm == LLAMACPP:
        return LLAMACPP, "gguf"
    base, at, kernel = arm.partition("@")  # native-<weights>@torch: torch's ops, not dspark's kernels
    kind, _, fmt = base.partition("-")
    if not (
        (kind == "hf" and fmt in ("bf16", "fp32") and not at)
        or (kind == "native" and fmt in WEIGHTS and kernel in (("torch",) if at else ("",)))
    ):
        raise DSparkError(
            f"unknown runtime arm {arm!r} (hf-bf16, hf-fp32, native-<{'|'.join(WEIGHTS)}>, "
            f"native-<weights>@torch for torch's ops instead of dspark's kernels, {LLAMACPP})"
        )
    return kind, fmt


def parse_arms(text: str) -> list[str]:
    """'hf-bf16,native-auto' -> the arm names, refused by name when unknown or not installed
    (before anything loads)."""
    arms = [a.strip() for a in text.split(",") if a.strip()]
    for a in arms:
        if arm_kind(a)[0] == LLAMACPP:
            llamacpp.check_installed()
    if not arms or len(set(arms)) != len(arms):
        raise DSparkError(f"runtime arms {text!r}: give each arm once, at least one")
    return arms


class _TorchArm:
    """transformers `generate` (model given) or dspark's engine without a draft (model None) on `target`."""

    def __init__(self, model, target, timer: ForwardTimer, device):
        self.model, self.target, self.timer, self.device = model, target, timer, device
        self.runtime = "transformers generate" if model is not None else "dspark engine, native"
        self.format = getattr(target, "weights", str(target.dtype).removeprefix("torch."))
        if self.format == "int4":  # which int4 kernel: the arms compare them
            ly = target.layers[0].w13
            ours = ly.q4 is not None
            self.format = f"int4, {'dspark' if ours else 'torch'} kernel{kernels.q4_note() if ours else ''}"
        self.head = getattr(target, "head_format", "")

    def decode(self, ids: list[int], n: int) -> tuple[float, float | None]:
        if self.model is not None:
            return _hf_decode(self.model, torch.tensor([ids]), n, self.device), None
        return _engine_decode(self.target, torch.tensor([ids]), n, self.timer, self.device)

    def forward_costs(self, context: int, reps: int = 5) -> dict[int, float]:
        return _verify_costs(self.target, context, reps=reps)

    def prefill(self, ids: torch.Tensor) -> float:
        return _prefill_seconds(self.model, self.target, ids, self.device)

    def close(self) -> None:
        pass


def _draft_phases(draft, target, reps: int = 5) -> dict[int, float]:
    """Seconds of one drafting phase of each depth, after a step of `target` (the least of reps)."""
    step = target_step(target)
    return {d: draft_phase_seconds(draft, evict=step, depth=d, reps=reps) for d in DRAFT_DEPTHS}


def run(
    arms: list[str],
    threads: int,
    tokens: int,
    rounds: int,
    context: int,
    target: str = SMOLLM2,
    device: str = "cpu",
    draft: str | None = None,
    draft_weights: str = "auto",
    prefill: tuple[int, ...] | None = (),
) -> list[dict]:
    """Each arm's plain decode tokens/s, forward costs (1-8 tokens on a `context` cache), drafting
    phase, and prefill tokens/s of a prompt of each `prefill` length (None: PREFILL, those the
    target holds; arms without a prefill measurement, llama.cpp's, leave it out); rounds alternate
    the arms' order."""
    torch.set_num_threads(threads)
    m32, tok = load_target(target, "fp32", device)
    if tok is None:
        raise DSparkError(f"target {target!r} has no tokenizer: the runtime arms decode a text prompt")
    m16 = load_target(target, "bf16", device)[0] if any(a == "hf-bf16" for a in arms) else None
    ids = _prompt_ids(tok)[0].tolist()
    if context + 8 + 1 > m32.config.max_position_embeddings:
        raise DSparkError(
            f"--context {context} does not fit the target's {m32.config.max_position_embeddings} positions"
        )
    if prefill is None:
        prefill = tuple(n for n in PREFILL if n <= m32.config.max_position_embeddings)
    too_long = [n for n in prefill if not 0 < n <= m32.config.max_position_embeddings]
    if too_long:
        raise DSparkError(
            f"--prefill {','.join(map(str, too_long))}: a prompt must have 1 to the target's "
            f"{m32.config.max_position_embeddings} positions"
        )
    gen = torch.Generator().manual_seed(0)
    prompts = {n: torch.randint(4, m32.config.vocab_size, (1, n), generator=gen) for n in prefill}
    timer = ForwardTimer(m32, device)  # native targets: their forward; hf-fp32 engine arms: the module
    runners: dict[str, _TorchArm | llamacpp.LlamaCppArm] = {}
    natives: dict[str, NativeTarget] = {}  # the native arms' targets (their drafts run after their steps)
    drafts: dict[torch.dtype, DSparkDraft] = {}
    try:
        for a in arms:
            kind, fmt = arm_kind(a)
            if kind == "hf":
                model = m16 if fmt == "bf16" else m32
                runners[a] = _TorchArm(model, HFTarget(model), timer, device)
            elif kind == "native":
                kernel = "torch" if a.endswith("@torch") else "auto"
                natives[a] = NativeTarget(m32, weights=fmt, ops=kernel)
                runners[a] = _TorchArm(None, natives[a], timer, device)
                if draft is not None:  # one draft per activation dtype, shared by the arms of that dtype
                    dt = natives[a].dtype
                    if dt not in drafts:
                        drafts[dt] = load_draft(draft, m32, dtype=dt)
                        fast.set_weights(drafts[dt], draft_weights)
            else:
                runners[a] = llamacpp.LlamaCppArm(target, threads, n_ctx=max(len(ids) + tokens, context + 8) + 16)
        tps: dict[str, list[float]] = {a: [] for a in arms}
        over: dict[str, list[float]] = {a: [] for a in arms}
        cost: dict[str, list[dict[int, float]]] = {a: [] for a in arms}
        phase: dict[str, list[dict[int, float]]] = {a: [] for a in arms}
        pre: dict[str, list[dict[int, float]]] = {a: [] for a in arms}
        drafted = {a: drafts.get(natives[a].dtype) if arm_kind(a)[0] == "native" else None for a in arms}
        # the arms whose prefill is timed (llama.cpp's has no such measurement)
        prefills = {a: r for a, r in runners.items() if isinstance(r, _TorchArm)} if prompts else {}
        with torch.inference_mode():
            for a in arms:  # warm-up: first calls pay allocator and kernel selection
                runners[a].decode(ids, 8)
                runners[a].forward_costs(32, reps=1)
                if drafted[a] is not None:
                    _draft_phases(drafted[a], natives[a], reps=1)
                if a in prefills:
                    prefills[a].prefill(prompts[min(prompts)][:, :64])
            for r in range(rounds):
                order = arms if r % 2 == 0 else arms[::-1]  # alternate: no arm always runs first or last
                for a in order:
                    rate, o = runners[a].decode(ids, tokens)
                    tps[a].append(rate)
                    if o is not None:
                        over[a].append(o)
                    cost[a].append(runners[a].forward_costs(context))
                    if drafted[a] is not None:
                        phase[a].append(_draft_phases(drafted[a], natives[a]))
                    if a in prefills:
                        pre[a].append({n: prefills[a].prefill(p) for n, p in prompts.items()})
    finally:
        timer.close()
        for arm in runners.values():
            arm.close()
    rows = []
    for a in arms:
        t = {s: statistics.median(c[s] for c in cost[a]) for s in cost[a][0]}
        rows.append(
            {
                "arm": a,
                "runtime": runners[a].runtime,
                "format": runners[a].format,
                "head": runners[a].head,
                "tokens_per_s": statistics.median(tps[a]),
                "engine_overhead": statistics.median(over[a]) if over[a] else None,
                "ms": {s: 1e3 * v for s, v in t.items()},
                "verify8_over_1": t[8] / t[1],
            }
        )
        if pre[a]:  # each length's fastest round (load from other processes only adds time)
            rows[-1]["prefill_tok_s"] = {n: n / min(x[n] for x in pre[a]) for n in prefill}
        if phase[a]:
            p = {d: statistics.median(x[d] for x in phase[a]) for d in DRAFT_DEPTHS}
            rows[-1]["draft"] = fast.describe(drafted[a])
            rows[-1]["draft_ms"] = {d: 1e3 * v for d, v in p.items()}
            # each round's phase against that round's step (the host drifts between rounds)
            rows[-1]["draft_over_step"] = statistics.median(x[1] / c[1] for x, c in zip(phase[a], cost[a]))
    return rows


def table(rows: list[dict], threads: int, tokens: int, context: int, target: str = SMOLLM2) -> str:
    best_hf = max((r["tokens_per_s"] for r in rows if r["arm"].startswith("hf")), default=None)
    name = "SmolLM2-135M-Instruct" if target == SMOLLM2 else target
    out = [
        f"CPU: {cpu_class()}; torch threads {threads}; {name}, batch 1, "
        f"{tokens} greedy tokens; forward costs on a {context}-token cache",
        "",
        "| arm | weights (head) | plain decode tok/s | x best HF generate | engine overhead "
        "| 1 tok ms | 2 tok ms | 4 tok ms | 8 tok ms | 8-token verify / 1-token step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        x = f"{r['tokens_per_s'] / best_hf:.2f}x" if best_hf else "-"
        fmt = r["format"] + (f" ({r['head']})" if r["head"] and r["head"] != r["format"] else "")
        ms = " | ".join(f"{r['ms'][s]:.1f}" for s in (1, 2, 4, 8))
        ov = "-" if r["engine_overhead"] is None else f"{100 * r['engine_overhead']:.1f}%"
        out.append(f"| {r['arm']} | {fmt} | {r['tokens_per_s']:.1f} | {x} | {ov} | {ms} | {r['verify8_over_1']:.2f}x |")
    prefilled = [r for r in rows if "prefill_tok_s" in r]
    if prefilled:
        lengths = sorted(prefilled[0]["prefill_tok_s"])
        ref = next((r["prefill_tok_s"] for r in prefilled if r["arm"] == "hf-bf16"), None)
        out += [
            "",
            "Prefill (one forward over a prompt from an empty cache, last position's logits), tokens/s"
            + (" and x transformers bf16:" if ref else ":"),
            "",
            "| arm | " + " | ".join(f"{n} tokens" for n in lengths) + " |",
            "|---|" + "---|" * len(lengths),
        ]
        for r in prefilled:
            cells = [
                f"{r['prefill_tok_s'][n]:.0f}" + (f" ({r['prefill_tok_s'][n] / ref[n]:.2f}x)" if ref else "")
                for n in lengths
            ]
            out.append(f"| {r['arm']} | " + " | ".join(cells) + " |")
    drafted = [r for r in rows if "draft_ms" in r]
    if drafted:
        out += [
            "",
            f"Draft phase after a target step ({drafted[0]['draft']}):",
            "",
            "| arm | 1 slot ms | 2 slots ms | 3 slots ms | 1-slot phase / 1-token step |",
            "|---|---|---|---|---|",
        ]
        for r in drafted:
            ms = " | ".join(f"{r['draft_ms'][d]:.2f}" for d in DRAFT_DEPTHS)
            out.append(f"| {r['arm']} | {ms} | {r['draft_over_step']:.2f}x |")
    return "\n".join(out)
