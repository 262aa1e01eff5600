"""Self-distillation: the target answers a prompt set; prompt+answer ids and the answer mask are saved.

Batched `transformers` generation with left padding (so every row's answer starts at the same
column). Each finished batch is appended to the shard and fsynced, so an interrupted run
resumes where it stopped; prompts already in the shard (same normalized text) are skipped.
A sidecar `<shard>.meta.json` pins the target and sampling settings: mixing answers of two
targets or two temperatures in one shard is refused rather than silently allowed.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dspark.engine.engine import Engine
from dspark.engine.sampling import SamplingParams
from dspark.target.text import encode_prompt as text_ids
from dspark.target.text import eos_ids as target_eos_ids
from dspark.train.dataset import read_records
from dspark.train.errors import TrainError
from dspark.train.prompts import Prompt, dedupe


@dataclass(frozen=True)
class GenSettings:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy, the decoding mode the bundled draft is measured in
    top_p: float = 1.0
    seed: int = 0
    chat_template: bool = True
    top_k: int = 0  # 0: no top-k cut (DeepSpec regenerates with T 0.7, top-p 0.8, top-k 20)
    samples: int = 1  # answers per prompt; sample k > 0 is keyed "<prompt key>#k"

    def check(self) -> None:
        if self.max_new_tokens < 2:
            raise TrainError(f"--max-new-tokens must be >= 2, got {self.max_new_tokens}")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise TrainError(
                f"need --temperature >= 0, 0 < --top-p <= 1 and --top-k >= 0, got {self.temperature}, "
                f"{self.top_p}, {self.top_k}"
            )
        if self.samples < 1 or (self.samples > 1 and self.temperature == 0):
            raise TrainError(
                f"--samples must be >= 1, and > 1 only with --temperature > 0 (greedy answers are all "
                f"the same), got {self.samples}"
            )


@dataclass
class GenStats:
    total: int  # distinct prompts
    skipped: int  # already in the shard
    written: int
    tokens: int  # answer tokens written now
    truncated: int  # answers cut by max_new_tokens (no end-of-turn token)
    seconds: float = 0.0  # generation wall time of this call

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def encode_prompt(tokenizer, text: str, chat_template: bool) -> list[int]:
    if chat_template and not getattr(tokenizer, "chat_template", None):
        raise TrainError("the tokenizer has no chat template: pass --no-chat-template to use raw prompts")
    return text_ids(tokenizer, text, chat_template)


def eos_ids(model, tokenizer) -> set[int]:
    ids = set(target_eos_ids(model, tokenizer))
    if not ids:
        raise TrainError("neither the tokenizer nor the model's generation config names an end-of-sequence token")
    return ids


def _check_meta(out: Path, meta: dict) -> None:
    side = out.with_name(out.name + ".meta.json")
    if side.exists():
        old = json.loads(side.read_text())
        diff = {k: (old.get(k), v) for k, v in meta.items() if old.get(k) != v}
        if diff:
            raise TrainError(f"{out} was generated with other settings {diff} (old, new): use another --out")
    else:
        side.write_text(json.dumps(meta, indent=2) + "\n")


def generate_shard(
    model,
    tokenizer,
    prompts: list[Prompt],
    out,
    settings: GenSettings,
    *,
    target_name: str,
    batch_size: int = 8,
    progress: bool = True,
    engine: Engine | None = None,
) -> GenStats:
    """Answer every prompt (settings.samples times) into `out`, skipping answers already there.

    engine: decode through dspark's batched engine (continuous batching: a finished row is refilled
    at once, no padding; the native runtime where it runs) instead of `transformers` generate
    (static left-padded batches; what a GPU with large batches wants). With the engine every
    sampled answer has its own seed (settings.seed, key), so it does not depend on batching."""
    settings.check()
    if batch_size < 1:
        raise TrainError(f"--batch-size must be >= 1, got {batch_size}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    vocab = model.get_output_embeddings().weight.shape[0]
    # answers of the two generators can differ in bf16 near-ties: one shard holds one generator's answers
    _check_meta(
        out,
        {
            "target": target_name,
            "vocab_size": vocab,
            **asdict(settings),
            "generator": "hf" if engine is None else "engine",
        },
    )
    prompts = dedupe(prompts)
    done = {r.get("key") for r in read_records(out, repair=True)}
    jobs = [(p, sample_key(p.key, k)) for p in prompts for k in range(settings.samples)]
    todo = [(p, key) for p, key in jobs if key not in done]
    # similar lengths batch together: less left padding (the order is fixed, so a resume forms the same batches)
    todo.sort(key=lambda job: len(job[0].text))
    stats = GenStats(len(jobs), len(jobs) - len(todo), 0, 0, 0)
    stops = eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stops)
    dev = next(model.parameters()).device
    t0 = time.perf_counter()
    bar = tqdm(total=len(todo), desc="self-distillation", unit="answer", disable=not progress)
    with open(out, "a", encoding="utf-8") as f:
        if engine is not None:
            _engine_answers(engine, tokenizer, todo, settings, batch_size, f, stats, bar, t0)
        for i in range(0, len(todo) if engine is None else 0, batch_size):
            batch = todo[i : i + batch_size]
            encoded = [encode_prompt(tokenizer, p.text, settings.chat_template) for p, _ in batch]
            # Seeded per batch from its first job. Batches are written whole, so a run resumed with the same
            # prompts and batch size forms the same batches and samples what an uninterrupted run would.
            torch.manual_seed(settings.seed * 1_000_003 + zlib.crc32(batch[0][1].encode()))
            answers = _generate(model, encoded, settings, pad, stops, dev)
            for (p, key), prompt_ids, (answer, finish) in zip(batch, encoded, answers):
                _write(f, stats, p, key, prompt_ids, answer, finish)
            _sync(f, stats, bar, len(batch), t0)
    bar.close()
    stats.seconds = time.perf_counter() - t0
    return stats


def _write(f, stats: GenStats, p: Prompt, key: str, prompt_ids: list[int], answer: list[int], finish: str) -> None:
    rec = {
        "key": key,
        "prompt": p.text,
        "category": p.category,
        "ids": prompt_ids + answer,
        "loss_mask": [0] * len(prompt_ids) + [1] * len(answer),
        "prompt_len": len(prompt_ids),
        "finish": finish,
    }
    f.write(json.dumps(rec) + "\n")
    stats.written += 1
    stats.tokens += len(answer)
    stats.truncated += finish == "length"


def _sync(f, stats: GenStats, bar, n: int, t0: float) -> None:
    """Whole records on disk before they count: an interrupted run resumes after the last synced one."""
    f.flush()
    os.fsync(f.fileno())
    bar.update(n)
    stats.seconds = time.perf_counter() - t0
    bar.set_postfix(tokens=stats.tokens, tok_s=f"{stats.tokens_per_s:.0f}")


def _engine_answers(
    engine: Engine, tokenizer, todo, settings: GenSettings, batch_size: int, f, stats: GenStats, bar, t0: float
) -> None:
    eng = engine.derive(speculative=False, max_batch=batch_size)
    pending, order = {}, []
    for p, key in todo:
        ids = encode_prompt(tokenizer, p.text, settings.chat_template)
        seed = zlib.crc32(f"{settings.seed}:{key}".encode())
        params = SamplingParams(
            max_new_tokens=settings.max_new_tokens,
            temperature=settings.temperature,
            top_k=settings.top_k,
            top_p=settings.top_p,
            seed=seed,
        )
        req = eng.add_request(ids, params)
        pending[id(req)] = (req, p, key, ids)
        order.append(req)
    admitted = unsynced = 0
    while pending:
        finished = eng.step()
        # requests are admitted in order; one can also finish at its prefill (a one-token answer)
        now = len(order) - len(eng.waiting)
        finished += [r for r in order[admitted:now] if r.finished]
        admitted = now
        for done in finished:
            job = pending.pop(id(done), None)
            if job is None:
                continue
            req, p, key, ids = job
            _write(f, stats, p, key, ids, list(req.output_ids), "stop" if req.finish_reason == "stop" else "length")
            unsynced += 1
        if unsynced >= batch_size or (unsynced and not pending):
            _sync(f, stats, bar, unsynced, t0)
            unsynced = 0


def sample_key(key: str, k: int) -> str:
    return key if k == 0 else f"{key}#{k}"


@torch.inference_mode()
def _generate(
    model, encoded: list[list[int]], s: GenSettings, pad: int, stops: set[int], dev
) -> list[tuple[list[int], str]]:
    width = max(len(e) for e in encoded)
    ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded], device=dev)
    attn = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded], device=dev)
    kw = (
        dict(do_sample=True, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
        if s.temperature > 0
        else dict(do_sample=False)
    )
    out = model.generate(
        input_ids=ids,
        attention_mask=attn,
        max_new_tokens=s.max_new_tokens,
        pad_token_id=pad,
        eos_token_id=sorted(stops),
        **kw,
    )
    answers = []
    for row in out[:, width:].tolist():
        cut = next((j for j, t in enumerate(row) if t in stops), None)
        answers.append((row[: cut + 1], "stop") if cut is not None else (row, "length"))
    return answers
