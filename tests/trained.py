"""A tiny target that has learnt a pattern, and a draft trained on it with dspark.train's pieces.

- the target (2 layers) learns to continue a period-5 pattern of its prompt: its next token
  depends on the context, not on the last token alone (a random tiny target loops on one
  token, which every draft reading predicts alike);
- the draft (and a weak one, fewer steps) is fitted with the training pipeline's own pieces
  (dspark.train.loss: make_blocks,
  draft_rows, loss_sums; dspark.train.trainer.init_weights) on the target's greedy answers to
  random prompts, anchor-first, taps (1, 2), mask token 1.
The `trained` fixture (session scope, shared by xdist workers through a file lock) is
registered in conftest.py.
"""

from __future__ import annotations

import os

import pytest
import torch
from dspark.formats.convert import write_deepspec
from dspark.formats.load import load_spec

from tests.tiny import tiny_target

PERIOD, VOCAB, MASK, TAPS = 5, 64, 1, (1, 2)
WEAK_STEPS = 90  # draft training steps of the weak draft (the healthy one: 240)


def _train_target(steps: int = 140):
    model = tiny_target(seed=0, vocab=VOCAB, layers=2, hidden=64).train()
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        pattern = torch.randint(4, VOCAB, (32, PERIOD), generator=g)
        x = torch.cat([torch.ones(32, 1, dtype=torch.long), pattern.repeat(1, 8)[:, :40]], 1)
        logits = model(x).logits[:, PERIOD:-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x[:, PERIOD + 1 :].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def _train_draft(model, steps: int = 240, layout: str = "anchor_first", scaled: bool = False, seed: int = 123):
    """scaled: as `dspark train` does by default, fc reads taps / their per-dimension RMS over the
    answers, and the scale is folded into fc at the end (its weight fingerprint)."""
    from dspark.model.factory import make_spec
    from dspark.model.load import build_draft
    from dspark.model.taps import per_dim_rms
    from dspark.train.dataset import Sequence
    from dspark.train.features import TapCapture, fold_tap_scale, run_target
    from dspark.train.loss import LossWeights, draft_rows, loss_sums, make_blocks, sample_anchors
    from dspark.train.trainer import init_weights

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # equal-length prompts: one batched greedy call, no padding
        prompts = torch.randint(4, VOCAB, (32, 8), generator=g)
        out = model.generate(prompts, max_new_tokens=36, do_sample=False, pad_token_id=0, eos_token_id=None)
    mask = torch.zeros(out.shape[1], dtype=torch.bool)
    mask[8:] = True
    seqs = [Sequence(str(i), ids, mask) for i, ids in enumerate(out)]
    spec = make_spec(
        model.config,
        gamma=4,
        layout=layout,
        num_layers=1,
        taps=TAPS,
        markov_rank=16,
        mask_token_id=MASK,
        intermediate_size=128,
    )
    draft = build_draft(spec, model, dtype=torch.float32)
    init_weights(draft, 0)
    draft.train()
    cap = TapCapture(model, spec.hidden_state_indices)
    with torch.no_grad():
        feats = run_target(model, cap, seqs)
    cap.close()
    scale = None
    if scaled:
        scale = per_dim_rms(torch.cat([t[8:] for t, _ in feats]), len(TAPS))
        feats = [(t / scale, f) for t, f in feats]
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95))
    head, weights = model.get_output_embeddings(), LossWeights()
    for _ in range(steps):
        idx = torch.randint(0, len(seqs), (4,), generator=g).tolist()
        blocks = [
            make_blocks(
                seqs[i].ids,
                seqs[i].loss_mask,
                sample_anchors(seqs[i].loss_mask, 32, g),
                layout=spec.layout,
                gamma=spec.gamma,
                mask_token_id=spec.mask_token_id,
            )
            for i in idx
        ]
        denom = sum(float(b.weight.sum()) for b in blocks)
        opt.zero_grad()
        for i, blk in zip(idx, blocks):
            taps, final = feats[i]
            kv = draft.context_kv(taps[None], torch.arange(len(seqs[i].ids))[None])
            (loss_sums(draft_rows(draft, kv, blk, seqs[i].ids, final, head), weights).total / denom).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    if scale is not None:
        with torch.no_grad():
            draft.fc.weight.copy_(fold_tap_scale(draft.fc.weight, scale))
    return draft.eval()


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """Trained once per test session: under pytest-xdist the first worker trains and saves, the
    others wait on a lock and load (the directory above a worker's basetemp is the session's)."""
    import fcntl

    from dspark.formats.load import load_weights
    from transformers import AutoModelForCausalLM

    worker = os.environ.get("PYTEST_XDIST_WORKER")
    root = tmp_path_factory.getbasetemp().parent / "doctor-trained" if worker else tmp_path_factory.mktemp("doctor")
    root.mkdir(exist_ok=True)
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "weak" / "config.json").exists():
            model = _train_target()
            draft = _train_draft(model)
            model.save_pretrained(root / "target")
            write_deepspec(draft.spec, draft.own_state_dict(), root / "healthy")
            # a weak draft of the same target (acceptance length about 1.5, as first CPU drafts are)
            weak = _train_draft(model, steps=WEAK_STEPS)
            write_deepspec(weak.spec, weak.own_state_dict(), root / "weak")
    model = AutoModelForCausalLM.from_pretrained(root / "target", dtype=torch.float32).eval()
    spec = load_spec(root / "healthy")
    weak = load_spec(root / "weak")
    return {
        "root": root,
        "target": str(root / "target"),
        "healthy": str(root / "healthy"),
        "spec": spec,
        "tensors": load_weights(spec),
        "model": model,
        "weak": str(root / "weak"),
        "weak_spec": weak,
        "weak_tensors": load_weights(weak),
    }
