"""Everything a training run depends on, saved with its checkpoint so a resume cannot drift.

Defaults suit SmolLM2-135M (30 layers, hidden 576, vocab 49152): 2 Qwen3-style layers as wide
as the target, taps at HF indices (2, 15, 28), Markov rank 64 (rank 256 would make W1/W2
alone 50 MB in bf16), gamma 7; DeepSpec's optimizer and loss settings (docs/DESIGN.md §5).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from dspark.formats.spec import MARKOV_HEAD_TYPES, Layout
from dspark.model.factory import make_spec
from dspark.train.errors import TrainError

# the target runtime of training features; auto: native where supported. engine: the native runtime
# with the engine's own numbers (4-bit weights where exact, the CPU's activations: dspark.train.features)
FEATURE_RUNTIMES = ("auto", "native", "engine", "hf")

INIT_LAYERS = ("random", "target")

# May differ between a run and its resume: they do not change what is computed.
QUANT_AWARE = ("none", "q4")  # --quant-aware: float, or the engine's Q4_1 values (train/quant_aware.py)
RESUMABLE_CHANGES = {
    "eval_every",
    "ckpt_every",
    "eval_max_anchors",
    "eval_answer_tokens",
    "feature_batch_tokens",
    "chunk_anchors",
    "feature_runtime",
    "out",
    "features",
    "heldout",
    "export_format",
    "verifier",
    "time_budget",
}


@dataclass
class DraftOptions:
    gamma: int = 7
    layout: Layout = "anchor_first"
    num_layers: int = 2
    intermediate_size: int | None = None  # None: the target's
    kv_heads: int | None = None  # None: the target's (each context position passes kv_heads * head_dim values)
    taps: tuple[int, ...] | None = None  # HF hidden_states indices; None: n_taps spread over the depth
    n_taps: int = 3
    markov_rank: int = 64  # 0: no Markov head (DFlash-style ablation)
    markov_head_type: str = "vanilla"
    confidence_head: bool = True
    mask_token_id: int = 0
    draft_vocab: int | None = None  # None: the target's vocabulary; N: the N most used tokens of the data (d2t)

    def check(self, num_target_layers: int, vocab_size: int) -> None:
        if self.layout not in ("anchor_first", "bonus_anchor"):
            raise TrainError(f"--layout must be anchor_first or bonus_anchor, got {self.layout!r}")
        for name in ("gamma", "num_layers", "n_taps"):
            if getattr(self, name) < 1:
                raise TrainError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.markov_rank < 0:
            raise TrainError(f"--markov-rank must be >= 0, got {self.markov_rank}")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise TrainError(
                f"--markov-type must be one of {', '.join(MARKOV_HEAD_TYPES)}, got {self.markov_head_type!r}"
            )
        if self.taps is not None:
            bad = [t for t in self.taps if not 0 <= t <= num_target_layers]
            if bad or not self.taps:
                raise TrainError(
                    f"--taps {list(self.taps)}: each must lie in 0..{num_target_layers} (input of layer i)"
                )
        if not 0 <= self.mask_token_id < vocab_size:
            raise TrainError(f"--mask-token-id {self.mask_token_id} outside the target vocabulary [0, {vocab_size})")
        if self.draft_vocab is not None and not 1 <= self.draft_vocab < vocab_size:
            raise TrainError(
                f"--draft-vocab must lie in [1, {vocab_size}) (leave it out for the full vocabulary), "
                f"got {self.draft_vocab}"
            )
        if self.kv_heads is not None and self.kv_heads < 1:
            raise TrainError(f"--kv-heads must be >= 1, got {self.kv_heads}")
        if self.intermediate_size is not None and self.intermediate_size < 1:
            raise TrainError(f"--intermediate-size must be >= 1, got {self.intermediate_size}")


@dataclass
class TrainConfig:
    target: str
    data: str
    out: str
    heldout: str | None = None
    features: str = "online"  # "online" or a feature-cache directory
    dtype: str = "bf16"  # the target's dtype (features); the draft trains in fp32
    draft: DraftOptions = field(default_factory=DraftOptions)
    epochs: float = 10.0
    steps: int | None = None  # overrides epochs
    batch_size: int = 8  # sequences per optimizer step, over all processes
    lr: float = 6e-4
    warmup: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    max_anchors: int | None = 64  # per sequence and step (DeepSpec samples up to 512; CPU budgets need fewer)
    anchor_window: int = 0  # > 0: training anchors only among each answer's first N tokens
    quant_aware: str = "none"  # "q4": the draft's matrices computed as the engine's Q4_1 ones (train/quant_aware.py)
    ce_weight: float = 0.1
    l1_weight: float = 0.9
    conf_weight: float = 1.0
    decay: float = 4.0
    head_dtype: str = "bf16"  # the frozen LM head's matmul in training (bf16: faster on CPU)
    tap_scale: bool = True  # train on taps / per-dim RMS, folded into fc at export (features.tap_scale)
    max_seq_len: int = 2048
    seed: int = 0
    eval_every: int = 100
    eval_max_anchors: int = 64
    # the held-out answers' first N tokens, every anchor, walked as decoding walks them (the figures
    # `dspark train eval --max-new-tokens N` measures in the engine); 0: whole answers, sampled anchors
    eval_answer_tokens: int = 128
    ckpt_every: int = 100
    feature_batch_tokens: int = 4096
    chunk_anchors: int = 1024  # blocks per draft forward in a step (memory, not math: see Run.chunks)
    feature_runtime: str = "auto"  # the target's runtime for features: auto (native where supported), native, hf
    export_format: str = "speculators"
    verifier: str | None = None  # recorded in exported speculators configs; default from the target
    data_tokens: int | None = None  # train on a seeded subset of about this many answer tokens (scaling curves)
    init: str | None = None  # warm start: a draft (directory) of this architecture; its vocabulary is kept
    init_layers: str = "random"  # "target": the draft's decoder layers start as copies of the target's last ones
    # warm start across a block size or a tap choice: the weights do not depend on gamma, and fc's
    # columns keep their order (tap i of the init file feeds the columns of this run's tap i)
    init_adapt: bool = False
    time_budget: float | None = None  # seconds: stop (and save) once a session has trained this long

    def check(self) -> None:
        positive = {
            "batch_size": self.batch_size,
            "lr": self.lr,
            "decay": self.decay,
            "max_seq_len": self.max_seq_len,
            "eval_every": self.eval_every,
            "ckpt_every": self.ckpt_every,
            "epochs": self.epochs,
            "feature_batch_tokens": self.feature_batch_tokens,
            "chunk_anchors": self.chunk_anchors,
            "eval_max_anchors": self.eval_max_anchors,
        }
        for name, v in positive.items():
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise TrainError(f"--{name.replace('_', '-')} must be a positive number, got {v!r}")
        if self.quant_aware not in QUANT_AWARE:
            raise TrainError(f"--quant-aware must be {' or '.join(QUANT_AWARE)}, got {self.quant_aware!r}")
        if not (isinstance(self.anchor_window, int) and self.anchor_window >= 0):
            raise TrainError(f"--anchor-window must be 0 (the whole answer) or more, got {self.anchor_window!r}")
        if not (isinstance(self.eval_answer_tokens, int) and self.eval_answer_tokens >= 0):
            raise TrainError(f"--eval-answer-tokens must be 0 (whole answers) or more, got {self.eval_answer_tokens!r}")
        if self.data_tokens is not None and self.data_tokens < 1:
            raise TrainError(f"--data-tokens must be >= 1, got {self.data_tokens}")
        if self.time_budget is not None and self.time_budget <= 0:
            raise TrainError(f"--time-budget must be > 0 seconds, got {self.time_budget}")
        if self.init_layers not in INIT_LAYERS:
            raise TrainError(f"--init-layers must be one of {', '.join(INIT_LAYERS)}, got {self.init_layers!r}")
        if self.init_adapt and self.init is None:
            raise TrainError("--init-adapt needs --init (the draft to start from)")
        if self.init_layers != "random" and self.init is not None:
            raise TrainError("--init-layers target and --init both set the draft's layers: choose one")
        if self.steps is not None and self.steps < 1:
            raise TrainError(f"--steps must be >= 1, got {self.steps}")
        if self.max_anchors is not None and self.max_anchors < 1:
            raise TrainError(f"--max-anchors must be >= 1, got {self.max_anchors}")
        if not 0 <= self.warmup < 1:
            raise TrainError(f"--warmup is a fraction of the steps in [0, 1), got {self.warmup}")
        if self.grad_clip <= 0 or self.weight_decay < 0 or min(self.ce_weight, self.l1_weight, self.conf_weight) < 0:
            raise TrainError("--grad-clip must be > 0; --weight-decay and the loss weights >= 0")
        if self.feature_runtime not in FEATURE_RUNTIMES:
            raise TrainError(
                f"--feature-runtime must be one of {', '.join(FEATURE_RUNTIMES)}, got {self.feature_runtime!r}"
            )
        if self.head_dtype not in ("bf16", "fp32"):
            raise TrainError(f"--head-dtype must be bf16 or fp32, got {self.head_dtype!r}")
        if self.export_format not in ("speculators", "deepspec"):
            raise TrainError(f"--format must be speculators or deepspec, got {self.export_format!r}")
        if self.export_format == "deepspec" and self.draft.layout != "anchor_first":
            raise TrainError("DeepSpec files are anchor-first: use --format speculators for --layout bonus_anchor")

    def to_json(self) -> dict:
        d = asdict(self)
        if d["draft"]["taps"] is not None:
            d["draft"]["taps"] = list(d["draft"]["taps"])
        return d

    @classmethod
    def from_json(cls, d: dict) -> TrainConfig:
        d = dict(d)
        draft = dict(d.pop("draft"))
        if draft.get("taps") is not None:
            draft["taps"] = tuple(draft["taps"])
        known = {f.name for f in fields(cls)}
        return cls(draft=DraftOptions(**draft), **{k: v for k, v in d.items() if k in known})

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")

    def locked_differences(self, other: TrainConfig) -> dict:
        """Settings that would change the run if changed at resume: {name: (saved, now)}."""
        a, b = self.to_json(), other.to_json()
        diff = {k: (a[k], b[k]) for k in a if k not in RESUMABLE_CHANGES and k != "draft" and a[k] != b.get(k)}
        diff.update({f"draft.{k}": (v, b["draft"].get(k)) for k, v in a["draft"].items() if v != b["draft"].get(k)})
        return diff


def draft_spec(cfg: TrainConfig, target_config, verifier: str | None = None):
    """The DraftSpec this run trains (Qwen3-style layers whatever the target's family)."""
    d = cfg.draft
    d.check(target_config.num_hidden_layers, target_config.vocab_size)
    return make_spec(
        target_config,
        gamma=d.gamma,
        layout=d.layout,
        num_layers=d.num_layers,
        n_taps=d.n_taps,
        taps=d.taps,
        markov_rank=d.markov_rank,
        markov_head_type=d.markov_head_type,
        confidence_head=d.confidence_head,
        mask_token_id=d.mask_token_id,
        intermediate_size=d.intermediate_size,
        num_key_value_heads=d.kv_heads,
        verifier=verifier,
        draft_vocab_size=d.draft_vocab,
    )
