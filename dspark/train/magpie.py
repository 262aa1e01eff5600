"""Prompts written by the target itself (Magpie, arXiv 2406.08464), and the filters a prompt set needs.

An aligned chat model, given only its chat template up to the start of a user turn, samples a
plausible user request. No hub data set is involved, and the prompts follow what the model was
tuned to answer. Such samples are noisy, so every prompt passes filters before it is kept:
length, a finished turn, garbage and non-text, exact and near duplicates (MinHash over word
3-grams), and no 8-word span shared with a protected set (the held-out prompts, the evaluation
sets): a draft must never be trained on what measures it.
"""

from __future__ import annotations

import json
import re
import zlib
from collections import Counter
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from dspark.train.errors import TrainError
from dspark.train.prompts import Prompt

_SENTINEL = "\x00DSPARK_USER_TURN\x00"
_WORD = re.compile(r"[a-z0-9]+")


def user_prefix(tokenizer) -> str:
    """The template's text up to where a user's words begin (system turn included, if the template adds one)."""
    if not getattr(tokenizer, "chat_template", None):
        raise TrainError("the tokenizer has no chat template: prompts cannot be sampled from a user-turn prefix")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False)
    if _SENTINEL not in text:
        raise TrainError("the chat template does not place the user's text verbatim: cannot find its prefix")
    return text[: text.index(_SENTINEL)]


# ---------------------------------------------------------------- filters


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def shingles(text: str, n: int = 8) -> set[tuple[str, ...]]:
    w = words(text)
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}


@dataclass
class FilterSettings:
    min_words: int = 4
    max_words: int = 150
    max_chars: int = 1200
    min_letter_frac: float = 0.55  # letters among non-space characters (code prompts carry symbols)
    min_ascii_frac: float = 0.97  # the target is an English model: other scripts are mostly noise here
    min_unique_frac: float = 0.35  # distinct words / words: catches loops ("the the the ...")
    near_dup_jaccard: float = 0.7


def garbage_reason(text: str, s: FilterSettings) -> str | None:
    """Why a sampled prompt is not a usable request, or None."""
    t = text.strip()
    w = words(t)
    if not t:
        return "too short"
    if "<|" in t or "|>" in t or any(ord(c) < 32 and c not in "\n\t" for c in t):
        return "non-text"
    visible = [c for c in t if not c.isspace()]
    if sum(c.isalpha() for c in visible) < s.min_letter_frac * len(visible):
        return "non-text"
    if sum(c.isascii() for c in t) < s.min_ascii_frac * len(t):
        return "non-text"
    if len(w) < s.min_words:
        return "too short"
    if len(w) > s.max_words or len(t) > s.max_chars:
        return "too long"
    if len(set(w)) < s.min_unique_frac * len(w):
        return "repetitive"
    return None


class NearDuplicates:
    """MinHash LSH over word 3-grams: 32 hashes in 8 bands of 4 (a pair at Jaccard 0.7 collides in
    some band with probability 1 - (1 - 0.7^4)^8 = 0.98); a collision is confirmed on exact Jaccard."""

    BANDS, ROWS = 8, 4

    def __init__(self, threshold: float):
        self.threshold = threshold
        self.buckets: dict[tuple, list[int]] = {}
        self.sets: list[set[str]] = []
        rng = np.random.default_rng(12345)
        n = self.BANDS * self.ROWS
        self.a = rng.integers(1, 2**31 - 1, n, dtype=np.uint64)
        self.b = rng.integers(0, 2**31 - 1, n, dtype=np.uint64)

    def _grams(self, text: str) -> set[str]:
        w = words(text)
        return {" ".join(w[i : i + 3]) for i in range(max(1, len(w) - 2))}

    def add_if_new(self, text: str) -> bool:
        grams = self._grams(text)
        h = np.array([zlib.crc32(g.encode()) for g in grams], dtype=np.uint64)
        sig = ((h[None, :] * self.a[:, None] + self.b[:, None]) % np.uint64(2**31 - 1)).min(axis=1)
        keys = [(band, *sig[band * self.ROWS : (band + 1) * self.ROWS].tolist()) for band in range(self.BANDS)]
        for cand in {c for k in keys for c in self.buckets.get(k, ())}:
            other = self.sets[cand]
            if len(grams & other) >= self.threshold * len(grams | other):
                return False
        idx = len(self.sets)
        self.sets.append(grams)
        for k in keys:
            self.buckets.setdefault(k, []).append(idx)
        return True


CATEGORIES = (
    (
        "code",
        (
            "python",
            "code",
            "function",
            "program",
            "javascript",
            "java",
            "sql",
            "script",
            "html",
            "css",
            "c++",
            "algorithm",
            "debug",
            "compile",
            "api",
            "class ",
            "variable",
            "regex",
        ),
    ),
    (
        "math",
        (
            "calculate",
            "solve",
            "equation",
            "how many",
            "how much",
            "sum of",
            "percent",
            "probability",
            "integer",
            "fraction",
            "math",
            "area of",
            "average",
            "multiply",
            "divide",
            "+",
            "=",
        ),
    ),
    (
        "writing",
        (
            "write a",
            "write an",
            "story",
            "poem",
            "essay",
            "letter",
            "email",
            "blog",
            "speech",
            "article",
            "summarize",
            "rewrite",
            "paraphrase",
            "slogan",
            "tweet",
        ),
    ),
    ("advice", ("how can i", "how do i", "should i", "tips", "advice", "recommend", "help me", "best way")),
    ("list", ("list ", "give me", "name ", "examples of", "ideas", "suggest")),
    (
        "explanation",
        (
            "explain",
            "what is",
            "what are",
            "why ",
            "how does",
            "describe",
            "difference between",
            "define",
            "meaning of",
            "tell me about",
        ),
    ),
)


def categorize(text: str) -> str:
    t = text.lower()
    for name, keys in CATEGORIES:
        if any(k in t for k in keys):
            return name
    return "other"


def protected_shingles(paths: list[Path]) -> set[tuple[str, ...]]:
    """8-word spans of every prompt in the protected files (prompt sets or evaluation sets, any turn)."""
    spans: set[tuple[str, ...]] = set()
    for path in paths:
        path = Path(path)
        files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
        if not files:
            raise TrainError(f"protected set {path}: no .jsonl files")
        for f in files:
            if not f.is_file():
                raise TrainError(f"protected set {f} does not exist")
            for line in f.read_text(encoding="utf-8").splitlines():
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    rec = {"prompt": line}
                texts = (
                    rec.get("turns") if isinstance(rec.get("turns"), list) else [rec.get("prompt", rec.get("text", ""))]
                )
                for t in texts:
                    if isinstance(t, str):
                        spans |= shingles(t)
    return spans


@dataclass
class FilterReport:
    sampled: int = 0
    kept: int = 0
    rejected: Counter = field(default_factory=Counter)
    categories: Counter = field(default_factory=Counter)

    def to_dict(self) -> dict:
        return {
            "sampled": self.sampled,
            "kept": self.kept,
            "rejected": dict(self.rejected.most_common()),
            "categories": dict(self.categories.most_common()),
        }


class PromptFilter:
    """Stateful: remembers kept prompts, so duplicates across batches and resumed runs are caught."""

    def __init__(self, settings: FilterSettings, protected: set[tuple[str, ...]]):
        self.s, self.protected = settings, protected
        self.seen: set[str] = set()
        self.near = NearDuplicates(settings.near_dup_jaccard)
        self.report = FilterReport()

    def keep(self, text: str, finished: bool = True) -> Prompt | None:
        self.report.sampled += 1
        reason = "unfinished" if not finished else garbage_reason(text, self.s)
        p = Prompt(text.strip())
        if reason is None and p.key in self.seen:
            reason = "duplicate"
        if reason is None and shingles(p.text) & self.protected:
            reason = "overlaps a protected set"
        if reason is None and not self.near.add_if_new(p.text):
            reason = "near duplicate"
        if reason is not None:
            self.report.rejected[reason] += 1
            return None
        self.seen.add(p.key)
        p = Prompt(p.text, categorize(p.text))
        self.report.kept += 1
        self.report.categories[p.category] += 1
        return p


# ---------------------------------------------------------------- sampling


@dataclass(frozen=True)
class PromptSampling:
    temperature: float = 1.0
    top_p: float = 0.95
    max_new_tokens: int = 128
    batch_size: int = 64
    seed: int = 0
    # words a sampled turn starts with, batch i taking openings[i % len]; empty: the bare prefix
    openings: tuple[str, ...] = ()

    def settings(self) -> dict:
        """What a prompt file's sidecar pins (openings only when given: older files have none)."""
        d = {k: v for k, v in self.__dict__.items() if k != "openings"}
        return {**d, "openings": list(self.openings)} if self.openings else d


@torch.inference_mode()
def sample_user_turns(
    model, tokenizer, n: int, s: PromptSampling, stops: set[int], batch_index: int
) -> list[tuple[str, bool]]:
    """n user turns sampled from the bare prefix, or from the batch's opening words (`openings`),
    which then begin each turn; (text, finished with an end-of-turn token)."""
    opening = s.openings[batch_index % len(s.openings)] if s.openings else ""
    prefix = tokenizer(user_prefix(tokenizer) + opening, add_special_tokens=False, return_tensors="pt").input_ids
    dev = next(model.parameters()).device
    ids = prefix.repeat(n, 1).to(dev)
    torch.manual_seed(s.seed * 1_000_003 + batch_index)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stops)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=s.max_new_tokens,
        do_sample=True,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=0,
        pad_token_id=pad,
        eos_token_id=sorted(stops),
    )
    turns = []
    for row in out[:, ids.shape[1] :].tolist():
        cut = next((j for j, t in enumerate(row) if t in stops), None)
        text = tokenizer.decode(row[:cut] if cut is not None else row, skip_special_tokens=True)
        turns.append((opening + text, cut is not None))
    return turns


def write_prompts(
    model,
    tokenizer,
    n: int,
    out,
    *,
    sampling: PromptSampling,
    stops: set[int],
    filters: FilterSettings | None = None,
    protected: AbstractSet[tuple[str, ...]] = frozenset(),
    max_batches: int | None = None,
    progress: bool = True,
) -> FilterReport:
    """Append kept prompts to `out` (.jsonl, {"prompt", "category"}) until it holds n. Resumable: prompts
    already in the file count and are deduplicated against; batch seeds continue from the file's sidecar."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    side = out.with_name(out.name + ".meta.json")
    meta = {"sampling": sampling.settings(), "filters": dict((filters or FilterSettings()).__dict__)}
    state: dict[str, Any] = json.loads(side.read_text()) if side.exists() else {"batches": 0, **meta}
    if {k: state.get(k) for k in meta} != meta:
        raise TrainError(f"{out} was written with other sampling or filter settings: use another --out")
    filt = PromptFilter(filters or FilterSettings(), set(protected))
    existing = []
    if out.exists():
        for line in out.read_text(encoding="utf-8").splitlines():
            if line.strip():
                existing.append(json.loads(line)["prompt"])
    for text in existing:  # re-register kept prompts so new ones are checked against them
        filt.seen.add(Prompt(text).key)
        filt.near.add_if_new(text)
    report = filt.report
    have = len(existing)
    bar = tqdm(total=n, initial=min(have, n), desc="prompts", unit="prompt", disable=not progress)
    batches = 0
    with open(out, "a", encoding="utf-8") as f:
        while have < n:
            if max_batches is not None and batches >= max_batches:
                break
            for text, finished in sample_user_turns(
                model, tokenizer, sampling.batch_size, sampling, stops, state["batches"]
            ):
                p = filt.keep(text, finished)
                if p is not None and have < n:
                    f.write(json.dumps({"prompt": p.text, "category": p.category}) + "\n")
                    have += 1
                    bar.update(1)
            f.flush()
            state["batches"] += 1
            batches += 1
            side.write_text(json.dumps(state, indent=2) + "\n")
    bar.close()
    return report
