"""`dspark train probe`: what a draft's first slot could reach from given inputs, printed and
written as JSON (dspark.train.probe does the work)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from dspark.cli.train_data import load_model
from dspark.train.dataset import load_sequences
from dspark.train.errors import TrainError


def probe_stage(args) -> int:
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
    model, _ = load_model(args)
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
