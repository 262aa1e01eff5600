"""`dspark train fit` and `export`: the flags become a TrainConfig, the trainer runs, its result is
reported; a run's checkpoint is exported."""

from __future__ import annotations

from pathlib import Path

from tqdm.auto import tqdm

from dspark.formats.load import load_spec
from dspark.target.load import load_target
from dspark.train.config import DraftOptions, TrainConfig
from dspark.train.dataset import load_sequences
from dspark.train.evaluate import eval_line
from dspark.train.export import export_run, size_mb
from dspark.train.trainer import train
from dspark.train.vocab import shrink_draft_vocab


def train_config(args, data: str, heldout: str | None, features: str, out: str):
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
        anchor_window=args.anchor_window,
        quant_aware=args.quant_aware,
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
        eval_answer_tokens=args.eval_answer_tokens,
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


def report_fit(res) -> None:
    if not res.main:
        return
    first = f"{res.losses[0]:.4f} -> " if res.losses else ""
    last = f"{res.losses[-1]:.4f}" if res.losses else "(nothing left to train)"
    print(f"trained to step {res.step}/{res.total_steps} in {res.seconds / 60:.1f} min; loss {first}{last}")
    if res.eval:
        print(eval_line(res.step, res.eval))
    print(f"checkpoint: {res.draft_dir}")
    if res.best:
        b = res.best
        figure = (
            f"walk_mal {b['walk_mal']:.3f} (first {b['answer_tokens']} answer tokens)"
            if b.get("measure") == "walk_mal"
            else f"tau_greedy {b['tau_greedy']:.3f}"
        )
        print(f"best held-out acceptance: {figure} at step {b['step']} -> {Path(res.draft_dir).parent / 'best'}")


def fit_stage(args) -> int:
    cfg = train_config(args, args.data, args.heldout, args.features, args.out)
    report_fit(train(cfg, progress=not args.quiet, echo=tqdm.write))
    return 0


def vocab_stage(args) -> int:
    spec = load_spec(args.draft, check_values=False)
    seqs = load_sequences(args.data, spec.vocab_size)

    def head():
        return load_target(args.target, "fp32")[0].get_output_embeddings().weight

    done = shrink_draft_vocab(args.draft, args.out, seqs, args.draft_vocab, target_head=head)
    print(
        f"draft vocabulary {spec.draft_vocab_size} -> {done.spec.draft_vocab_size} tokens, covering "
        f"{done.coverage_before:.2%} -> {done.coverage_after:.2%} of the answers' tokens; "
        f"written to {args.out} ({size_mb(args.out):.1f} MiB)"
    )
    return 0


def export_stage(args) -> int:
    out = export_run(args.run, args.out, args.format, args.verifier)
    print(f"{args.format} draft written to {out} ({size_mb(out):.1f} MiB)")
    return 0
