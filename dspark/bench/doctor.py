"""`dspark doctor`: does this draft really predict this target the way its file says?

The silent failures of docs/DESIGN.md §9 all load, run and accept almost nothing. Reading
the config cannot catch them; measuring can. The target generates a few dozen tokens itself
(greedy), one target forward over that text gives its logits and the hidden states at every
tap index needed, and for each *reading* of the draft (the declared one; the other block
layout; hidden_state_indices shifted by -1 and +1; other mask token ids) one batched draft
forward over all anchors gives teacher-forced predictions: slot k of the block anchored at
token t, with the true tokens before it as Markov input, against the target's argmax at t+k.
Under greedy decoding that is exactly what verification accepts, so the prefix agreement is
the acceptance the engine would see on this text.

The declared reading is "clearly worse" than an alternative when the alternative wins on
the same (anchor, slot) pairs by a paired sign test with z >= 3 (McNemar) and by at least
0.05 of mean per-slot agreement: noise cannot produce that, a misread file does.

`quick_check(engine)` runs the same measurement on one short prompt at load time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from dspark.errors import FormatError
from dspark.formats.load import force_layout, load_spec, load_weights
from dspark.formats.weights import WeightsMeta, iter_tensors
from dspark.model.load import build_draft, check_compatible
from dspark.target.text import encode_prompt

EXIT_UNHEALTHY = 3
Z_MIN = 3.0  # paired sign-test z an alternative needs to be called better
MIN_GAIN = 0.05  # and its mean per-slot agreement gain
LOW_AGREEMENT = 0.05  # below this under every reading: the draft barely predicts this target
EMBED_COSINE_MIN = 0.9  # a draft's own embed_tokens copy should be the target's
MAX_MASK_ALTERNATIVES = 3

BUILTIN_PROMPTS = (
    "Explain step by step how to compute 17 times 23.",
    "Write a short Python function that checks whether a number is prime.",
    "Describe a sunny day at the beach in a few sentences.",
)
_PRETTY = {"anchor_first": "anchor-first", "bonus_anchor": "bonus-anchor"}


# ---- data ------------------------------------------------------------------------------------

@dataclass
class Text:
    """One target-generated sequence and what one target forward over it yields."""

    ids: object  # [T] long
    prompt_len: int
    argmax: object  # [T] target argmax at each position (predicts position + 1)
    taps: dict  # tap index -> [T, H] hidden state (input of that layer)


FACTORS = ("layout", "hidden_state_indices", "mask_token_id")


@dataclass
class Reading:
    """One way of reading the draft: the declared DraftSpec with some of FACTORS changed."""

    spec: object
    shift: int = 0  # hidden_state_indices = declared + shift
    factors: tuple[str, ...] = ()  # which FACTORS differ from the declared reading
    agree: object = None  # [N, gamma] bool over all anchors of all texts

    @property
    def name(self) -> str:
        parts = {"layout": _PRETTY[self.spec.layout], "hidden_state_indices": f"taps{self.shift:+d}",
                 "mask_token_id": f"mask={self.spec.mask_token_id}"}
        return " ".join(parts[f] for f in self.factors) or "declared"

    @property
    def per_slot(self) -> list[float]:
        return self.agree.float().mean(0).tolist() if self.agree.numel() else []

    @property
    def agreement(self) -> float:
        return float(self.agree.float().mean()) if self.agree.numel() else 0.0

    @property
    def accept_length(self) -> float:
        """1 + mean accepted prefix: the greedy acceptance length on this text."""
        return 1.0 + float(self.agree.long().cumprod(1).sum(1).float().mean()) if self.agree.numel() else 1.0


@dataclass
class Check:
    name: str
    status: str  # "ok" | "warn" | "fail"
    detail: str


@dataclass
class Report:
    target: str
    draft: str
    declared: object  # DraftSpec
    checks: list[Check] = field(default_factory=list)
    readings: list[Reading] = field(default_factory=list)
    comparisons: dict = field(default_factory=dict)  # reading name -> {"z", "gain", "better"}
    diagnoses: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    texts: dict = field(default_factory=dict)
    best: Reading | None = None  # the reading that explains a misread file

    @property
    def healthy(self) -> bool:
        return not self.diagnoses and not any(c.status == "fail" for c in self.checks)

    def exit_code(self, strict: bool = False) -> int:
        if not self.healthy or (strict and (self.warnings or any(c.status == "warn" for c in self.checks))):
            return EXIT_UNHEALTHY
        return 0

    def to_json(self, strict: bool = False) -> dict:
        s = self.declared
        return {
            "target": self.target,
            "draft": self.draft,
            "declared": {"format": s.format, "layout": s.layout, "layout_source": s.layout_source, "gamma": s.gamma,
                         "block_size": s.block_size, "hidden_state_indices": list(s.hidden_state_indices),
                         "mask_token_id": s.mask_token_id},
            "text": self.texts,
            "checks": [vars(c) for c in self.checks],
            "readings": [
                {"name": r.name, "changes": list(r.factors), "layout": r.spec.layout, "gamma": r.spec.gamma,
                 "hidden_state_indices": list(r.spec.hidden_state_indices), "mask_token_id": r.spec.mask_token_id,
                 "per_slot_agreement": [round(x, 4) for x in r.per_slot], "agreement": round(r.agreement, 4),
                 "teacher_forced_accept_length": round(r.accept_length, 4),
                 **({"vs_declared": self.comparisons[r.name]} if r.name in self.comparisons else {})}
                for r in self.readings
            ],
            "explained_by": self.best.name if self.best is not None else None,
            "diagnoses": self.diagnoses,
            "warnings": self.warnings,
            "healthy": self.healthy,
            "exit_code": self.exit_code(strict),
        }


# ---- measurement -------------------------------------------------------------------------------

def prompt_ids(tokenizer, vocab: int, n: int, texts: list[str] | None = None) -> list[list[int]]:
    """Chat-formatted built-in prompts; seeded random ids for a target without a tokenizer."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(0)
        low = min(4, vocab - 1)  # skip the usual special ids (pad/bos/eos/unk)
        return [torch.randint(low, vocab, (8,), generator=g).tolist() for _ in range(n)]
    texts = list(texts or BUILTIN_PROMPTS[:n])
    out = []
    for t in texts:
        out.append(encode_prompt(tokenizer, t, chat=bool(getattr(tokenizer, "chat_template", None))))
    return out


def generate_texts(target, prompts: list[list[int]], new_tokens: int, stop_ids, tap_indices) -> list[Text]:
    """Greedy target text, then one forward over it with every tap index the readings need."""
    texts = []
    old_taps = target.tap_indices
    try:
        with torch.inference_mode():
            for prompt in prompts:
                target.set_taps(())  # generation needs no features
                state = target.new_state(1)
                x = torch.tensor([prompt], device=target.device)
                gen: list[int] = []
                for _ in range(new_tokens):
                    logits, _ = target.forward(state, x)
                    target.commit(state, torch.tensor([x.shape[1]], device=target.device))
                    tok = int(logits[0, -1].argmax())
                    gen.append(tok)
                    if tok in stop_ids:
                        break
                    x = torch.tensor([[tok]], device=target.device)
                target.set_taps(tuple(tap_indices))
                ids = torch.tensor([prompt + gen], device=target.device)
                logits, taps = target.forward(target.new_state(1), ids)
                H = target.hidden_size
                per_tap = {i: taps[0, :, j * H : (j + 1) * H] for j, i in enumerate(target.tap_indices)}
                texts.append(Text(ids[0], len(prompt), logits[0].argmax(-1), per_tap))
    finally:
        target.set_taps(old_taps)
    return texts


def anchors_of(text: Text, g_max: int):
    """Anchor positions whose every slot (up to g_max) lands on a generated token with a target argmax."""
    T = int(text.ids.shape[0])
    return torch.arange(text.prompt_len, max(text.prompt_len, T - g_max + 1), device=text.ids.device)


def draft_states(draft, taps: tuple[int, ...], mask_id: int, query_slots: int, text: Text, anchors):
    """One batched draft forward over all anchors of a text: block states h [N, S, H].

    The context is the whole text's features once; each anchor's row sees only the positions
    before it (the draft's own context mask), exactly what decoding at that anchor sees.
    """
    dev, dtype = draft.fc.weight.device, draft.fc.weight.dtype
    ids = text.ids.to(dev)
    feats = torch.cat([text.taps[i] for i in taps], dim=-1)[None].to(dev, dtype)
    ctx = draft.context_kv(feats, torch.arange(ids.shape[0], device=dev)[None])
    block = torch.full((anchors.shape[0], query_slots), mask_id, dtype=torch.long, device=dev)
    block[:, 0] = ids[anchors]
    return draft(block, ctx, anchors.to(dev))


def read_rows(draft, spec, h, text: Text, anchors, base: dict | None = None):
    """[N, spec.gamma] bool: draft argmax == target argmax per anchor and slot, rows read as `spec` says.

    Mirrors the engine's `propose` row for row (same rows, same Markov recurrence), with the
    true previous tokens as Markov input instead of sampled ones. `base`: row -> lm_head(h[:, row])
    already computed (the LM head over the whole vocabulary is most of the cost).
    """
    dev = h.device
    ids = text.ids.to(dev)
    N, g, rows = anchors.shape[0], spec.gamma, spec.sampled_rows
    pos = anchors.to(dev)[:, None] + torch.arange(g, device=dev)[None, :]  # slot k: Markov input t+k, target argmax at t+k
    prev, want = ids[pos], text.argmax.to(dev)[pos]
    mh = draft.markov_head
    state = mh.init_state(N, h) if mh is not None else None
    if mh is not None and mh.head_type == "rnn" and rows.start == 1:
        _, _, state = mh.step(ids[anchors.to(dev)], h[:, 0], state)
    agree = torch.zeros(N, g, dtype=torch.bool, device=dev)
    for k, row in enumerate(rows):
        logits = base[row] if base is not None and row in base else draft.lm_head(h[:, row])
        if mh is not None:
            bias, _, state = mh.step(prev[:, k], h[:, row], state)
            logits = logits + bias
        agree[:, k] = draft.to_target_vocab(logits.float()).argmax(-1) == want[:, k]
    return agree.cpu()


def readings_for(spec, num_layers: int, mask_candidates: list[int], full_grid: bool = True) -> list[Reading]:
    """Every combination of layout (declared, other) x taps (declared, -1, +1) x mask (declared, others).

    Combinations, not only single changes: a file wrong in two ways scores near zero under
    every single change and would otherwise pass as "just a bad draft". Declared first.
    full_grid=False (the load-time check) keeps single changes plus layout x taps, the two
    misreads that come from the same format confusion.
    """
    other = "bonus_anchor" if spec.layout == "anchor_first" else "anchor_first"
    layouts = [spec]
    if other == "anchor_first" or spec.block_size >= 2:
        layouts.append(replace(force_layout(spec, other), layout_source=spec.layout_source, warnings=spec.warnings))
    shifts = [0] + [d for d in (-1, +1) if all(0 <= i + d <= num_layers for i in spec.hidden_state_indices)]
    out = []
    for li, lay in enumerate(layouts):
        for d in shifts:
            for m in [spec.mask_token_id, *mask_candidates]:
                taps = tuple(i + d for i in spec.hidden_state_indices)
                factors = tuple(f for f, changed in zip(FACTORS, (li > 0, d != 0, m != spec.mask_token_id)) if changed)
                if not full_grid and len(factors) > 1 and "mask_token_id" in factors:
                    continue
                out.append(Reading(replace(lay, hidden_state_indices=taps, mask_token_id=m), d, factors))
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


def paired(base: Reading, alt: Reading) -> dict:
    """Sign test of alt against base on the (anchor, slot) pairs both predict (the common first slots)."""
    g = min(base.agree.shape[1], alt.agree.shape[1])
    a, b = base.agree[:, :g], alt.agree[:, :g]
    wins, losses = int((b & ~a).sum()), int((a & ~b).sum())
    z = (wins - losses) / math.sqrt(wins + losses) if wins + losses else 0.0
    gain = alt.agreement - base.agreement
    return {"wins": wins, "losses": losses, "z": round(z, 2), "gain": round(gain, 4),
            "better": z >= Z_MIN and gain >= MIN_GAIN}


def explain(readings: list[Reading]) -> Reading | None:
    """The reading that explains a misread file with the fewest changes, or None when declared is fine.

    Take the best reading; then undo each change that is not needed (undoing it does not make
    the reading clearly worse): under a wrong layout every mask id scores near zero, and noise
    must not turn that into a second "finding".
    """
    declared = readings[0]
    best = max(readings, key=lambda r: r.agreement)
    if best is declared or not paired(declared, best)["better"]:
        return None

    def key(r):
        return (r.spec.layout, r.shift, r.spec.mask_token_id)

    by_key = {key(r): r for r in readings}
    undo = {"layout": lambda r: (declared.spec.layout, r.shift, r.spec.mask_token_id),
            "hidden_state_indices": lambda r: (r.spec.layout, 0, r.spec.mask_token_id),
            "mask_token_id": lambda r: (r.spec.layout, r.shift, declared.spec.mask_token_id)}
    changed = True
    while changed:
        changed = False
        for f in best.factors:
            simpler = by_key[undo[f](best)]
            if not paired(simpler, best)["better"]:
                best, changed = simpler, True
                break
    return best if best is not declared else None


def _says(spec) -> str:
    return "--layout forces" if spec.layout_source == "forced" else "the file says"


def diagnosis(declared: Reading, best: Reading, factor: str) -> str:
    d, a = declared.spec, best.spec
    nums = f"per-slot agreement {declared.agreement:.2f} vs {best.agreement:.2f}"
    if len(best.factors) > 1:
        nums += f" (with {best.name} all together)"
    if factor == "layout":
        return (f"{_says(d)} {_PRETTY[d.layout]} but the weights behave like {_PRETTY[a.layout]}: {nums}; "
                f"teacher-forced acceptance length {declared.accept_length:.2f} vs {best.accept_length:.2f}. "
                f"Force it with --layout {a.layout} or fix the layout keys of config.json (docs/DESIGN.md §3)")
    if factor == "hidden_state_indices":
        return (f"{_says(d)} hidden_state_indices {list(d.hidden_state_indices)} but the weights behave like "
                f"{list(a.hidden_state_indices)} (shifted by {best.shift:+d}: DeepSpec target_layer_ids t are "
                f"speculators aux_hidden_state_layer_ids t+1, an off-by-one in the file): {nums}")
    return f"{_says(d)} mask_token_id {d.mask_token_id} but the weights behave like mask_token_id {a.mask_token_id}: {nums}"


def measure(target, draft, tokenizer, *, prompts: list[list[int]], new_tokens: int, stop_ids, extra_masks=(),
            report: Report | None = None, full_grid: bool = True) -> Report:
    """Generate, measure every reading, and explain a declared reading that is clearly worse."""
    spec = draft.spec
    report = report or Report("", spec.path or "", spec)
    cands = mask_candidates(spec, tokenizer, target.config, target.vocab_size, extra_masks)
    readings = readings_for(spec, target.num_layers, cands, full_grid)
    taps = sorted({i for r in readings for i in r.spec.hidden_state_indices})
    texts = generate_texts(target, prompts, new_tokens, set(stop_ids), taps)
    g_max = max(r.spec.gamma for r in readings)
    per_text = [(t, a) for t in texts if (a := anchors_of(t, g_max)).numel()]
    n_anchors = sum(int(a.numel()) for _, a in per_text)
    report.texts = {"prompts": len(texts), "generated_tokens": sum(int(t.ids.shape[0]) - t.prompt_len for t in texts),
                    "anchors": n_anchors}
    if n_anchors == 0:
        report.warnings.append(f"the target generated too few tokens for a block of {g_max}: nothing measured "
                               "(raise --tokens or give longer prompts)")
        return report
    parts: dict[int, list] = {id(r): [] for r in readings}
    with torch.inference_mode():
        for text, anchors in per_text:
            # layouts share the block (same query_slots): one forward per (taps, mask)
            for (shift, mask), group in _group(readings).items():
                h = draft_states(draft, group[0].spec.hidden_state_indices, mask, spec.query_slots, text, anchors)
                base = {row: draft.lm_head(h[:, row]) for row in sorted({i for r in group for i in r.spec.sampled_rows})}
                for r in group:
                    parts[id(r)].append(read_rows(draft, r.spec, h, text, anchors, base))
    for r in readings:
        r.agree = torch.cat(parts[id(r)])
    report.readings = readings
    declared = readings[0]
    report.comparisons = {r.name: paired(declared, r) for r in readings[1:]}
    best = explain(readings)
    if best is not None:
        report.best = best
        report.diagnoses = [diagnosis(declared, best, f) for f in best.factors]
    top = max(r.agreement for r in readings)
    if best is None and top < LOW_AGREEMENT:
        report.warnings.append(
            f"the draft agrees with the target on {top:.2f} of slots under every reading tried: an untrained draft, "
            "a draft for another target, or a mismatch this doctor does not vary (RoPE settings, dtype)")
    return report


def _group(readings: list[Reading]) -> dict:
    groups: dict = {}
    for r in readings:
        groups.setdefault((r.shift, r.spec.mask_token_id), []).append(r)
    return groups


# ---- static checks -----------------------------------------------------------------------------

def static_checks(spec, target_model, tokenizer, run_dtype) -> tuple[list[Check], dict | None]:
    """Vocabulary, dtype and finiteness of the stored weights. Returns (checks, tensors or None)."""
    checks: list[Check] = []
    vocab = target_model.get_output_embeddings().weight.shape[0]
    try:
        check_compatible(spec, target_model)
        checks.append(Check("vocabulary", "ok", f"draft vocab {spec.vocab_size} (draft head {spec.draft_vocab_size}) "
                                                f"= target vocab {vocab}; mask_token_id {spec.mask_token_id} in range"))
    except FormatError as exc:
        checks.append(Check("vocabulary", "fail", str(exc)))
    if tokenizer is not None:
        n = len(tokenizer)
        st = "ok" if n <= vocab else "fail"
        checks.append(Check("tokenizer", st, f"tokenizer has {n} tokens, target vocabulary {vocab}"
                            + ("" if st == "ok" else ": token ids past the vocabulary")))
    if spec.verifier:
        checks.append(Check("verifier", "ok", f"the draft names its verifier {spec.verifier!r} (not compared: "
                                              "names differ between hubs and local copies)"))

    meta = WeightsMeta.from_dir(Path(spec.path)) if spec.path else None
    if meta is None:
        checks.append(Check("weights", "fail", f"no weights found for {spec.path}"))
        return checks, None
    floats = {"F32", "F16", "BF16", "F64"}
    maps = {"d2t", "t2d"}
    kinds = sorted({i.dtype for n, i in meta.infos.items() if n not in maps})
    quant = sorted({f"{n} ({i.dtype})" for n, i in meta.infos.items() if n not in maps and i.dtype not in floats})
    if quant:
        checks.append(Check("dtype", "fail", f"non-float draft weights {quant[:4]}: quantised storage that this "
                                             "engine would cast to float without dequantising"))
    else:
        run = str(run_dtype).replace("torch.", "")
        note = "" if len(kinds) == 1 else "; mixed storage dtypes"
        checks.append(Check("dtype", "warn" if len(kinds) > 1 else "ok", f"stored {', '.join(kinds)}, run in {run}{note}"))
    try:
        tensors = load_weights(spec)
    except FormatError as exc:
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
    tgt = target_model.get_input_embeddings().weight
    table = emb if emb is not None else tgt.detach().cpu()
    if 0 <= spec.mask_token_id < table.shape[0] and float(table[spec.mask_token_id].float().abs().max()) == 0.0:
        # a padding row: every mask row then enters the draft as the same zero vector, and the
        # rows can no longer tell their slots apart
        checks.append(Check("mask embedding", "warn", f"mask_token_id {spec.mask_token_id} has an all-zero embedding "
                                                      "(a padding row?): mask rows carry no signal"))
    if emb is not None and tuple(emb.shape) == tuple(tgt.shape):
        cos = float(torch.nn.functional.cosine_similarity(emb.float(), tgt.detach().float().cpu(), dim=-1).mean())
        st = "ok" if cos >= EMBED_COSINE_MIN else "warn"
        checks.append(Check("embeddings", st, f"the draft's own embed_tokens vs the target's: mean cosine {cos:.3f}"
                            + ("" if st == "ok" else ": trained against another target or tokenizer?")))
    return checks, tensors


# ---- entry points ------------------------------------------------------------------------------

def diagnose(engine, draft_path: str, *, new_tokens: int = 32, n_prompts: int = 3, prompts: list[str] | None = None,
             extra_masks=(), layout: str | None = None) -> Report:
    """The full doctor: static checks, then every reading measured on target-generated text.

    engine: a target-only engine (dspark.api.build_engine with no_spec): the draft is built here,
    from a spec read without value checks, because a broken draft is what the doctor reports on.
    layout: force the declared reading's layout (as --layout does for decoding)."""
    target, tokenizer = engine.target, engine.tokenizer
    spec = load_spec(draft_path, layout=layout, check_values=False)  # values are checked below, and reported
    report = Report(engine.config.target if engine.config is not None else "", str(draft_path), spec)
    checks, tensors = static_checks(spec, target.model, tokenizer, target.dtype)
    report.checks = checks
    if tensors is None or any(c.status == "fail" for c in checks if c.name in ("vocabulary", "dtype")):
        return report  # a draft that cannot be built for this target is not measured
    draft = build_draft(spec, target.model, tensors)
    ids = prompt_ids(tokenizer, target.vocab_size, n_prompts, prompts)
    return measure(target, draft, tokenizer, prompts=ids, new_tokens=new_tokens,
                   stop_ids=engine.eos_token_ids, extra_masks=extra_masks, report=report)


def quick_check(engine, *, new_tokens: int = 16, prompt: str | list[int] | None = None) -> list[str]:
    """The doctor's cheap version for load time; returns warnings (empty: nothing found).

    One short prompt, `new_tokens` greedy target tokens, one target forward, and six batched
    draft forwards: single changes of layout / taps / mask plus layout x taps. Leaves the
    engine as it found it (its target's taps are restored).
    """
    draft = engine.draft
    if draft is None:
        return []
    out = []
    bad = [n for n, p in draft.named_parameters() if n not in draft.borrowed and not bool(torch.isfinite(p).all())]
    if bad:
        return [f"draft weights hold NaN/inf ({', '.join(bad[:4])}): its proposals are meaningless"]
    if draft.fc.weight.dtype != engine.target.dtype:
        out.append(f"draft runs in {draft.fc.weight.dtype} but the target in {engine.target.dtype}")
    if isinstance(prompt, list):
        ids = [list(prompt)]
    elif engine.tokenizer is not None:
        ids = prompt_ids(engine.tokenizer, engine.target.vocab_size, 1, [prompt] if prompt else None)
    else:
        ids = prompt_ids(None, engine.target.vocab_size, 1)
    report = measure(engine.target, draft, engine.tokenizer, prompts=ids, new_tokens=new_tokens,
                     stop_ids=engine.eos_token_ids, full_grid=False)
    out += [f"{d} (run `dspark doctor` for the full check)" for d in report.diagnoses]
    out += report.warnings
    return out
