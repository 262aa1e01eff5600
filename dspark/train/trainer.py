"""The training loop: AdamW, linear warmup + cosine decay, gradient clipping, checkpoint/resume,
periodic held-out evaluation, a progress bar; data-parallel under torchrun (see distributed.py).
The draft's starting weights are dspark.train.warmstart's, checkpoints and resume
dspark.train.checkpoint's, the held-out evaluation dspark.train.evaluate's; this module runs the steps.

Everything random is derived from (seed, epoch, sequence index): the batch order of an epoch
and each sequence's anchors. So a resumed run replays exactly the steps an uninterrupted run
would, and N processes see the same global batch a single process does.

The run directory's layout is dspark.train.rundir. Nothing here prints: messages for the user go
to the caller's `echo` (the command layer passes one), progress bars only when `progress`.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dspark.model.load import build_draft
from dspark.target.load import load_target
from dspark.train import distributed
from dspark.train.checkpoint import (
    drop_replayed_records,
    export_checkpoint,
    keep_best,
    pack_state,
    restore_state,
    write_state,
)
from dspark.train.config import TrainConfig, draft_spec
from dspark.train.dataset import answer_heads, load_sequences, token_subset
from dspark.train.errors import TrainError
from dspark.train.evaluate import eval_line, evaluate
from dspark.train.export import default_verifier
from dspark.train.features import (
    CachedFeatures,
    OnlineFeatures,
    ScaledFeatures,
    build_cache,
    cache_bytes,
    data_digest,
    tap_scale,
)
from dspark.train.loss import LossWeights, TargetHead, draft_rows, loss_sums, make_blocks, pack_blocks, sample_anchors
from dspark.train.quant_aware import make_quant_aware
from dspark.train.rundir import CONFIG, DRAFT, METRICS, STATE, load_state, read_run_config
from dspark.train.warmstart import init_layers_from_target, init_output_norm, init_weights, load_init, reduce_vocab

Echo = Callable[[str], None]


def _silent(_line: str) -> None:
    pass


@dataclass
class TrainResult:
    step: int
    total_steps: int
    losses: list[float] = field(default_factory=list)  # per step run in this session
    eval: dict | None = None
    draft_dir: Path | None = None
    best: dict | None = None  # {"step", "tau_greedy"} of the checkpoint kept in <out>/best
    stopped_early: bool = False  # the time budget ended the session before the last step
    seconds: float = 0.0
    main: bool = True  # the process that reports (rank 0)


def lr_factor(total: int, warmup: float):
    """Linear warmup over `warmup` of the steps, then cosine to zero."""
    w = max(1, round(warmup * total)) if warmup > 0 else 0

    def f(step: int) -> float:
        if step < w:
            return (step + 1) / w
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - w) / max(1, total - w))))

    return f


def _seed(*parts: int) -> int:
    x = 0
    for p in parts:
        x = (x * 1_000_003 + int(p)) % (2**62)
    return x


class Run:
    """One training session over a run directory (fresh or resumed)."""

    def __init__(self, cfg: TrainConfig, ctx: distributed.DistContext, progress: bool, echo: Echo = _silent):
        self.cfg, self.ctx, self.progress, self.echo = cfg, ctx, progress, echo
        self.out = Path(cfg.out)
        self.resumed = (self.out / STATE).exists()
        if self.resumed:
            diff = read_run_config(self.out).locked_differences(cfg)
            if diff:
                raise TrainError(
                    f"{self.out} holds a run with other settings {diff} (saved, now): "
                    "resume with the same flags or choose another --out"
                )
        self.model, _ = load_target(cfg.target, cfg.dtype, device=ctx.device)
        vocab = self.model.get_output_embeddings().weight.shape[0]
        self.seqs = load_sequences(cfg.data, vocab, cfg.max_seq_len)
        if cfg.data_tokens is not None:
            self.seqs = token_subset(self.seqs, cfg.data_tokens, cfg.seed)
        self.data_digest = data_digest(self.seqs)
        self.held = load_sequences(cfg.heldout, vocab, cfg.max_seq_len) if cfg.heldout else None
        if self.held is not None and cfg.eval_answer_tokens:
            self.held = answer_heads(self.held, cfg.eval_answer_tokens)
        ver = default_verifier(cfg.target, self.model.config)
        if cfg.verifier:
            ver["name_or_path"] = cfg.verifier
        self.verifier = ver
        self.spec = draft_spec(cfg, self.model.config, verifier=ver["name_or_path"])
        self.draft = build_draft(self.spec, self.model, dtype=torch.float32)
        init_weights(self.draft, cfg.seed)
        init_output_norm(self.draft, self.model)
        if cfg.init_layers == "target" and not self.resumed:
            n = len(init_layers_from_target(self.draft, self.model))
            if ctx.main:
                self.echo(f"draft layers start as the target's last {len(self.draft.layers)} ({n} tensors copied)")
        warm = self._load_init(cfg.init) if cfg.init and not self.resumed else None
        if self.spec.has_d2t and warm is None:
            self._reduce_vocab()
        elif self.spec.has_d2t:
            self.draft.lm_head.weight.requires_grad_(False)
        self.draft.train()
        self.lm_head = self.model.get_output_embeddings()
        self.weights = LossWeights(cfg.ce_weight, cfg.l1_weight, cfg.conf_weight, cfg.decay)
        self.params = [p for p in self.draft.parameters() if p.requires_grad]
        # fused: one kernel over all parameters instead of ~10 elementwise passes per tensor (CPU and CUDA)
        self.opt = torch.optim.AdamW(
            self.params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay, fused=True
        )
        self.steps_per_epoch = math.ceil(len(self.seqs) / cfg.batch_size)
        self.total = cfg.steps or max(1, round(cfg.epochs * self.steps_per_epoch))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_factor(self.total, cfg.warmup))
        self.step, self.elapsed = 0, 0.0
        saved = load_state(self.out) if self.resumed else None
        if saved is not None:
            self._restore(saved)
        # after the restore: a resumed warm start's head rows (and d2t) are the checkpoint's, not the
        # vocabulary recomputed from the data above; a copy taken before would train against other rows
        w = self.draft.lm_head.weight
        self.head_weight = None
        if cfg.head_dtype == "bf16" and not w.requires_grad:  # a trainable head stays fp32
            self.head_weight = w.detach().to(torch.bfloat16)
        draft_ids = (
            None
            if self.draft.d2t is None
            else self.draft.to_target_ids(torch.arange(self.draft.d2t.numel(), device=self.draft.d2t.device))
        )
        self.offsets = [0]
        for s in self.seqs:
            self.offsets.append(self.offsets[-1] + len(s.ids))
        self.target_head = TargetHead(self.lm_head, draft_ids, positions=self.offsets[-1])
        self.held_head = TargetHead(self.lm_head, draft_ids, positions=sum(len(s.ids) for s in self.held or []))
        distributed.broadcast_parameters(ctx, self.draft)
        self.features: OnlineFeatures | CachedFeatures | ScaledFeatures = self._features()
        self.held_features: OnlineFeatures | ScaledFeatures | None = None
        if self.held is not None and ctx.main:
            self.held_features = OnlineFeatures(
                self.model, self.spec.hidden_state_indices, self.held, cfg.feature_batch_tokens, cfg.feature_runtime
            )
        self.tap_scale: torch.Tensor | None = None
        # a checkpoint from before tap scaling existed holds weights for raw taps: keep it that way
        if cfg.tap_scale and (saved is None or saved.get("tap_scale") is not None):
            self._scale_taps(None if saved is None else saved["tap_scale"])
        if warm is not None and self.tap_scale is not None:
            # the file's fc reads raw taps (the scale is folded in at export): unfold it for scaled taps
            with torch.no_grad():
                self.draft.fc.weight.mul_(self.tap_scale.to(self.draft.fc.weight.device)[None, :])
        n = make_quant_aware(self.draft, cfg.quant_aware, self.tap_scale)
        if n and ctx.main:
            self.echo(f"quant-aware: {n} matrices computed as the engine's Q4_1 ones (gradients straight through)")

    # ---- pieces --------------------------------------------------------------------------
    def _load_init(self, path: str) -> dict:
        """Warm start from `path` (dspark.train.warmstart.load_init); returns the file's tensors."""
        tensors, adapted = load_init(path, self.cfg.init_adapt, self.spec, self.draft)
        if self.ctx.main:
            changed = "".join(f", {k} {a} -> {b}" for k, (a, b) in adapted.items())
            self.echo(f"warm start from {path}{changed}")
        return tensors

    def _reduce_vocab(self) -> None:
        """The draft vocabulary from the training answers (dspark.train.warmstart.reduce_vocab)."""
        n, covered = reduce_vocab(self.draft, self.spec, self.seqs, self.model.get_output_embeddings().weight)
        if self.ctx.main:
            self.echo(
                f"draft vocabulary: {n} of {self.spec.vocab_size} tokens, covering {covered:.2%} "
                "of the training answer tokens"
            )

    def _features(self):
        taps = self.spec.hidden_state_indices
        if self.cfg.features == "online":
            return OnlineFeatures(self.model, taps, self.seqs, self.cfg.feature_batch_tokens, self.cfg.feature_runtime)
        path = Path(self.cfg.features)
        if not (path / "meta.json").exists() and self.ctx.main:
            build_cache(
                self.model,
                taps,
                self.seqs,
                path,
                target_name=self.cfg.target,
                runtime=self.cfg.feature_runtime,
                max_tokens=self.cfg.feature_batch_tokens,
                progress=self.progress,
            )
            self.echo(f"feature cache {path}: {cache_bytes(path) / 2**20:.1f} MiB (bf16)")
        distributed.barrier(self.ctx)
        return CachedFeatures(path, taps, self.seqs, self.cfg.feature_runtime)

    def _scale_taps(self, saved: torch.Tensor | None) -> None:
        """Train on taps / per-dimension RMS (features.tap_scale); exports fold it into fc."""
        if saved is None:  # the same sequences on every process: every rank gets the same scale
            saved = tap_scale(self.features, list(range(min(64, len(self.seqs)))), len(self.spec.hidden_state_indices))
        self.tap_scale = saved.float()
        self.features = ScaledFeatures(self.features, self.tap_scale)
        if self.held_features is not None:
            self.held_features = ScaledFeatures(self.held_features, self.tap_scale)

    def _restore(self, state: dict) -> None:
        self.step, self.elapsed = restore_state(
            state,
            run_dir=self.out,
            data=self.cfg.data,
            draft=self.draft,
            opt=self.opt,
            sched=self.sched,
            total=self.total,
            data_digest=self.data_digest,
        )
        if self.ctx.main:
            drop_replayed_records(self.out, self.step)

    def batch(self, step: int) -> tuple[int, list[int]]:
        epoch, pos = divmod(step, self.steps_per_epoch)
        g = torch.Generator().manual_seed(_seed(self.cfg.seed, epoch))
        perm = torch.randperm(len(self.seqs), generator=g).tolist()
        return epoch, perm[pos * self.cfg.batch_size : (pos + 1) * self.cfg.batch_size]

    def blocks(self, epoch: int, i: int):
        s, d = self.seqs[i], self.spec
        g = torch.Generator().manual_seed(_seed(self.cfg.seed, epoch, i, 7))
        anchors = sample_anchors(s.loss_mask, self.cfg.max_anchors, g, self.cfg.anchor_window)
        return make_blocks(
            s.ids,
            s.loss_mask,
            anchors,
            layout=d.layout,
            gamma=d.gamma,
            mask_token_id=d.mask_token_id,
            decay=self.cfg.decay,
        )

    def chunks(self, local: list[int], blocks: list) -> list[list[int]]:
        """Positions in `local` grouped so a chunk holds at most cfg.chunk_anchors blocks (a sequence
        with more goes alone): one draft forward per chunk instead of one per sequence."""
        out: list[list[int]] = []
        cur: list[int] = []
        n = 0
        for k, blk in enumerate(blocks):
            a = blk.anchors.numel()
            if a == 0:
                continue
            if cur and n + a > self.cfg.chunk_anchors:
                out.append(cur)
                cur, n = [], 0
            cur.append(k)
            n += a
        return out + ([cur] if cur else [])

    def chunk_rows(self, group: list[int], local: list[int], blocks: list, feats: list):
        """Draft outputs of a chunk of sequences in one forward: taps padded to the longest
        sequence (padding lies past every anchor, so the context mask hides it), each block
        reading its own sequence's context K/V."""
        dev = self.draft.fc.weight.device
        seqs = [self.seqs[local[k]] for k in group]
        lengths = [len(s.ids) for s in seqs]
        T = max(lengths)
        taps = torch.zeros(len(group), T, feats[group[0]][0].shape[-1], device=dev)  # [b, T, n_taps*Ht]
        for row, k in enumerate(group):
            taps[row, : lengths[row]] = feats[k][0].to(dev, torch.float32)
        ctx = self.draft.context_kv(taps, torch.arange(T, device=dev)[None].expand(len(group), -1))
        packed, seq = pack_blocks([blocks[k] for k in group], lengths)
        ids = torch.cat([s.ids for s in seqs])
        final = torch.cat([feats[k][1] for k in group])
        keys = torch.cat([torch.arange(self.offsets[local[k]], self.offsets[local[k] + 1]) for k in group])
        return draft_rows(self.draft, ctx, packed, ids, final, self.target_head, self.head_weight, seq=seq, keys=keys)

    def train_step(self, step: int) -> dict:
        epoch, batch = self.batch(step)
        local = batch[self.ctx.rank :: self.ctx.world]
        blocks = [self.blocks(epoch, i) for i in local]
        (denom,) = distributed.all_sum(self.ctx, [sum(float(b.weight.sum()) for b in blocks)])
        self.opt.zero_grad(set_to_none=True)
        sums = [0.0, 0.0, 0.0, 0.0]
        feats = self.features.get(local)
        for group in self.chunks(local, blocks):
            s = loss_sums(self.chunk_rows(group, local, blocks, feats), self.weights)
            (s.total / max(denom, 1e-9)).backward()
            sums = [a + b for a, b in zip(sums, (float(s.total.detach()), s.ce, s.l1, s.conf))]
        distributed.sum_gradients(self.ctx, self.params)
        gnorm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip))
        lr = self.sched.get_last_lr()[0]
        if denom > 0:  # a batch of one-token answers has no block: momentum alone must not move the weights
            self.opt.step()
        self.sched.step()
        tot = distributed.all_sum(self.ctx, sums)
        d = max(denom, 1e-9)
        return {
            "step": step + 1,
            "loss": tot[0] / d,
            "ce": tot[1] / d,
            "l1": tot[2] / d,
            "conf": tot[3] / d,
            "lr": lr,
            "grad_norm": gnorm,
            "weight": denom,
        }

    def evaluate(self) -> dict | None:
        if self.held_features is None:
            return None
        return evaluate(
            self.draft,
            self.held_features,
            self.held,
            self.held_head,
            max_anchors=self.cfg.eval_max_anchors,
            weights=self.weights,
            seed=self.cfg.seed,
            head_weight=self.head_weight,
            walk=self.cfg.eval_answer_tokens > 0,
        )

    def save(self) -> Path:
        """state.pt (atomic) and draft/ (bf16 export); main process only."""
        state = pack_state(
            step=self.step,
            total=self.total,
            elapsed=self.elapsed,
            data_digest=self.data_digest,
            draft=self.draft,
            tap_scale=self.tap_scale,
            opt=self.opt,
            sched=self.sched,
        )
        write_state(self.out, state)
        return self._export(self.out / DRAFT)

    def _export(self, dst: Path) -> Path:
        return export_checkpoint(dst, self.spec, self.draft, self.tap_scale, self.cfg.export_format, self.verifier)

    def save_best(self, ev: dict | None) -> dict | None:
        """Keep the checkpoint with the best held-out greedy acceptance in <out>/best (main process)."""
        return keep_best(self.out, ev, self.step, self._export, self.cfg.eval_answer_tokens)

    def evaluate_and_keep(self, result: TrainResult, echo: Echo | None) -> None:
        """Held-out evaluation at this step: logged, echoed (unless echo is None), best kept."""
        result.eval = self.evaluate()
        self.log({"step": self.step, "eval": result.eval})
        if echo is not None:
            echo(eval_line(self.step, result.eval))
        result.best = self.save_best(result.eval) or result.best

    def log(self, record: dict) -> None:
        with open(self.out / METRICS, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def train(cfg: TrainConfig, *, progress: bool = True, echo: Echo = _silent) -> TrainResult:
    """echo: where the run's messages go (vocabulary, feature cache, evaluations, interruption);
    with a progress bar open it should be the bar's writer (tqdm.write), not a bare print."""
    cfg.check()
    ctx = distributed.setup()
    try:
        return _train(cfg, ctx, progress, echo)
    finally:
        distributed.teardown(ctx)


def _train(cfg: TrainConfig, ctx: distributed.DistContext, progress: bool, echo: Echo) -> TrainResult:
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    run = Run(cfg, ctx, progress, echo)
    if ctx.main:
        cfg.save(run.out / CONFIG)
    result = TrainResult(run.step, run.total)
    if ctx.main and cfg.init and run.step == 0 and run.held is not None:
        # a warm start's baseline: the init draft is the best checkpoint until training beats it
        run.evaluate_and_keep(result, echo)
    bar = tqdm(total=run.total, initial=run.step, desc="train", unit="step", disable=not (progress and ctx.main))
    t0 = session_start = time.perf_counter()
    try:
        while run.step < run.total:
            rec = run.train_step(run.step)
            run.step += 1
            now = time.perf_counter()
            run.elapsed, t0 = run.elapsed + now - t0, now
            result.losses.append(rec["loss"])
            bar.update(1)
            bar.set_postfix(loss=f"{rec['loss']:.4f}", l1=f"{rec['l1']:.3f}", lr=f"{rec['lr']:.2e}")
            last = run.step == run.total
            if ctx.main:
                run.log({**rec, "elapsed": round(run.elapsed, 2)})
                if run.held is not None and (run.step % cfg.eval_every == 0 or last):
                    run.evaluate_and_keep(result, echo)
                if run.step % cfg.ckpt_every == 0 or last:
                    result.draft_dir = run.save()
            distributed.barrier(ctx)
            now = time.perf_counter()  # evaluation and checkpoints count toward the wall time too
            session = now - session_start
            run.elapsed, t0 = run.elapsed + now - t0, now
            # every rank counts the same steps; rank 0's clock decides, so all ranks stop at the same step
            (over,) = distributed.all_sum(
                ctx, [float(cfg.time_budget is not None and session >= cfg.time_budget and ctx.main)]
            )
            if over and run.step < run.total:
                if ctx.main:
                    if run.held is not None and run.step % cfg.eval_every:
                        run.evaluate_and_keep(result, None)
                    result.draft_dir = run.save()
                    echo(
                        f"time budget of {cfg.time_budget:.0f} s reached at step {run.step}/{run.total}: "
                        "checkpoint saved; rerun the same command to continue"
                    )
                result.stopped_early = True
                break
    except KeyboardInterrupt:
        if ctx.world == 1 and run.step > result.step:
            result.draft_dir = run.save()
            echo(f"interrupted: checkpoint saved at step {run.step}; rerun the same command to resume")
        raise
    finally:
        bar.close()
    result.step, result.seconds, result.main = run.step, run.elapsed, ctx.main
    result.draft_dir = run.out / DRAFT
    return result
