"""Self-distilled data kept compactly: token ids as compressed integer arrays plus a manifest.

A packed data set is a directory:
- `tokens.npz` (numpy, deflate): `ids` (uint16 when the vocabulary fits, else uint32) all sequences
  concatenated; `offsets` [N+1]; `prompt_len` [N]; `finish` [N] (1 = ended with an end-of-turn
  token, 0 = cut at the length cap); `part` [N] (which source shard); `category` [N] (index into
  the manifest's list); `keys` [N] (the prompt key used for resume and deduplication).
- `manifest.json`: what makes the data reproducible and checkable: the target (name, SHA-256 of
  its weights file when it is a file), the chat template's SHA-256, each part's sampling settings
  (from the shard's sidecar), and counts (sequences, prompt and answer tokens, cut answers).

The answer mask is implied: positions >= prompt_len. A JSONL shard is ~25x larger; hidden-state
features are never stored here (they are recomputed from the ids in minutes).
"""

from __future__ import annotations

import datetime
import hashlib
import json
from pathlib import Path

import numpy as np

from dspark.jsonfile import write_json
from dspark.train.dataset import FORMAT, MANIFEST, TOKENS, read_packed, read_records
from dspark.train.dataset import sha256_file as _sha256
from dspark.train.errors import TrainError


def pack(shards: list, out, *, target_file=None, chat_template: str | None = None, note: str = "") -> dict:
    """Pack JSONL shards (written by `dspark train data`) into `out`; returns the manifest."""
    out = Path(out)
    records, parts = [], []
    for p, shard in enumerate(shards):
        shard = Path(shard)
        recs = [_with_prompt_len(r, shard) for r in read_records(shard)]
        if not recs:
            raise TrainError(f"{shard} holds no records")
        side = shard.with_name(shard.name + ".meta.json")
        meta = json.loads(side.read_text()) if side.exists() else {}
        if len({r.get("key") for r in recs}) != len(recs):
            raise TrainError(f"{shard}: a key appears twice (not a shard written by `dspark train data`)")
        answer = sum(len(r["ids"]) - r["prompt_len"] for r in recs)
        parts.append({"shard": shard.name, "settings": meta, "sequences": len(recs), "answer_tokens": answer})
        records += [(p, r) for r in recs]
    vocab = {int(pt["settings"].get("vocab_size", 0)) for pt in parts} - {0}
    if len(vocab) > 1:
        raise TrainError(f"shards of different vocabularies {sorted(vocab)} cannot be packed together")
    top = max(max(r["ids"]) for _, r in records)
    dtype = np.uint16 if top < 2**16 else np.uint32
    lengths = np.array([len(r["ids"]) for _, r in records], dtype=np.int64)
    cats = sorted({str(r.get("category", "")) for _, r in records})
    arrays = {
        "ids": np.concatenate([np.asarray(r["ids"], dtype=dtype) for _, r in records]),
        "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        "prompt_len": np.array([r["prompt_len"] for _, r in records], dtype=np.int32),
        "finish": np.array([r.get("finish") == "stop" for _, r in records], dtype=np.uint8),
        "part": np.array([p for p, _ in records], dtype=np.int16),
        "category": np.array([cats.index(str(r.get("category", ""))) for _, r in records], dtype=np.int16),
        "keys": np.array([str(r["key"]) for _, r in records]),
    }
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (TOKENS + ".tmp.npz")
    # numpy's stub matches **arrays against its allow_pickle: bool keyword too
    np.savez_compressed(tmp, **arrays)  # type: ignore[arg-type]
    tmp.replace(out / TOKENS)
    prompt_tokens = int(arrays["prompt_len"].sum())
    manifest = {
        "format": FORMAT,
        "created": datetime.date.today().isoformat(),
        "note": note,
        "target": sorted({str(pt["settings"].get("target", "")) for pt in parts}),
        "target_file": None
        if target_file is None
        else {"name": Path(target_file).name, "sha256": _sha256(Path(target_file))},
        "chat_template_sha256": None if chat_template is None else hashlib.sha256(chat_template.encode()).hexdigest(),
        "vocab_size": next(iter(vocab), None),
        "parts": parts,
        "categories": cats,
        "counts": {
            "sequences": len(records),
            "prompt_tokens": prompt_tokens,
            "answer_tokens": int(lengths.sum()) - prompt_tokens,
            "cut_at_length": int((arrays["finish"] == 0).sum()),
        },
        "tokens_sha256": _sha256(out / TOKENS),
    }
    write_json(out / MANIFEST, manifest)
    return manifest


def _with_prompt_len(r: dict, shard: Path) -> dict:
    """The mask must be 'prompt (0) then answer (1)': that is all a packed set can represent."""
    ids, mask = r.get("ids"), r.get("loss_mask")
    if not isinstance(ids, list) or not isinstance(mask, list) or len(ids) != len(mask):
        raise TrainError(f'{shard}: record {r.get("key")!r} needs lists "ids" and "loss_mask" of equal length')
    p = r.get("prompt_len", mask.index(1) if 1 in mask else len(mask))
    if mask != [0] * p + [1] * (len(ids) - p):
        raise TrainError(
            f"{shard}: record {r.get('key')!r}: its loss mask is not 'answer after the prompt': not packable"
        )
    return {**r, "prompt_len": p}


def unpack(path, out) -> int:
    """Write a packed set back as a JSONL shard (with its sidecar); returns the number of records."""
    recs = read_packed(path)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    return len(recs)
