"""Prompt files: the one reader of every command that reads prompts (bench, bench-batch,
calibrate, doctor, and the training stages through dspark.train.prompts).

A file is JSON lines (`.jsonl`) or plain text, one prompt a line; either may be gzipped
(`.jsonl.gz`, `.txt.gz`: prompt sets kept in the repository are). A JSON line is
`{"turns": [first, ...]}` as in the paper's evaluation sets, `{"prompt": ...}`, `{"text": ...}`,
or `{"prompt_ids": [token ids]}`; in a file that is not `.jsonl`, a line starting with `{` is
read as JSON too by the measuring commands (training's prompt sets read text files as text).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

from dspark.errors import DSparkError


def prompt_lines(path, error=DSparkError, sniff_json: bool = True) -> Iterator[tuple[int, dict | str]]:
    """(line number, the JSON record or the stripped text) of each non-empty line; `error` is
    the exception class raised for a missing file or malformed JSON (naming file and line).
    sniff_json false: every line of a text file is text, a `{` at its start included."""
    path = Path(path)
    if not path.is_file():
        raise error(f"prompt file {path} does not exist")
    packed = path.suffix == ".gz"
    text = gzip.decompress(path.read_bytes()).decode("utf-8") if packed else path.read_text(encoding="utf-8")
    jsonl = (Path(path.stem).suffix if packed else path.suffix) == ".jsonl"
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if not jsonl and not (sniff_json and line.lstrip().startswith("{")):
            yield n, line.strip()
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as exc:
            raise error(f"{path}:{n}: malformed JSON: {exc.msg}") from None


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
    out: list[str | list[int]] = []
    for n, rec in prompt_lines(path):
        if limit is not None and len(out) >= limit:
            break
        prompt = rec if isinstance(rec, str) else _from_record(rec)
        if prompt is None:
            raise DSparkError(
                f'{path}:{n}: expected a "prompt_ids" list of ints, or a non-empty "turns", "prompt" or "text"'
            )
        out.append(prompt)
    if not out:
        raise DSparkError(f"prompt file {path} holds no prompts")
    return out


def encode_prompts(engine, prompts: Sequence[str | list[int]], chat: bool) -> list[list[int]]:
    """Prompts of a prompt file -> token ids (a `prompt_ids` record is used as it is)."""
    return [p if isinstance(p, list) else engine.encode(p, chat=chat) for p in prompts]
