"""Prompt sets: the bundled ones (`train`, `heldout`) or a user's .jsonl / .txt file.

The bundled sets are written for this project (explanations, code, math word problems, lists,
stories, dialogue, everyday writing). `heldout` is never trained on: it measures the draft.
The paper's evaluation sets (GSM8K, MATH500, ...) must never be used here.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from dspark.prompts import prompt_lines
from dspark.train.errors import TrainError

BUNDLED = ("train", "heldout")


@dataclass(frozen=True)
class Prompt:
    text: str
    category: str = ""

    @property
    def key(self) -> str:
        """Identity for deduplication and resume: whitespace- and case-insensitive."""
        norm = " ".join(self.text.lower().split())
        return hashlib.sha1(norm.encode("utf-8")).hexdigest()[:16]


def bundled_path(name: str) -> Path:
    return Path(str(resources.files("dspark") / "assets" / "prompts" / f"{name}.jsonl"))


def load_prompts(source: str) -> list[Prompt]:
    """`train` / `heldout`, a .jsonl(.gz) file with a "prompt" field per line, or a .txt(.gz) file (one per line)."""
    path = bundled_path(source) if source in BUNDLED else Path(source)
    if not path.is_file():
        raise TrainError(f"prompt set {source!r}: no such file (bundled sets: {', '.join(BUNDLED)})")
    prompts = []
    for n, rec in prompt_lines(path, TrainError, sniff_json=False):
        if isinstance(rec, str):
            prompts.append(Prompt(rec))
            continue
        text = rec.get("prompt") if isinstance(rec, dict) else None
        if not isinstance(text, str) or not text.strip():
            raise TrainError(f'{path}:{n}: each line needs a non-empty string field "prompt"')
        prompts.append(Prompt(text, str(rec.get("category", ""))))
    if not prompts:
        raise TrainError(f"prompt set {path} is empty")
    return dedupe(prompts)


def dedupe(prompts: list[Prompt]) -> list[Prompt]:
    seen, out = set(), []
    for p in prompts:
        if p.key not in seen:
            seen.add(p.key)
            out.append(p)
    return out
