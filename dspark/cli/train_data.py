"""`dspark train prompts`, `data`, `pack` and `features`: the data engine's stages on the command line
(the target writes prompts, answers them, the answers are packed, their features cached)."""

from __future__ import annotations

import math
import time
from pathlib import Path

from dspark.api import EngineConfig, build_engine
from dspark.cli.engine_flags import print_notes
from dspark.model.factory import default_taps
from dspark.target.load import load_target, resolve_target_file
from dspark.train.data import GenSettings, eos_ids, generate_shard
from dspark.train.dataset import load_sequences
from dspark.train.errors import TrainError
from dspark.train.features import build_cache, cache_bytes
from dspark.train.magpie import PromptSampling, protected_shingles, write_prompts
from dspark.train.prompts import bundled_path, load_prompts
from dspark.train.store import pack


def load_model(args):
    return load_target(args.target, args.dtype)


def prompt_set(source: str, limit: int | None):
    if limit is not None and limit < 1:
        raise TrainError(f"--limit must be >= 1, got {limit}")
    return load_prompts(source)[:limit]


def generator(args):
    """(model, tokenizer, engine or None) for the data stage."""
    if args.generator == "hf":
        return (*load_model(args), None)
    engine = build_engine(
        EngineConfig(
            target=args.target,
            dtype=args.dtype,
            no_spec=True,
            runtime=args.runtime,
            check=False,
            max_batch=args.gen_batch_size,
        )
    )
    print_notes(engine)
    return engine.target.model, engine.tokenizer, engine


def answer_prompts(model, tok, args, prompts: str, out, seed: int, engine=None) -> None:
    if tok is None:
        raise TrainError(f"target {args.target!r} has no tokenizer: self-distillation needs one")
    s = GenSettings(
        args.max_new_tokens,
        args.temperature,
        args.top_p,
        seed,
        not args.no_chat_template,
        top_k=args.top_k,
        samples=args.samples,
    )
    st = generate_shard(
        model,
        tok,
        prompt_set(prompts, args.limit),
        out,
        s,
        target_name=args.target,
        batch_size=args.gen_batch_size,
        progress=not args.quiet,
        engine=engine,
    )
    print(
        f"{out}: {st.written} answers written ({st.tokens} tokens, {st.truncated} cut at --max-new-tokens) "
        f"at {st.tokens_per_s:.1f} answer tokens/s (batch {args.gen_batch_size}); "
        f"{st.skipped} of {st.total} answers already done"
    )


def prompts_stage(args) -> int:
    if args.n < 1 or args.gen_batch_size < 1:
        raise TrainError(f"--n and --gen-batch-size must be >= 1, got {args.n}, {args.gen_batch_size}")
    model, tok = load_model(args)
    if tok is None:
        raise TrainError(f"target {args.target!r} has no tokenizer: it cannot write prompts")
    protected = protected_shingles([bundled_path("heldout"), *(Path(p) for p in args.protect or [])])
    openings = tuple(args.opening or ())
    if any(not o.strip() for o in openings):
        raise TrainError("--opening takes the words a prompt starts with, got an empty one")
    s = PromptSampling(args.temperature, args.top_p, args.max_new_tokens, args.gen_batch_size, args.seed, openings)
    t = time.perf_counter()
    bound = args.max_batches or max(10, math.ceil(4 * args.n / args.gen_batch_size))
    rep = write_prompts(
        model,
        tok,
        args.n,
        args.out,
        sampling=s,
        stops=eos_ids(model, tok),
        protected=protected,
        max_batches=bound,
        progress=not args.quiet,
    )
    d = rep.to_dict()
    have = sum(1 for line in Path(args.out).read_text().splitlines() if line.strip()) if Path(args.out).exists() else 0
    print(
        f"{args.out}: kept {d['kept']} of {d['sampled']} sampled prompts in {time.perf_counter() - t:.0f} s; "
        f"the file holds {have} of the {args.n} asked for"
    )
    print("  rejected: " + (", ".join(f"{k} {v}" for k, v in d["rejected"].items()) or "none"))
    print("  categories: " + (", ".join(f"{k} {v}" for k, v in d["categories"].items()) or "none"))
    if have < args.n:
        raise TrainError(
            f"stopped after {bound} batches with {have} of {args.n} prompts: this target rarely writes a "
            "usable user turn (see the rejections above); rerun to continue or raise --max-batches"
        )
    return 0


def pack_stage(args) -> int:
    target_file, template = resolve_target_file(args.target)
    m = pack(args.shards, args.out, target_file=target_file, chat_template=template, note=args.note)
    c = m["counts"]
    print(
        f"{args.out}: {c['sequences']} sequences, {c['answer_tokens']} answer tokens "
        f"({c['cut_at_length']} cut at the length cap), "
        f"{sum(f.stat().st_size for f in Path(args.out).iterdir()) / 2**20:.2f} MiB"
    )
    return 0


def data_stage(args) -> int:
    model, tok, engine = generator(args)
    answer_prompts(model, tok, args, args.prompts, args.out, args.seed, engine)
    return 0


def features_stage(args) -> int:
    model, _ = load_model(args)
    taps = args.taps or default_taps(model.config.num_hidden_layers, args.n_taps)
    seqs = load_sequences(args.data, model.get_output_embeddings().weight.shape[0], args.max_seq_len)
    out = build_cache(
        model,
        tuple(taps),
        seqs,
        args.out,
        target_name=args.target,
        max_tokens=args.feature_batch_tokens,
        progress=not args.quiet,
        runtime=args.feature_runtime,
    )
    print(f"feature cache {out}: {len(seqs)} sequences, taps {list(taps)}, {cache_bytes(out) / 2**20:.1f} MiB (bf16)")
    return 0
