"""Prompt files shared by the measuring commands (bench, bench-batch, calibrate).

A line is JSON (`{"turns": [first, ...]}` as in the paper's evaluation sets, `{"prompt": ...}`,
`{"text": ...}`, or `{"prompt_ids": [token ids]}`) or, in any other file, plain text.
"""

from __future__ import annotations

import json
from pathlib import Path

from dspark.errors import DSparkError


def _from_record(rec) -> str | list[int] | None:
    if not isinstance(rec, dict):
        return None
    ids = rec.get("prompt_ids")
    if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):
        return ids
    turns = rec.get("turns")
    if isinstance(turns, list) and turns and isinstance(turns[0], str) and turns[0].strip():
        return turns[0]
    for key in ("prompt", "text"):
        if isinstance(rec.get(key), str) and rec[key].strip():
            return rec[key]
    return None


def read_prompt_file(path, limit: int | None = None) -> list[str | list[int]]:
    path = Path(path)
    if not path.is_file():
        raise DSparkError(f"prompt file {path} does not exist")
    out: list[str | list[int]] = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if limit is not None and len(out) >= limit:
            break
        if not line.strip():
            continue
        if path.suffix != ".jsonl" and not line.lstrip().startswith("{"):
            out.append(line.strip())
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DSparkError(f"{path}:{n}: malformed JSON: {exc.msg}") from None
        prompt = _from_record(rec)
        if prompt is None:
            raise DSparkError(f"{path}:{n}: expected a \"prompt_ids\" list of ints, or a non-empty "
                              "\"turns\", \"prompt\" or \"text\"")
        out.append(prompt)
    if not out:
        raise DSparkError(f"prompt file {path} holds no prompts")
    return out


def encode_prompts(engine, prompts: list[str | list[int]], chat: bool) -> list[list[int]]:
    """Prompts of a prompt file -> token ids (a `prompt_ids` record is used as it is)."""
    return [p if isinstance(p, list) else engine.encode(p, chat=chat) for p in prompts]
