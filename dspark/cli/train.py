"""`dspark train {data,features,fit,export,eval,all}`: the training pipeline on the command line.

`dspark train all --target smollm2 --out runs/smollm2` runs every stage, each resumable:
rerunning the same command continues where it stopped. `train eval` decodes, so it takes the
engine flags of every decoding command and builds its engine through dspark.api.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from dataclasses import replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dspark import envs
from dspark.api import EngineConfig, build_engine
from dspark.cli.engine_flags import add_engine_flags, engine_config, print_notes
from dspark.formats.load import LAYOUTS
from dspark.model.factory import default_taps
from dspark.outlock import output_lock
from dspark.target.load import RUNTIMES, load_target, resolve_target_file
from dspark.train.config import FEATURE_RUNTIMES, INIT_LAYERS, DraftOptions, TrainConfig
from dspark.train.data import GenSettings, eos_ids, generate_shard
from dspark.train.dataset import load_sequences
from dspark.train.e2e import engine_eval
from dspark.train.errors import TrainError
from dspark.train.export import export_run, size_mb
from dspark.train.features import build_cache, cache_bytes
from dspark.train.magpie import PromptSampling, protected_shingles, write_prompts
from dspark.train.prompts import bundled_path, load_prompts
from dspark.train.store import pack
from dspark.train.trainer import eval_line, train

DATA_HELP = "a shard (.jsonl) or packed data set; several, comma-separated, train as one"
STAGES = ("prompts", "data", "pack", "features", "fit", "export", "eval", "all")
LOCKED_STAGES = ("prompts", "data", "pack", "features", "fit", "export", "all")  # those whose --out they write


def _int_tuple(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _target_args(p) -> None:
    p.add_argument("--target", default="smollm2", help="'smollm2' or a Hugging Face model directory")
    p.add_argument("--dtype", default="bf16", help="target dtype (bf16 or fp32); the draft trains in fp32")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _data_args(p, prefix: str = "") -> None:
    p.add_argument("--max-new-tokens", type=int, default=256, help="answer length cap per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy answers (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = no top-k cut (DeepSpec regenerates with 20)")
    p.add_argument("--samples", type=int, default=1, help="sampled answers per prompt (needs --temperature > 0)")
    p.add_argument("--gen-batch-size", type=int, default=8, help="answers generated together")
    p.add_argument(
        "--generator",
        default="engine",
        choices=("engine", "hf"),
        help="engine: dspark's batched plain decoding (continuous batching, per-answer seeds); "
        "hf: transformers generate in left-padded batches (large GPU batches)",
    )
    p.add_argument("--runtime", default="auto", choices=RUNTIMES, help="target runtime of --generator engine")
    p.add_argument("--no-chat-template", action="store_true", help="feed raw prompts (base models)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts of each set")


def _draft_args(p) -> None:
    g = p.add_argument_group("draft architecture")
    g.add_argument("--gamma", type=int, default=7, help="draft tokens per step")
    g.add_argument("--layout", default="anchor_first", choices=LAYOUTS)
    g.add_argument("--layers", type=int, default=2, help="draft decoder layers")
    g.add_argument("--intermediate-size", type=int, default=None, help="draft MLP width (default: the target's)")
    g.add_argument(
        "--kv-heads",
        type=int,
        default=None,
        help="draft key/value heads (default: the target's); the values a context position passes "
        "to the block are kv-heads x head_dim wide",
    )
    g.add_argument("--taps", type=_int_tuple, default=None, help="HF hidden_states indices, e.g. 2,15,28")
    g.add_argument("--n-taps", type=int, default=3, help="taps spread over the depth when --taps is not given")
    g.add_argument("--markov-rank", type=int, default=64, help="0 = no Markov head (DFlash-style ablation)")
    g.add_argument("--markov-type", default="vanilla", choices=("vanilla", "gated", "rnn"))
    g.add_argument("--no-confidence-head", action="store_true")
    g.add_argument("--mask-token-id", type=int, default=0)
    g.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help="reduced draft vocabulary: the N tokens the training answers use most (d2t); "
        "default: the target's whole vocabulary",
    )


def _fit_args(p) -> None:
    g = p.add_argument_group("optimization")
    g.add_argument("--epochs", type=float, default=10.0)
    g.add_argument("--steps", type=int, default=None, help="total optimizer steps (overrides --epochs)")
    g.add_argument("--batch-size", type=int, default=8, help="sequences per step, over all processes")
    g.add_argument("--lr", type=float, default=6e-4)
    g.add_argument("--warmup", type=float, default=0.04, help="fraction of steps")
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--grad-clip", type=float, default=1.0)
    g.add_argument("--max-anchors", type=int, default=64, help="random anchors per sequence and step")
    g.add_argument("--decay", type=float, default=4.0, help="slot weight exp(-slot/decay)")
    g.add_argument(
        "--no-tap-scale",
        action="store_true",
        help="feed raw tapped states to fc in training (default: per-dimension RMS scaling, folded at export)",
    )
    g.add_argument("--ce-weight", type=float, default=0.1, help="weight of CE on the data tokens (DeepSpec: 0.1)")
    g.add_argument("--l1-weight", type=float, default=0.9, help="weight of ||p_draft - p_target||_1 (DeepSpec: 0.9)")
    g.add_argument("--conf-weight", type=float, default=1.0, help="weight of the confidence BCE (DeepSpec: 1.0)")
    g.add_argument("--max-seq-len", type=int, default=2048)
    g.add_argument(
        "--head-dtype",
        default="bf16",
        choices=("bf16", "fp32"),
        help="precision of the frozen LM head's matmul in training",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--data-tokens",
        type=int,
        default=None,
        help="train on a seeded subset of about N answer tokens (data-scaling curves)",
    )
    g.add_argument(
        "--init", default=None, help="warm start from this draft (same architecture; its draft vocabulary is kept)"
    )
    g.add_argument(
        "--init-adapt",
        action="store_true",
        help="let --init's draft differ from this run's in gamma and in which layers it taps (same tap "
        "count: its fc columns for tap i start this run's tap i)",
    )
    g.add_argument(
        "--init-layers",
        default="random",
        choices=INIT_LAYERS,
        help="start the draft's decoder layers random (default) or as copies of the target's last layers",
    )
    g.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds: stop this session after training that long (checkpoint saved; rerun to continue)",
    )
    g.add_argument("--eval-every", type=int, default=100)
    g.add_argument("--eval-max-anchors", type=int, default=64)
    g.add_argument("--ckpt-every", type=int, default=100)
    g.add_argument("--feature-batch-tokens", type=int, default=4096)
    g.add_argument(
        "--feature-runtime",
        default="auto",
        choices=FEATURE_RUNTIMES,
        help="target runtime computing the features: native (dspark's, where the architecture is "
        "supported: the default), hf (transformers with forward hooks); both give the same states",
    )
    g.add_argument(
        "--chunk-anchors",
        type=int,
        default=1024,
        help="blocks per draft forward within a step (a memory bound; the step's math is the same)",
    )
    g.add_argument(
        "--format",
        default="speculators",
        choices=("speculators", "deepspec"),
        help="format of the checkpoint export in <out>/draft",
    )
    g.add_argument("--verifier", default=None, help="verifier name recorded in speculators configs")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="stage", required=True)
    p = sub.add_parser("prompts", help="the target writes user prompts itself (Magpie), filtered")
    _target_args(p)
    p.add_argument("--n", type=int, required=True, help="prompts to keep")
    p.add_argument("--out", required=True, help=".jsonl to append to (resumable)")
    p.add_argument(
        "--protect",
        action="append",
        default=None,
        help="prompt file or folder of .jsonl sets no kept prompt may share an 8-word span with "
        "(repeatable; the bundled held-out set is always protected)",
    )
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-new-tokens", type=int, default=128, help="length cap of a sampled prompt")
    p.add_argument("--gen-batch-size", type=int, default=64)
    p.add_argument(
        "--max-batches",
        type=int,
        default=None,
        help="give up after this many batches (default: enough for a 25%% keep rate)",
    )
    p.add_argument("--seed", type=int, default=0)

    p = sub.add_parser("pack", help="store JSONL shards compactly (compressed token ids + manifest)")
    p.add_argument("shards", nargs="+", help="shards written by `dspark train data`")
    p.add_argument("--out", required=True, help="directory for tokens.npz and manifest.json")
    p.add_argument("--target", default="smollm2", help="recorded with the hash of its weights file")
    p.add_argument("--note", default="")

    p = sub.add_parser("data", help="self-distillation: the target answers a prompt set")
    _target_args(p)
    p.add_argument("--prompts", default="train", help="'train', 'heldout' or a .jsonl/.txt file")
    p.add_argument("--out", required=True, help="shard to append to (.jsonl)")
    p.add_argument("--seed", type=int, default=0)
    _data_args(p)

    p = sub.add_parser("features", help="cache the target's tapped and final hidden states (bf16)")
    _target_args(p)
    p.add_argument("--data", required=True, help=DATA_HELP)
    p.add_argument("--out", required=True, help="cache directory")
    p.add_argument("--taps", type=_int_tuple, default=None)
    p.add_argument("--n-taps", type=int, default=3)
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--feature-batch-tokens", type=int, default=4096)
    p.add_argument(
        "--feature-runtime",
        default="auto",
        choices=FEATURE_RUNTIMES,
        help="target runtime computing the features (auto: native where supported)",
    )

    p = sub.add_parser("fit", help="train a draft (resumes from <out> when it holds a checkpoint)")
    _target_args(p)
    p.add_argument("--data", required=True, help=DATA_HELP)
    p.add_argument("--heldout", default=None, help="held-out shard for periodic evaluation")
    p.add_argument("--features", default="online", help="'online' or a feature-cache directory (built if absent)")
    p.add_argument("--out", required=True, help="run directory")
    _draft_args(p)
    _fit_args(p)

    p = sub.add_parser("export", help="write a run's latest checkpoint as speculators or DeepSpec")
    p.add_argument("--run", required=True, help="run directory of `dspark train fit`")
    p.add_argument("--format", default="speculators", choices=("speculators", "deepspec"))
    p.add_argument("--out", required=True)
    p.add_argument("--verifier", default=None)

    p = sub.add_parser(
        "eval",
        help="greedy decoding through the engine, with and without the draft "
        "(full verification unless --verify is given)",
    )
    add_engine_flags(p)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--prompts", default="heldout")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--no-chat-template", action="store_true")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser(
        "probe",
        help="what a draft's first slot could reach from given inputs: a small network "
        "trained on exactly them, beside a bigram and a draft on the same held-out anchors",
    )
    _target_args(p)
    p.add_argument("--data", required=True, help=DATA_HELP)
    p.add_argument(
        "--heldout",
        required=True,
        help="held-out answers (the target's greedy ones); training answers to their prompts are dropped",
    )
    p.add_argument(
        "--inputs",
        default="final,embed",
        help="comma list: final (post-norm last hidden state at a-1), tap:N (input of layer N at a-1; "
        "N = the layer count: the last layer's output), embed (the anchor's embedding)",
    )
    p.add_argument(
        "--pairs", type=int, default=100_000, help="training anchors (every anchor of whole answers drawn with --seed)"
    )
    p.add_argument("--heldout-anchors", type=int, default=None, help="held-out anchors, seeded (default: all)")
    p.add_argument("--width", type=int, default=1024, help="the MLP's hidden width")
    p.add_argument("--batch-size", "--batch", dest="batch", type=int, default=512, help="anchors per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="optimizer steps (default: the time budget, or five passes over the pairs without one)",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds of optimization at most (the cosine decay follows the clock)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--features",
        default="online",
        help="'online' (the target runs on the drawn answers only) or a feature cache of `train "
        "features`/`train fit` holding the taps asked for (then --data-tokens, --data-seed and "
        "--max-seq-len must be the ones it was built with)",
    )
    p.add_argument("--data-tokens", type=int, default=None, help="draw from a seeded subset of about N answer tokens")
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument(
        "--draft",
        default=None,
        help="a draft whose own first slot is measured on the same anchors (default: the bundled one "
        "for smollm2); 'none' for no draft",
    )
    p.add_argument("--out", default=None, help="JSON file: settings, figures, curve, timings")

    p = sub.add_parser("all", help="data -> features -> fit -> export -> eval, each resumable")
    _target_args(p)
    p.add_argument("--out", required=True, help="directory for everything (data/, features/, run/, exports)")
    p.add_argument("--train-prompts", default="train")
    p.add_argument("--heldout-prompts", default="heldout")
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--online", action="store_true", help="recompute target features every step instead of caching")
    p.add_argument("--eval-prompts", type=int, default=40, help="held-out prompts decoded by the final engine check")
    p.add_argument("--eval-max-new-tokens", type=int, default=128)
    _data_args(p)
    _draft_args(p)
    _fit_args(p)


def run(args) -> int:
    if envs.world_size() > 1 and args.stage != "fit":
        raise TrainError(f"`dspark train {args.stage}` runs in one process; only `fit` is data-parallel under torchrun")
    # one writer per output (dspark/outlock.py); under torchrun the ranks of one fit share it: rank 0 holds it
    if args.stage not in LOCKED_STAGES or envs.rank() != 0:
        return _stage(args)
    with output_lock(args.out, f"dspark train {args.stage}"):
        return _stage(args)


def _stage(args) -> int:
    return {
        "prompts": _prompts_stage,
        "pack": _pack,
        "data": _data,
        "features": _features,
        "fit": _fit,
        "export": _export,
        "eval": _eval,
        "probe": _probe,
        "all": _all,
    }[args.stage](args)


# ---------------------------------------------------------------- stages


def _load(args):
    return load_target(args.target, args.dtype)


def _prompts(source: str, limit: int | None):
    if limit is not None and limit < 1:
        raise TrainError(f"--limit must be >= 1, got {limit}")
    return load_prompts(source)[:limit]


def _generator(args):
    """(model, tokenizer, engine or None) for the data stage."""
    if args.generator == "hf":
        return (*_load(args), None)
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


def _gen(model, tok, args, prompts: str, out, seed: int, engine=None) -> None:
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
        _prompts(prompts, args.limit),
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


def _prompts_stage(args) -> int:
    if args.n < 1 or args.gen_batch_size < 1:
        raise TrainError(f"--n and --gen-batch-size must be >= 1, got {args.n}, {args.gen_batch_size}")
    model, tok = _load(args)
    if tok is None:
        raise TrainError(f"target {args.target!r} has no tokenizer: it cannot write prompts")
    protected = protected_shingles([bundled_path("heldout"), *(Path(p) for p in args.protect or [])])
    s = PromptSampling(args.temperature, args.top_p, args.max_new_tokens, args.gen_batch_size, args.seed)
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


def _pack(args) -> int:
    target_file, template = resolve_target_file(args.target)
    m = pack(args.shards, args.out, target_file=target_file, chat_template=template, note=args.note)
    c = m["counts"]
    print(
        f"{args.out}: {c['sequences']} sequences, {c['answer_tokens']} answer tokens "
        f"({c['cut_at_length']} cut at the length cap), "
        f"{sum(f.stat().st_size for f in Path(args.out).iterdir()) / 2**20:.2f} MiB"
    )
    return 0


def _data(args) -> int:
    model, tok, engine = _generator(args)
    _gen(model, tok, args, args.prompts, args.out, args.seed, engine)
    return 0


def _features(args) -> int:
    model, _ = _load(args)
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


def _probe(args) -> int:
    from dspark.api import default_draft
    from dspark.model.load import load_draft
    from dspark.train import probe as P
    from dspark.train.dataset import token_subset
    from dspark.train.features import CachedFeatures, OnlineFeatures

    t_start = time.perf_counter()
    cfg = P.ProbeSettings(
        inputs=P.parse_inputs(args.inputs),
        pairs=args.pairs,
        heldout_anchors=args.heldout_anchors,
        width=args.width,
        batch=args.batch,
        lr=args.lr,
        steps=args.steps,
        time_budget=args.time_budget,
        seed=args.seed,
    )
    cfg.check()  # before the target loads
    model, _ = _load(args)
    cfg.check(model.config.num_hidden_layers)
    V, H = model.get_output_embeddings().weight.shape
    seqs = load_sequences(args.data, V, args.max_seq_len)
    if args.data_tokens is not None:
        seqs = token_subset(seqs, args.data_tokens, args.data_seed)
    held = load_sequences(args.heldout, V, args.max_seq_len)
    seqs_all = seqs
    seqs, dropped = P.without_heldout(seqs, held)
    if not seqs:
        raise TrainError(f"--data {args.data}: every training answer answers a held-out prompt")
    draft_path = None if args.draft == "none" else (args.draft or default_draft(args.target))
    draft = None if draft_path is None else load_draft(str(draft_path), model)
    taps = cfg.taps()
    progress = not args.quiet
    train_f: OnlineFeatures | CachedFeatures
    if args.features == "online":
        train_f, train_taps = OnlineFeatures(model, taps or (1,), seqs, runtime="auto"), taps or (1,)
    else:
        if len(seqs) != len(seqs_all):
            raise TrainError(
                f"--features {args.features}: {dropped} training answers answer held-out prompts; "
                "a cache is read by sequence index, so use --features online"
            )
        meta = Path(args.features) / "meta.json"
        cached = tuple(json.loads(meta.read_text())["taps"]) if meta.exists() else ()
        missing = [t for t in taps if t not in cached]
        if missing:
            raise TrainError(f"--features {args.features} caches taps {list(cached)}, not {missing}")
        train_f, train_taps = CachedFeatures(args.features, cached, seqs), cached
    held_taps = tuple(dict.fromkeys(taps + (() if draft is None else tuple(draft.spec.hidden_state_indices)))) or (1,)
    held_f = P.Remembered(OnlineFeatures(model, held_taps, held, runtime="auto"))

    picked = P.draw_sequences(seqs, cfg.pairs, cfg.seed)
    t0 = time.perf_counter()
    train_pairs = P.collect(train_f, seqs, picked, cfg.inputs, train_taps, H, progress, "probe features (training)")
    t_train_feat = time.perf_counter() - t0
    t0 = time.perf_counter()
    held_pairs = P.collect(
        held_f, held, list(range(len(held))), cfg.inputs, held_taps, H, progress, "probe features (held-out)"
    ).sample(cfg.heldout_anchors, cfg.seed)
    t_held_feat = time.perf_counter() - t0
    n = len(held_pairs)
    if not n:
        raise TrainError(f"--heldout {args.heldout}: no answer anchor (answers of 2+ tokens are needed)")

    embed = model.get_input_embeddings().weight if "embed" in cfg.inputs else None
    torch.manual_seed(cfg.seed)
    probe = P.Probe(
        train_pairs.states.shape[1],
        embed,
        model.get_output_embeddings().weight,
        cfg.width,
        eps=float(getattr(model.config, "rms_norm_eps", 1e-5)),
    )
    result = P.fit(probe, train_pairs, held_pairs, cfg, progress)
    t0 = time.perf_counter()
    hits = {"probe": P.agreement(probe, held_pairs)[0]}
    t_eval = time.perf_counter() - t0
    hits["bigram"] = P.bigram_hits(seqs, held_pairs, V)
    hits["bigram_pairs"] = P.bigram_hits([seqs[i] for i in picked], held_pairs, V)
    t_draft = None
    if draft is not None:
        t0 = time.perf_counter()
        drafted = P.draft_slot1_tokens(draft, held_f, held_taps, H, held, held_pairs, progress=progress)
        hits["draft"] = int((drafted == held_pairs.labels).sum())
        t_draft = time.perf_counter() - t0
    figures = {k: v / n for k, v in hits.items()}

    names = {
        "probe": f"probe ({','.join(cfg.inputs)}), {result.steps} steps",
        "bigram": f"bigram of the training answers ({len(seqs)})",
        "bigram_pairs": f"bigram of the probe's training answers ({len(picked)})",
        "draft": f"draft {draft_path} (its own first slot)",
    }
    held_seqs = int(held_pairs.where[:, 0].unique().numel())
    print(
        f"probe: inputs {','.join(cfg.inputs)}; {len(train_pairs)} training anchors from {len(picked)} answers "
        f"({dropped} training answers to held-out prompts dropped); {result.steps} steps, "
        f"{result.fit_seconds:.0f} s; {n} held-out anchors of {held_seqs} answers"
    )
    print("| first slot: held-out anchors where the token at a+1 is named | share | anchors |")
    print("|---|---:|---:|")
    for k, v in hits.items():
        print(f"| {names[k]} | {v / n:.3f} | {v} / {n} |")
    if args.out:
        rec = {
            "settings": cfg.to_json(),
            "target": args.target,
            "dtype": args.dtype,
            "data": args.data,
            "heldout": args.heldout,
            "features": args.features,
            "data_tokens": args.data_tokens,
            "data_seed": args.data_seed,
            "max_seq_len": args.max_seq_len,
            "draft": None if draft_path is None else str(draft_path),
            "training_answers": len(seqs),
            "dropped_heldout_prompts": dropped,
            "probe_answers": len(picked),
            "training_anchors": len(train_pairs),
            "heldout_answers": held_seqs,
            "heldout_anchors": n,
            "figures": figures,
            "hits": hits,
            "steps": result.steps,
            "curve": result.curve,
            "seconds": {
                "features_training": t_train_feat,
                "features_heldout": t_held_feat,
                "fit": result.fit_seconds,
                "curve_points": result.curve_seconds,
                "heldout_eval": t_eval,
                "draft": t_draft,
                "total": time.perf_counter() - t_start,
            },
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rec, indent=1) + "\n")
    return 0


def _config(args, data: str, heldout: str | None, features: str, out: str):
    d = DraftOptions(
        gamma=args.gamma,
        layout=args.layout,
        num_layers=args.layers,
        intermediate_size=args.intermediate_size,
        kv_heads=args.kv_heads,
        taps=args.taps,
        n_taps=args.n_taps,
        markov_rank=args.markov_rank,
        markov_head_type=args.markov_type,
        confidence_head=not args.no_confidence_head,
        mask_token_id=args.mask_token_id,
        draft_vocab=args.draft_vocab,
    )
    return TrainConfig(
        target=args.target,
        data=data,
        out=out,
        heldout=heldout,
        features=features,
        dtype=args.dtype,
        draft=d,
        epochs=args.epochs,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup=args.warmup,
        weight_decay=args.weight_decay,
        grad_clip=args.grad_clip,
        max_anchors=args.max_anchors,
        decay=args.decay,
        ce_weight=args.ce_weight,
        l1_weight=args.l1_weight,
        conf_weight=args.conf_weight,
        tap_scale=not args.no_tap_scale,
        head_dtype=args.head_dtype,
        max_seq_len=args.max_seq_len,
        seed=args.seed,
        eval_every=args.eval_every,
        eval_max_anchors=args.eval_max_anchors,
        ckpt_every=args.ckpt_every,
        feature_batch_tokens=args.feature_batch_tokens,
        chunk_anchors=args.chunk_anchors,
        feature_runtime=args.feature_runtime,
        export_format=args.format,
        verifier=args.verifier,
        data_tokens=args.data_tokens,
        time_budget=args.time_budget,
        init=args.init,
        init_layers=args.init_layers,
        init_adapt=args.init_adapt,
    )


def _report_fit(res) -> None:
    if not res.main:
        return
    first = f"{res.losses[0]:.4f} -> " if res.losses else ""
    last = f"{res.losses[-1]:.4f}" if res.losses else "(nothing left to train)"
    print(f"trained to step {res.step}/{res.total_steps} in {res.seconds / 60:.1f} min; loss {first}{last}")
    if res.eval:
        print(eval_line(res.step, res.eval))
    print(f"checkpoint: {res.draft_dir}")
    if res.best:
        print(
            f"best held-out acceptance: tau_greedy {res.best['tau_greedy']:.3f} at step {res.best['step']} "
            f"-> {Path(res.draft_dir).parent / 'best'}"
        )


def _fit(args) -> int:
    cfg = _config(args, args.data, args.heldout, args.features, args.out)
    _report_fit(train(cfg, progress=not args.quiet, echo=tqdm.write))
    return 0


def _export(args) -> int:
    out = export_run(args.run, args.out, args.format, args.verifier)
    print(f"{args.format} draft written to {out} ({size_mb(out):.1f} MiB)")
    return 0


def _print_eval(res: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(res, indent=2))
        return
    print(
        f"engine check on {res['prompts']} prompts (greedy): mean acceptance length {res['mean_accept_length']:.3f}, "
        f"speedup {res['speedup']:.2f}x ({res['spec_tok_s']:.1f} vs {res['plain_tok_s']:.1f} tok/s), "
        f"outputs equal to plain decoding: {res['outputs_equal_plain']}/{res['prompts']}"
    )
    print("  conditional acceptance per slot: " + " ".join(f"{x:.2f}" for x in res["conditional_accept"]))
    print("  marginal acceptance per slot:    " + " ".join(f"{x:.2f}" for x in res["marginal_accept"]))


def _eval(args) -> int:
    if args.no_spec:
        raise TrainError("train eval compares a draft with plain decoding: drop --no-spec")
    # it measures the draft: every step drafts and verifies every slot unless --verify says otherwise
    # (adaptive would skip drafting a draft that does not pay, and report acceptance of nothing)
    engine = build_engine(replace(engine_config(args), verify=args.verify or "full"))
    print_notes(engine)
    res = engine_eval(
        engine,
        _prompts(args.prompts, args.limit),
        max_new_tokens=args.max_new_tokens,
        chat_template=not args.no_chat_template,
        progress=not args.quiet,
    )
    _print_eval(res, args.json)
    return 0


def _all(args) -> int:
    t0 = time.perf_counter()
    root = Path(args.out)
    data, held = root / "data" / "train.jsonl", root / "data" / "heldout.jsonl"
    model, tok, engine = _generator(args)
    print("[1/4] self-distillation data")
    _gen(model, tok, args, args.train_prompts, data, args.data_seed, engine)
    _gen(model, tok, args, args.heldout_prompts, held, args.data_seed, engine)
    del model, engine  # the trainer loads its own copy
    print("[2/4] training" + (" (online features)" if args.online else " (features cached in bf16)"))
    cfg = _config(args, str(data), str(held), "online" if args.online else str(root / "features"), str(root / "run"))
    res = train(cfg, progress=not args.quiet, echo=tqdm.write)
    _report_fit(res)
    print("[3/4] export")
    # DeepSpec files are anchor-first and have no d2t: a reduced vocabulary is speculators-only
    deepspec_ok = args.layout == "anchor_first" and args.draft_vocab is None
    for fmt in ("speculators", "deepspec") if deepspec_ok else ("speculators",):
        dst = root / f"draft-{fmt}"
        shutil.rmtree(dst, ignore_errors=True)  # a rerun refreshes the exports from the latest checkpoint
        export_run(root / "run", dst, fmt, args.verifier)
        print(f"  {fmt}: {dst} ({size_mb(dst):.1f} MiB)")
    print("[4/4] engine check on held-out prompts")
    # as before this command had engine flags: no load-time check (training just measured the draft)
    engine = build_engine(
        EngineConfig(
            target=args.target, draft=str(root / "run" / "draft"), dtype=args.dtype, check=False, verify="full"
        )
    )
    prompts = _prompts(args.heldout_prompts, None)[: args.eval_prompts]
    ev = engine_eval(
        engine,
        prompts,
        max_new_tokens=args.eval_max_new_tokens,
        chat_template=not args.no_chat_template,
        progress=not args.quiet,
    )
    (root / "engine_eval.json").write_text(json.dumps(ev, indent=2) + "\n")
    _print_eval(ev, False)
    print(f"all stages done in {(time.perf_counter() - t0) / 60:.1f} min (this invocation)")
    return 0
