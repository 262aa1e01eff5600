"""Offline against online: the trainer's held-out acceptance (teacher-forced on the target's greedy
answers, dspark.train.evaluate) must predict what the engine then measures decoding the same
prompts. If they disagree, the trainer's figures (best checkpoint, scaling curves) mislead."""

from __future__ import annotations

import torch
from dspark.engine.sampling import SamplingParams
from dspark.model.load import load_draft
from dspark.train.dataset import Sequence
from dspark.train.evaluate import evaluate
from dspark.train.features import OnlineFeatures
from dspark.train.loss import LossWeights

from tests.tiny import engine_for
from tests.trained import VOCAB


def test_trainer_heldout_acceptance_agrees_with_the_engine(trained):
    model = trained["model"]
    draft = load_draft(trained["healthy"], model, dtype=torch.float32)
    g = torch.Generator().manual_seed(777)  # prompts the draft was not trained on
    prompts = torch.randint(4, VOCAB, (12, 8), generator=g)
    n = 40
    with torch.no_grad():
        out = model.generate(prompts, max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    mask = torch.zeros(out.shape[1], dtype=torch.bool)
    mask[8:] = True
    seqs = [Sequence(str(i), ids, mask) for i, ids in enumerate(out)]
    feats = OnlineFeatures(model, draft.spec.hidden_state_indices, seqs)
    offline = evaluate(draft, feats, seqs, model.get_output_embeddings(), max_anchors=10_000, weights=LossWeights())

    engine = engine_for(model, draft)
    for p, full in zip(prompts.tolist(), out.tolist()):
        req = engine.generate(p, SamplingParams(max_new_tokens=n))
        assert req.output_ids == full[8:]  # greedy: the engine decodes exactly the held-out answer
    online = engine.metrics.mean_accept_length
    # the engine also counts the steps cut short by the length cap, which the trainer leaves out
    assert offline["tau_greedy"] > 1.3 and online > 1.3
    assert abs(offline["tau_greedy"] - online) / online < 0.15, (offline["tau_greedy"], online)
