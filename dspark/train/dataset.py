"""Self-distillation shards: one JSON line per prompt with the prompt+answer ids and a loss mask.

Line: {"key", "prompt", "category", "ids", "loss_mask", "prompt_len", "finish"}; loss_mask is 1
on the target's answer (end-of-turn token included: the draft must learn to predict it).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dspark.train.errors import TrainError

# packed data sets (written by store.pack): token ids as compressed integer arrays + a manifest
FORMAT = "dspark-selfdistill/1"
MANIFEST, TOKENS = "manifest.json", "tokens.npz"


@dataclass
class Sequence:
    key: str
    ids: torch.Tensor  # [L] long
    loss_mask: torch.Tensor  # [L] bool


def read_records(path: Path, repair: bool = False) -> list[dict]:
    """Records of a shard. A torn last line (a crash mid-write) is dropped, and cut off when repair."""
    if not path.exists():
        return []
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    records, good_end = [], 0
    for n, line in enumerate(lines, 1):
        if not line.strip():
            good_end += len(line) + 1
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if n < len(lines):  # only the final, unterminated line can be torn
                raise TrainError(f"{path}:{n}: malformed JSON line (not a torn write at the end)") from None
            if repair:
                with open(path, "r+b") as f:
                    f.truncate(good_end)
            break
        good_end += len(line) + 1
    return records


def answer_heads(seqs: list[Sequence], tokens: int) -> list[Sequence]:
    """Each sequence cut after its first `tokens` answer tokens (counted from its first one): the
    part of an answer that decoding with `--max-new-tokens tokens` writes."""
    out = []
    for s in seqs:
        answer = s.loss_mask.nonzero()
        end = len(s.ids) if answer.numel() == 0 else int(answer[0]) + tokens
        out.append(Sequence(s.key, s.ids[:end], s.loss_mask[:end]))
    return out


def load_sequences(path, vocab_size: int | None = None, max_len: int | None = None) -> list[Sequence]:
    """A JSONL shard or a packed data set (a directory with manifest.json, see store.py); several,
    comma-separated, are read in the order given (one data set of all their sequences)."""
    parts = str(path).split(",")
    if len(parts) > 1:
        if any(not p.strip() for p in parts):
            raise TrainError(f"training data {str(path)!r}: an empty name in the comma-separated list")
        return [s for p in parts for s in load_sequences(p.strip(), vocab_size, max_len)]
    path = Path(path)
    if path.is_dir() and (path / "manifest.json").is_file():
        records = read_packed(path)
    elif path.is_file():
        records = read_records(path)
    else:
        raise TrainError(f"training data {path} does not exist (run `dspark train data` first)")
    seqs = []
    for n, rec in enumerate(records, 1):
        ids, mask = rec.get("ids"), rec.get("loss_mask")
        if not isinstance(ids, list) or not isinstance(mask, list) or len(ids) != len(mask):
            raise TrainError(f'{path} record {n}: needs lists "ids" and "loss_mask" of equal length')
        if not all(isinstance(t, int) for t in ids) or not all(m in (0, 1) for m in mask):
            raise TrainError(f"{path} record {n}: ids must be integers and loss_mask 0/1")
        if vocab_size is not None and ids and not 0 <= min(ids) <= max(ids) < vocab_size:
            raise TrainError(f"{path} record {n}: token ids outside the target vocabulary [0, {vocab_size})")
        ids_t, mask_t = torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool)
        if max_len is not None:
            ids_t, mask_t = ids_t[:max_len], mask_t[:max_len]
        seqs.append(Sequence(str(rec.get("key", n)), ids_t, mask_t))
    if not seqs:
        raise TrainError(f"{path} holds no sequences")
    if not any(s.loss_mask[1:].sum() >= 2 for s in seqs):
        raise TrainError(f"{path}: no sequence has an answer of 2+ tokens: nothing to train on")
    return seqs


def token_subset(seqs: list[Sequence], answer_tokens: int, seed: int) -> list[Sequence]:
    """A seeded random subset holding about `answer_tokens` answer tokens (whole sequences, at least one)."""
    g = torch.Generator().manual_seed(seed)
    out: list[Sequence] = []
    total = 0
    for i in torch.randperm(len(seqs), generator=g).tolist():
        if out and total >= answer_tokens:
            break
        out.append(seqs[i])
        total += int(seqs[i].loss_mask.sum())
    return out


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def is_packed(path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def read_manifest(path) -> dict:
    path = Path(path)
    if not is_packed(path):
        raise TrainError(f"{path} is not a packed data set (no {MANIFEST})")
    m = json.loads((path / MANIFEST).read_text())
    if m.get("format") != FORMAT:
        raise TrainError(f"{path}: format {m.get('format')!r}, this dspark reads {FORMAT!r}")
    return m


def read_packed(path) -> list[dict]:
    """Records in the shard form (`key`, `ids`, `loss_mask`, `prompt_len`, `finish`, `category`)."""
    path = Path(path)
    m = read_manifest(path)
    if sha256_file(path / TOKENS) != m["tokens_sha256"]:
        raise TrainError(f"{path / TOKENS} does not match its manifest (corrupt or replaced)")
    with np.load(path / TOKENS) as z:
        ids, off, plen = z["ids"].astype(np.int64), z["offsets"], z["prompt_len"]
        finish, cat, keys = z["finish"], z["category"], z["keys"]
    out = []
    for i in range(len(plen)):
        seq = ids[off[i] : off[i + 1]].tolist()
        p = int(plen[i])
        out.append(
            {
                "key": str(keys[i]),
                "ids": seq,
                "loss_mask": [0] * p + [1] * (len(seq) - p),
                "prompt_len": p,
                "finish": "stop" if finish[i] else "length",
                "category": m["categories"][int(cat[i])],
            }
        )
    return out
