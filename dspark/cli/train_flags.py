"""The flags of `dspark train`'s stages: one sub-parser per stage, argument groups shared between them."""

from __future__ import annotations

import argparse

from dspark.cli.engine_flags import add_engine_flags
from dspark.formats.load import LAYOUTS
from dspark.target.load import RUNTIMES
from dspark.train.config import FEATURE_RUNTIMES, INIT_LAYERS, QUANT_AWARE

DATA_HELP = "a shard (.jsonl) or packed data set; several, comma-separated, train as one"


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
    g.add_argument(
        "--anchor-window",
        type=int,
        default=0,
        help="draw training anchors only among each answer's first N tokens, the part a reply of N "
        "tokens decodes (0: the whole answer)",
    )
    g.add_argument(
        "--quant-aware",
        default="none",
        choices=QUANT_AWARE,
        help="q4: compute the draft's matrices (fc, the layers') with the Q4_1 values the engine's default "
        "draft format holds, gradients straight through (none: float)",
    )
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
        help="let --init's draft differ from this run's in gamma, in which layers it taps (same tap "
        "count: its fc columns for tap i start this run's tap i) and in depth (a deeper run keeps the "
        "file's layers first; each new layer starts adding nothing: its output projections at zero)",
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
    g.add_argument(
        "--eval-max-anchors",
        type=int,
        default=64,
        help="with --eval-answer-tokens 0: anchors scored per held-out answer (drawn at random)",
    )
    g.add_argument(
        "--eval-answer-tokens",
        type=int,
        default=128,
        help="score each held-out answer's first N tokens at every anchor and walk them as greedy decoding "
        "does (walk_first_slot, walk_mal: what `dspark train eval --max-new-tokens N` measures in the "
        "engine; the best checkpoint is chosen by walk_mal); 0: whole answers, --eval-max-anchors "
        "anchors each, no walk",
    )
    g.add_argument("--ckpt-every", type=int, default=100)
    g.add_argument("--feature-batch-tokens", type=int, default=4096)
    g.add_argument(
        "--feature-runtime",
        default="auto",
        choices=FEATURE_RUNTIMES,
        help="target runtime computing the features: native (dspark's, where the architecture is "
        "supported: the default), hf (transformers with forward hooks); both give the model's own "
        "states. engine: dspark's runtime with the engine's numbers for a prompt (4-bit weights where "
        "exact, the CPU's activations, AMX tiles where the CPU has them): the target the draft is verified "
        "against, several times faster",
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
    p.add_argument(
        "--opening",
        action="append",
        default=None,
        help="words a sampled user turn starts with, the model writing the rest (repeatable: the batches "
        "take them in turn), to steer prompts toward a kind the target rarely writes unprompted, e.g. "
        "--opening 'Explain why' --opening 'How does'",
    )

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
        help="target runtime computing the features (auto: native where supported; engine: the "
        "engine's 4-bit numbers, several times faster)",
    )

    p = sub.add_parser("fit", help="train a draft (resumes from <out> when it holds a checkpoint)")
    _target_args(p)
    p.add_argument("--data", required=True, help=DATA_HELP)
    p.add_argument("--heldout", default=None, help="held-out shard for periodic evaluation")
    p.add_argument("--features", default="online", help="'online' or a feature-cache directory (built if absent)")
    p.add_argument("--out", required=True, help="run directory")
    _draft_args(p)
    _fit_args(p)

    p = sub.add_parser(
        "vocab",
        help="a copy of a draft over fewer tokens (those the answers use most), nothing retrained: "
        "a cheaper drafting phase",
    )
    p.add_argument("--draft", required=True, help="draft checkpoint to read (any family)")
    p.add_argument("--data", required=True, help=DATA_HELP + " (the answers that rank the tokens)")
    p.add_argument("--draft-vocab", type=int, required=True, help="tokens the new draft keeps")
    p.add_argument("--out", required=True, help="new (or empty) directory: a speculators-format draft")
    p.add_argument(
        "--target",
        default="smollm2",
        help="the target whose LM head rows a draft over its whole vocabulary borrows ('smollm2' or a "
        "Hugging Face model directory; read only for such a draft)",
    )

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
