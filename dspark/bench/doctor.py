"""The draft check behind `dspark doctor` and the engine's load-time check (library: no printing).

The silent failures of docs/DESIGN.md §9 all load, run and accept less than they should.
Reading the config cannot catch them; measuring can. The target writes text through the
engine's own plain (greedy) decoding; one target forward over that text gives its argmax and
its hidden states at every tap index needed. Each *reading* of the draft (the declared one;
the other block layout, keeping gamma or keeping block_size; hidden_state_indices shifted by
-1 and +1; other mask token ids) then runs through the draft's own block forward, the one
`propose` uses (`DSparkDraft.read_as` + `engine.step.teacher_forced`), at every anchor of that
text at once. Under
greedy decoding the leading proposals that equal the target's argmax are exactly what
verification accepts, so each reading gets L(i), the drafts accepted at anchor i, and its
acceptance length tau = 1 + mean L on this text; and, from the same block forward with the
Markov head fed the target's tokens, the log-probability the draft gives each of the target's
tokens (the objective it was trained on, under its true reading).

The verdict compares every alternative with the declared reading on the same anchors
(`dspark.bench.paired`): an alternative is *better* when it gives at least MIN_GAIN (3%) more
tokens per step, or LL_MIN_GAIN more log-probability per slot (a far less noisy statistic: it
sees a weak draft's shifted taps, which barely move acceptance), with a one-sided p below ALPHA
(0.01) shared by all alternatives and all looks (Bonferroni); *not better* when both gains are
excluded at the same level. It is sequential: while some alternative is open, the target
writes more text (rounds of doubling size, up to a token bound) and only the open readings
are measured again.

    misread    an alternative is better (exit 3): the file's keys to change and the numbers
    healthy    every alternative is excluded from being better on either statistic (exit 0)
    undecided  the bound was reached first (exit 4): the figures, never "healthy"

`quick_check(engine)` is the same statistic on a short sample, at load time.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from dspark.bench import fingerprint
from dspark.bench.paired import MIN_TEXTS_TO_EXCLUDE, Comparison, compare, slot_weights, z_for
from dspark.engine.engine import Engine
from dspark.engine.sampling import SamplingParams
from dspark.engine.step import teacher_forced
from dspark.errors import FormatError
from dspark.formats.load import force_layout, load_spec, load_weights
from dspark.formats.spec import query_slots_for
from dspark.formats.weights import FLOAT_STORAGE, WeightsMeta, iter_tensors
from dspark.kernels import argmax
from dspark.model.draft import ContextCache
from dspark.model.load import build_draft, check_compatible
from dspark.target.text import encode_prompt

EXIT_HEALTHY, EXIT_UNHEALTHY, EXIT_UNDECIDED = 0, 3, 4
MIN_GAIN = 0.03  # an alternative reading "better" gives this much more tokens per step (tau) ...
ALPHA = 0.01  # ... at this one-sided level, shared by every alternative and every look; and a
# reading is "not better" when a MIN_GAIN advantage is excluded at ALPHA shared by the looks
LL_MIN_GAIN = 0.05  # ... or gives the target's tokens this much more log-probability per slot (nats)
LOW_FIRST_SLOT = 0.05  # first-slot acceptance below this under every reading: barely predicts this target
EMBED_COSINE_MIN = 0.9  # a draft's own embed_tokens copy should be the target's
MAX_MASK_ALTERNATIVES = 3
ANCHOR_CHUNK = 96  # anchors per propose call (bounds the [anchors, rows, context] attention)

BUILTIN_PROMPTS = (
    "Explain step by step how to compute 17 times 23.",
    "Write a short Python function that checks whether a number is prime.",
    "Describe a sunny day at the beach in a few sentences.",
)
HELDOUT_PROMPTS = Path(__file__).resolve().parents[1] / "assets" / "prompts" / "heldout.jsonl"
_PRETTY = {"anchor_first": "anchor-first", "bonus_anchor": "bonus-anchor"}
FACTORS = ("layout", "hidden_state_indices", "mask_token_id")


@dataclass
class Budget:
    """How much text the sequential check may write: rounds of doubling size, up to max_tokens."""

    prompts: int = 4  # texts in the first round (then 2x, 4x, ... the first round)
    tokens: int = 64  # tokens the target writes per text
    max_tokens: int = 8192  # bound on the generated tokens over all rounds (the bundled draft's taps lie needs ~3 400)
    # load time: stop once no open alternative leads (by a margin, at z >= quiet_z) on either statistic
    stop_when_quiet: bool = False
    quiet_z: float = 1.0

    def rounds(self) -> list[int]:
        """Texts per round; the number of rounds is the number of looks the test pays for."""
        out, total, k = [], 0, self.prompts
        while total < self.max_tokens:
            k = min(k, math.ceil((self.max_tokens - total) / self.tokens))
            out.append(k)
            total += k * self.tokens
            k = self.prompts * 2 ** len(out)
        return out


# ---- data ------------------------------------------------------------------------------------

@dataclass
class Text:
    """One target-generated sequence and what one target forward over it yields."""

    ids: torch.Tensor  # [T]
    prompt_len: int
    argmax: torch.Tensor  # [T] target argmax at each position (predicts position + 1)
    taps: dict  # tap index -> [T, H] hidden state (input of that layer)


@dataclass
class Reading:
    """One way of reading the draft: the declared DraftSpec with some of FACTORS changed."""

    spec: object
    shift: int = 0  # hidden_state_indices = declared + shift
    factors: tuple[str, ...] = ()  # which FACTORS differ from the declared reading
    label: str = ""  # the layout part of the name
    accepted: list = field(default_factory=list)  # per measured text: [anchors] drafts accepted (0..gamma)
    loglik: list = field(default_factory=list)  # per measured text: [anchors, gamma] log q(target token)

    @property
    def name(self) -> str:
        parts = {"layout": self.label, "hidden_state_indices": f"taps{self.shift:+d}",
                 "mask_token_id": f"mask={self.spec.mask_token_id}"}
        return " ".join(parts[f] for f in self.factors) or "declared"

    @property
    def key(self) -> tuple:
        return (self.spec.layout, self.spec.query_slots, self.shift, self.spec.mask_token_id)

    @property
    def all_accepted(self) -> torch.Tensor:
        return torch.cat(self.accepted) if self.accepted else torch.zeros(0, dtype=torch.long)

    @property
    def anchors(self) -> int:
        return sum(int(a.numel()) for a in self.accepted)

    @property
    def accept_length(self) -> float:
        """1 + mean accepted drafts: the greedy acceptance length on the measured text."""
        a = self.all_accepted
        return 1.0 + float(a.float().mean()) if a.numel() else 1.0

    @property
    def mean_loglik(self) -> float:
        """Log-probability the draft gives the target's token per slot (teacher-forced; slots
        weighted as in the paired test), nats."""
        if not self.loglik:
            return float("nan")
        return float((torch.cat(self.loglik).double() @ slot_weights(self.spec.gamma)).mean())

    @property
    def per_slot(self) -> list[float]:
        """Conditional acceptance of slot k (accepted / reached), as the engine's metrics report it."""
        a = self.all_accepted
        out = []
        for k in range(self.spec.gamma):
            reached = int((a >= k).sum())
            out.append(int((a > k).sum()) / reached if reached else 0.0)
        return out


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
    comparisons: dict = field(default_factory=dict)  # reading name -> Comparison (vs declared)
    diagnoses: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    texts: dict = field(default_factory=dict)
    rounds: list[dict] = field(default_factory=list)
    thresholds: dict = field(default_factory=dict)
    best: Reading | None = None  # the reading that explains a misread file
    fits: dict = field(default_factory=dict)  # taps reading name -> fingerprint.TapFit (declared included)
    found_by: str = ""  # "behaviour" | "weights" (the fingerprint) when misread
    measured: bool = False
    seconds: float = 0.0

    @property
    def verdict(self) -> str:
        """"misread" | "unhealthy" (a static check failed) | "healthy" | "undecided" | "not measured"."""
        if self.diagnoses:
            return "misread"
        if any(c.status == "fail" for c in self.checks):
            return "unhealthy"
        if not self.measured:
            return "not measured"
        open_ = [n for n, c in self.comparisons.items() if c.status != "not better"]
        return "undecided" if open_ else "healthy"

    @property
    def healthy(self) -> bool:
        return self.verdict == "healthy"

    @property
    def undecided(self) -> list[str]:
        """Alternatives neither shown better nor excluded."""
        return [n for n, c in self.comparisons.items() if c.status == "open"]

    def exit_code(self, strict: bool = False) -> int:
        v = self.verdict
        if v in ("misread", "unhealthy"):
            return EXIT_UNHEALTHY
        if strict and (self.warnings or any(c.status == "warn" for c in self.checks)):
            return EXIT_UNHEALTHY
        if v == "healthy":
            return EXIT_HEALTHY
        return EXIT_UNDECIDED  # undecided, or nothing measured: never "healthy"

    def to_json(self, strict: bool = False) -> dict:
        s = self.declared
        return {
            "target": self.target,
            "draft": self.draft,
            "declared": {"format": s.format, "layout": s.layout, "layout_source": s.layout_source, "gamma": s.gamma,
                         "block_size": s.block_size, "hidden_state_indices": list(s.hidden_state_indices),
                         "mask_token_id": s.mask_token_id},
            "text": self.texts,
            "rounds": self.rounds,
            "thresholds": self.thresholds,
            "checks": [vars(c) for c in self.checks],
            "readings": [
                {"name": r.name, "changes": list(r.factors), "layout": r.spec.layout, "gamma": r.spec.gamma,
                 "block_size": r.spec.query_slots, "hidden_state_indices": list(r.spec.hidden_state_indices),
                 "mask_token_id": r.spec.mask_token_id, "anchors": r.anchors,
                 "accept_length": round(r.accept_length, 4), "per_slot_acceptance": [round(x, 4) for x in r.per_slot],
                 "loglik": round(r.mean_loglik, 4) if r.loglik else None,
                 **({"vs_declared": self.comparisons[r.name].to_json()} if r.name in self.comparisons else {})}
                for r in self.readings
            ],
            "explained_by": self.best.name if self.best is not None else None,
            "found_by": self.found_by,
            "fingerprint": {n: f.to_json() for n, f in self.fits.items()},
            "verdict": self.verdict,
            "diagnoses": self.diagnoses,
            "warnings": self.warnings,
            "healthy": self.healthy,
            "seconds": round(self.seconds, 2),
            "exit_code": self.exit_code(strict),
        }


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


# ---- one reading -------------------------------------------------------------------------------

def score_anchors(draft, spec, text: Text, g_max: int, ctx=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted [anchors], loglik [anchors, gamma]) at each anchor of `text` when the draft is read
    as `spec`: the drafts greedy verification accepts, and the log-probability of the target's
    token per slot, from the draft's own block forward (`engine.step.teacher_forced`, which shares
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
    for chunk in anchors.split(ANCHOR_CHUNK):
        pos = chunk[:, None] + torch.arange(g, device=dev)[None, :]  # [n, g], inside the text (see above)
        want = argmax[pos]  # the target's token at each slot
        tokens, ll = teacher_forced(view, ids[chunk], ContextCache(ctx, chunk.clone(), shared=True), want)
        acc.append((tokens == want).long().cumprod(1).sum(1).cpu())
        lls.append(ll.float().cpu())
    return torch.cat(acc), torch.cat(lls)


@torch.inference_mode()
def context_for(draft, spec, text: Text):
    """The draft's context keys/values of the whole text under `spec`'s taps (one row, shared)."""
    dev, dtype = draft.fc.weight.device, draft.fc.weight.dtype
    feats = torch.cat([text.taps[i] for i in spec.hidden_state_indices], dim=-1)[None].to(dev, dtype)
    return draft.context_kv(feats, torch.arange(feats.shape[1], device=dev)[None])


# ---- the readings ------------------------------------------------------------------------------

def layout_readings(spec) -> list[tuple[object, str]]:
    """(spec, label): the declared layout, the other layout keeping gamma (a consistent file with
    the layout flag flipped), and the other layout keeping block_size (a flag read wrongly)."""
    other = "bonus_anchor" if spec.layout == "anchor_first" else "anchor_first"
    out = [(spec, _PRETTY[spec.layout])]
    keep_gamma = replace(spec, layout=other, gamma=spec.gamma, query_slots=query_slots_for(other, spec.gamma),
                         block_size=query_slots_for(other, spec.gamma))
    out.append((keep_gamma, _PRETTY[other]))
    if spec.block_size - (1 if other == "bonus_anchor" else 0) >= 1:
        keep_block = replace(force_layout(spec, other), layout_source=spec.layout_source, warnings=spec.warnings)
        out.append((keep_block, f"{_PRETTY[other]}(block_size {spec.block_size})"))
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


# ---- the statistic -----------------------------------------------------------------------------

@dataclass
class Rule:
    """The decision thresholds for one check (paired.compare)."""

    min_gain: float
    z_better: float
    z_not_better: float
    ll_min_gain: float = LL_MIN_GAIN

    def to_json(self) -> dict:
        return {"min_gain": self.min_gain, "loglik_min_gain": self.ll_min_gain, "alpha": ALPHA,
                "z_better": round(self.z_better, 3), "z_not_better": round(self.z_not_better, 3)}


def rule_for(alternatives: int, looks: int, min_gain: float = MIN_GAIN, alpha: float = ALPHA) -> Rule:
    """A false alarm needs any one of the alternatives to pass at any look: alpha is shared by all
    of them (Bonferroni). A miss needs the one true reading to be excluded at some look: alpha is
    shared by the looks only."""
    return Rule(min_gain, z_for(alpha, alternatives * looks), z_for(alpha, looks))


def _add(r: Reading, scored: tuple[torch.Tensor, torch.Tensor]) -> None:
    r.accepted.append(scored[0])
    r.loglik.append(scored[1])


def paired(a: Reading, b: Reading, rule: Rule) -> Comparison:
    """b against a on the texts both were measured on, over their common slots."""
    n = min(len(a.accepted), len(b.accepted))
    x, y = a.accepted[:n], b.accepted[:n]
    if not n:
        return compare(torch.zeros(0), torch.zeros(0), [], 1, min_gain=rule.min_gain, z_better=rule.z_better,
                       z_not_better=rule.z_not_better)
    slots = min(a.spec.gamma, b.spec.gamma)
    ll = (torch.cat(a.loglik[:n]), torch.cat(b.loglik[:n]))
    return compare(torch.cat(x), torch.cat(y), [int(t.numel()) for t in x], slots, min_gain=rule.min_gain,
                   z_better=rule.z_better, z_not_better=rule.z_not_better, ll=ll, ll_min_gain=rule.ll_min_gain)


def leads(c: Comparison, rule: Rule, z: float) -> bool:
    """An alternative ahead of the declared reading by the rule's margin on either statistic, at
    z >= `z`: worth more text at load time (noise alone rarely puts a reading there; a misread's
    true reading stays there as the text grows)."""
    return (c.gain >= rule.min_gain and c.z >= z) or (c.ll_gain >= rule.ll_min_gain and c.ll_z >= z)


def explain(readings: list[Reading], comparisons: dict, rule: Rule) -> tuple[Reading | None, Reading | None, bool]:
    """(best, evidence, settled): the reading that explains a misread file with the fewest
    changes, the better reading whose numbers prove it, and whether the explanation is settled.

    Start from the better reading with the highest acceptance length (the evidence); then undo
    each change that is not needed (undoing it does not make the reading clearly worse), so that
    noise does not turn an irrelevant change into a second "finding". A layout change keeps gamma
    when keeping block_size is not clearly better (the consistent file is the likelier one). The
    explanation is settled when every undo taken rests on a reading that is itself better."""
    declared = readings[0]
    better = [r for r in readings[1:] if comparisons[r.name].status == "better"]
    if not better:
        return None, None, True
    # the likelihood ranks readings far more precisely than acceptance (paired.py); gains, each on
    # the slots the reading shares with the declared one, not levels over different slot counts
    evidence = best = max(better, key=lambda r: (comparisons[r.name].ll_gain, comparisons[r.name].gain))
    by_key = {r.key: r for r in readings}
    d = declared.spec

    def undos(r, f):
        if f == "layout":
            keep_gamma = query_slots_for(r.spec.layout, d.gamma)
            first = [(r.spec.layout, keep_gamma, r.shift, r.spec.mask_token_id)] if r.spec.query_slots != keep_gamma else []
            return first + [(d.layout, d.query_slots, r.shift, r.spec.mask_token_id)]
        if f == "hidden_state_indices":
            return [(r.spec.layout, r.spec.query_slots, 0, r.spec.mask_token_id)]
        return [(r.spec.layout, r.spec.query_slots, r.shift, d.mask_token_id)]

    settled, changed = True, True
    while changed:
        changed = False
        for f in best.factors:
            for key in undos(best, f):
                simpler = by_key.get(key)
                if (simpler is None or simpler is declared or comparisons[simpler.name].status == "not better"
                        or paired(simpler, best, rule).status == "better"):
                    continue
                settled = settled and comparisons[simpler.name].status == "better"
                best, changed = simpler, True
                break
            if changed:
                break
    return best, evidence, settled


def simpler_readings(readings: list[Reading], best: Reading) -> list[Reading]:
    """The readings that make some, not all, of `best`'s changes, each the way `best` makes it."""
    def same(r: Reading, f: str) -> bool:
        if f == "layout":
            return (r.spec.layout, r.spec.query_slots) == (best.spec.layout, best.spec.query_slots)
        if f == "hidden_state_indices":
            return r.shift == best.shift
        return r.spec.mask_token_id == best.spec.mask_token_id

    return [r for r in readings[1:] if set(r.factors) < set(best.factors) and all(same(r, f) for f in r.factors)]


_KEYS = {  # format -> (taps key, offset from hidden_state_indices to the file's value, mask key)
    "speculators": ("aux_hidden_state_layer_ids", 0, "mask_token_id"),
    "deepspec": ("target_layer_ids", -1, "mask_token_id"),
    "specforge": ("dflash_config.target_layer_ids", -1, "dflash_config.mask_token_id"),
    "deepseek_v4": ("dspark_target_layer_ids", -1, "dspark_noise_token_id"),
}


def _says(spec) -> str:
    return "--layout forces" if spec.layout_source == "forced" else "the file says"


def layout_fix(declared, alt) -> str:
    """The config keys that make a file read as `alt` (docs/DESIGN.md §3)."""
    flag = "true" if alt.layout == "anchor_first" else "false"
    if declared.format == "speculators":
        return (f"set sample_from_anchor: {flag}, block_size: {alt.query_slots} and speculative_tokens: {alt.gamma} "
                f"in config.json, or run with --layout {alt.layout}")
    if alt.layout == "bonus_anchor":
        return (f"{declared.format} files are read anchor-first: write it as a speculators file with "
                f"sample_from_anchor: false and block_size: {alt.query_slots}, or run with --layout bonus_anchor")
    return f"write it as a speculators file with sample_from_anchor: true and block_size: {alt.query_slots}, or run with --layout anchor_first"


def _taps_keys(d, a) -> tuple[str, list[int], list[int]]:
    """(the file's taps key, its value as declared, the value that reads the file as `a`)."""
    key, off, _ = _KEYS.get(d.format, ("hidden_state_indices", 0, "mask_token_id"))
    return key, [i + off for i in d.hidden_state_indices], [i + off for i in a.hidden_state_indices]


def diagnosis(declared: Reading, best: Reading, factor: str, cmp: Comparison, evidence: Reading) -> str:
    """One finding: what the file says, what the weights behave like, the numbers (of `evidence`,
    the better reading measured), and the config keys to change."""
    d, a = declared.spec, best.spec
    nums = (f"acceptance length {cmp.tau_declared:.2f} -> {cmp.tau_alt:.2f} tokens per step ({cmp.gain:+.0%}, "
            f"z {cmp.z:.1f}, p {cmp.p:.1g}), log-likelihood of the target's tokens {cmp.ll_declared:.2f} -> "
            f"{cmp.ll_alt:.2f} nats per slot (z {cmp.ll_z:.1f}, p {cmp.ll_p:.1g}); {cmp.anchors} anchors, {cmp.slots} slots")
    if len(evidence.factors) > 1 or evidence is not best:
        nums += f" reading it as {evidence.name}"
    if factor == "layout":
        return (f"{_says(d)} {_PRETTY[d.layout]} (gamma {d.gamma}, block_size {d.query_slots}) but the weights behave "
                f"like {_PRETTY[a.layout]} (gamma {a.gamma}, block_size {a.query_slots}): {nums}. Fix: "
                f"{layout_fix(d, a)} (docs/DESIGN.md §3)")
    if factor == "hidden_state_indices":
        key, now, want = _taps_keys(d, a)
        return (f"{_says(d)} {key} {now} but the weights behave like {want} (hidden_state_indices shifted by "
                f"{best.shift:+d}: DeepSpec target_layer_ids t are speculators aux_hidden_state_layer_ids t+1): {nums}. "
                f"Fix: set {key}: {want}")
    mask_key = _KEYS.get(d.format, ("hidden_state_indices", 0, "mask_token_id"))[2]
    return (f"{_says(d)} {mask_key} {d.mask_token_id} but the weights behave like {mask_key} {a.mask_token_id}: "
            f"{nums}. Fix: set {mask_key}: {a.mask_token_id}")


# ---- the sequential check ----------------------------------------------------------------------

def measure(target, draft, tokenizer, *, eos, prompts=None, budget: Budget | None = None, extra_masks=(),
            report: Report | None = None, full_grid: bool = True, rule: Rule | None = None) -> Report:
    """Write text round by round, measure the readings still open, decide (module docstring)."""
    t_start = time.perf_counter()
    spec = draft.spec
    budget = budget or Budget()
    report = report or Report("", spec.path or "", spec)
    cands = mask_candidates(spec, tokenizer, target.config, target.vocab_size, extra_masks)
    readings = readings_for(spec, target.num_layers, cands, full_grid)
    plan = budget.rounds()
    rule = rule or rule_for(len(readings) - 1, len(plan))
    report.readings, report.thresholds = readings, {**rule.to_json(), "looks": len(plan),
                                                    "alternatives": len(readings) - 1}
    taps = sorted({i for r in readings for i in r.spec.hidden_state_indices})
    g_max = max(r.spec.gamma for r in readings)
    source = prompt_pool(tokenizer, target.vocab_size, prompts)
    declared, open_ = readings[0], list(readings[1:])
    generated = n_texts = 0
    kept: list = []  # every text so far: readings dropped early are measured again when they matter
    for k, n in enumerate(plan):
        t0 = time.perf_counter()
        batch = [next(source) for _ in range(n)]
        texts = generate_texts(target, tokenizer, eos, batch, budget.tokens, taps)
        generated += sum(int(t.ids.shape[0]) - t.prompt_len for t in texts)
        n_texts += len(texts)
        t1 = time.perf_counter()
        with torch.inference_mode():
            for text in texts:
                ctx: dict = {}
                for r in [declared, *open_]:
                    shift = r.shift
                    if shift not in ctx:
                        ctx[shift] = context_for(draft, r.spec, text)
                    _add(r, score_anchors(draft, r.spec, text, g_max, ctx[shift]))
        kept.extend(texts)
        for r in open_:
            report.comparisons[r.name] = paired(declared, r, rule)
        if n_texts >= MIN_TEXTS_TO_EXCLUDE:
            open_ = [r for r in open_ if report.comparisons[r.name].status != "not better"]
        report.rounds.append({"round": k + 1, "texts": len(texts), "generated_tokens": generated,
                              "anchors": declared.anchors, "open": len(open_),
                              "seconds_generate": round(t1 - t0, 2), "seconds_readings": round(time.perf_counter() - t1, 2)})
        if declared.anchors == 0:
            continue
        if any(report.comparisons[r.name].status == "better" for r in open_):
            if explain(readings, report.comparisons, rule)[2]:
                break  # otherwise more text decides which changes are needed
        if not open_:
            break
        if budget.stop_when_quiet and n_texts >= MIN_TEXTS_TO_EXCLUDE and not any(leads(report.comparisons[r.name], rule, budget.quiet_z) for r in open_):
            break
    report.measured = declared.anchors > 0
    report.texts = {"prompts": n_texts, "generated_tokens": generated, "anchors": declared.anchors}
    report.seconds += time.perf_counter() - t_start
    if not report.measured:
        report.warnings.append(f"the target generated too few tokens for a block of {g_max}: nothing measured "
                               "(raise --tokens or give longer prompts)")
        return report
    best, evidence, _ = explain(readings, report.comparisons, rule)
    for _ in FACTORS:  # each pass can only remove a change, so this ends
        # The simpler readings an explanation is judged against must stand on the same text as the
        # evidence: one dropped early would keep an irrelevant change in the diagnosis.
        stale = [r for r in simpler_readings(readings, best) if r.anchors < evidence.anchors] if best else []
        if not stale:
            break
        with torch.inference_mode():
            for r in stale:
                for text in kept[len(r.accepted):]:
                    _add(r, score_anchors(draft, r.spec, text, g_max, context_for(draft, r.spec, text)))
                report.comparisons[r.name] = paired(declared, r, rule)
        best, evidence, _ = explain(readings, report.comparisons, rule)
    if best is not None:
        report.best, report.found_by = best, "behaviour"
        report.diagnoses = [diagnosis(declared, best, f, report.comparisons[evidence.name], evidence)
                            for f in best.factors]
    weights_finding(report, readings, draft, kept)
    top = max(r.per_slot[0] if r.per_slot else 0.0 for r in readings if r.accepted)
    if best is None and top < LOW_FIRST_SLOT:
        report.warnings.append(
            f"the draft's first token is accepted {top:.0%} of the time under every reading tried: an untrained "
            "draft, a draft for another target, or a mismatch this doctor does not vary (RoPE settings, dtype)")
    return report


def weights_finding(report: Report, readings: list[Reading], draft, texts: list[Text]) -> None:
    """Taps that behaviour cannot tell apart, named by fc's weights (bench/fingerprint.py).

    Fits every taps reading (reported); decides only where behaviour found nothing: a shifted-taps
    reading whose layers fc fits FIT_RATIO times better than the declared ones, and which behaves
    as well as the declared reading (no worse than either margin on either statistic), is a
    finding. A draft trained on raw taps has no fingerprint (its profile explains too little of
    fc's column norms, `fingerprint.points_to`) and never gets one."""
    declared = readings[0]
    taps_only = [r for r in readings if r.factors in ((), ("hidden_state_indices",))]
    layers = {i for r in taps_only for i in r.spec.hidden_state_indices}
    rms = fingerprint.layer_rms([(t.taps, t.prompt_len) for t in texts], layers)
    report.fits = {r.name: fingerprint.tap_fit(draft.fc.weight, rms, r.spec.hidden_state_indices) for r in taps_only}
    base = report.fits[declared.name]
    if report.best is not None:
        return
    for r in taps_only[1:]:
        fit, cmp = report.fits[r.name], report.comparisons.get(r.name)
        if cmp is None or not fingerprint.points_to(base, fit):
            continue
        if cmp.gain <= -MIN_GAIN or cmp.ll_gain <= -LL_MIN_GAIN:
            continue  # behaviour prefers the declared taps: it outranks the weights' shape
        report.best, report.found_by = r, "weights"
        report.diagnoses = [taps_diagnosis(declared.spec, r, base, fit, cmp)]
        return


def taps_diagnosis(d, r: Reading, base, fit, cmp: Comparison) -> str:
    key, now, want = _taps_keys(d, r.spec)
    return (f"{_says(d)} {key} {now} but fc's weights were fitted to {want} (hidden_state_indices shifted by "
            f"{r.shift:+d}): fc's column norms follow the per-dimension scale of those layers' hidden states "
            f"(misfit {fit.misfit:.4f} against {base.misfit:.4f} for the declared layers, correlation "
            f"{fit.correlation:.2f}; `dspark train` folds each tap's scale into fc), while this draft's behaviour "
            f"cannot tell the two apart (acceptance length {cmp.tau_declared:.2f} -> {cmp.tau_alt:.2f}, "
            f"log-likelihood {cmp.ll_declared:.2f} -> {cmp.ll_alt:.2f} nats per slot; {cmp.anchors} anchors). "
            f"Fix: set {key}: {want}")


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
    maps = {"d2t", "t2d"}
    kinds = sorted({i.dtype for n, i in meta.infos.items() if n not in maps})
    quant = sorted({f"{n} ({i.dtype})" for n, i in meta.infos.items() if n not in maps and i.dtype not in FLOAT_STORAGE})
    if quant:  # the weights are not loaded: load_weights refuses such storage
        checks.append(Check("dtype", "fail", f"non-float draft weights {quant[:4]}: quantised storage (integers, "
                                             "float8) without its scales, which no engine can run as it is"))
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

def check_engine(engine, *, prompts=None, budget: Budget | None = None, extra_masks=(), full_grid: bool = True,
                 report: Report | None = None) -> Report:
    """The measured part of the doctor on an assembled engine (its target, draft, tokenizer, EOS).
    Leaves the engine as it found it (its target's taps are restored)."""
    return measure(engine.target, engine.draft, engine.tokenizer, eos=engine.eos_token_ids, prompts=prompts,
                   budget=budget, extra_masks=extra_masks, report=report, full_grid=full_grid)


def diagnose(engine, draft_path: str, *, budget: Budget | None = None, prompts: list | None = None, extra_masks=(),
             layout: str | None = None) -> Report:
    """The full doctor: static checks, then the sequential check of every reading.

    engine: a target-only engine (dspark.api.build_engine with no_spec): the draft is built here,
    from a spec read without value checks, because a broken draft is what the doctor reports on.
    layout: force the declared reading's layout (as --layout does for decoding)."""
    t0 = time.perf_counter()
    target, tokenizer = engine.target, engine.tokenizer
    spec = load_spec(draft_path, layout=layout, check_values=False)  # values are checked below, and reported
    name = engine.config.target if engine.config is not None else ""
    report = Report(name, str(draft_path), spec)
    checks, tensors = static_checks(spec, target.model, tokenizer, target.dtype)
    report.checks = checks
    if tensors is None or any(c.status == "fail" for c in checks if c.name in ("vocabulary", "dtype")):
        return report  # a draft that cannot be built for this target is not measured
    with_draft = Engine(target, build_draft(spec, target.model, tensors, dtype=target.dtype), tokenizer,
                        engine.eos_token_ids)
    report.seconds = time.perf_counter() - t0
    return check_engine(with_draft, prompts=prompts, budget=budget, extra_masks=extra_masks, report=report)


# Load time: four prompts of 64 tokens, then eight (a handful of texts can point the wrong way:
# a barely trained draft's layout lie looked healthy on the first four); more text (doubling)
# only while some open alternative leads the declared reading (`leads`), up to 3072 tokens.
QUICK_BUDGET = Budget(prompts=4, tokens=64, max_tokens=3072, stop_when_quiet=True)


@dataclass
class QuickCheck:
    """What the load-time check found: warnings (empty: nothing found) and, when it measured, the
    drafts greedy verification accepted at each anchor of the declared reading (what the engine
    will run), which an adaptive policy starts from (scheduler.DraftPrior)."""

    warnings: list[str]
    accepted: torch.Tensor | None = None  # [anchors] 0..gamma


def quick_check(engine, *, budget: Budget | None = None, prompt: str | list[int] | None = None) -> QuickCheck:
    """The doctor's cheap version for load time.

    The same statistic and thresholds as the doctor on a short sample (QUICK_BUDGET) and fewer
    readings (layout x taps, single mask changes). On SmolLM2 with its weak drafts it costs about
    24 s on one Zen 4 core when no alternative leads (8 texts, 732 tokens; docs/BENCHMARKS.md).
    Leaves the engine as it found it."""
    draft = engine.draft
    if draft is None:
        return QuickCheck([])
    out = []
    bad = [n for n, p in draft.named_parameters() if n not in draft.borrowed and not bool(torch.isfinite(p).all())]
    if bad:
        return QuickCheck([f"draft weights hold NaN/inf ({', '.join(bad[:4])}): its proposals are meaningless"])
    if draft.fc.weight.dtype != engine.target.dtype:
        out.append(f"draft runs in {draft.fc.weight.dtype} but the target in {engine.target.dtype}")
    prompts = [prompt] if prompt is not None else None
    budget = budget or QUICK_BUDGET
    report = measure(engine.target, draft, engine.tokenizer, eos=engine.eos_token_ids, prompts=prompts,
                     budget=budget, full_grid=False)
    out += [f"LIKELY MISREAD: {d} (run `dspark doctor` for the full check)" for d in report.diagnoses]
    out += report.warnings
    declared = report.readings[0].all_accepted if report.readings else None
    return QuickCheck(out, declared if declared is not None and declared.numel() else None)
