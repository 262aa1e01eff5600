"""Offline against online: the trainer's held-out acceptance (teacher-forced on the target's greedy
answers, dspark.train.evaluate) must predict what the engine then measures decoding the same
prompts. If they disagree, the trainer's figures (best checkpoint, scaling curves) mislead."""

from __future__ import annotations

import torch
from dspark.engine.sampling import SamplingParams
from dspark.model import fast
from dspark.model.load import load_draft
from dspark.train.dataset import Sequence
from dspark.train.evaluate import evaluate, walk_blocks
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
    head = model.get_output_embeddings()
    offline = evaluate(draft, feats, seqs, head, max_anchors=10_000, weights=LossWeights(), walk=True)

    # the draft's own fp32 numbers in the engine too (its kernels would run Q4_1 matrices and bf16
    # context): the walk then meets the engine step for step
    fast.set_weights(draft, "fp32")
    engine = engine_for(model, draft)
    steps: list[int] = []  # accepted tokens of each of a request's steps, as the engine records them
    record = engine.metrics.record
    engine.metrics.record = lambda d, v, a, source="draft": (steps.append(a), record(d, v, a, source))  # type: ignore[method-assign]
    walked = accepted = first = 0
    for i, (p, full) in enumerate(zip(prompts.tolist(), out.tolist())):
        steps.clear()
        req = engine.generate(p, SamplingParams(max_new_tokens=n))
        assert req.output_ids == full[8:]  # greedy: the engine decodes exactly the held-out answer
        # the decoding walk is the engine's own steps, in order, up to where a block no longer fits
        # the answer (the engine's last few steps run into the length cap)
        alone = OnlineFeatures(model, draft.spec.hidden_state_indices, seqs[i : i + 1])
        one = evaluate(draft, alone, seqs[i : i + 1], head, max_anchors=1, weights=LossWeights(), walk=True)
        k = one["walk_blocks"]
        assert len(steps) - 3 <= k <= len(steps), (steps, one)
        assert round((one["walk_mal"] - 1) * k) == sum(steps[:k]), (steps, one)
        assert round(one["walk_first_slot"] * k) == sum(a > 0 for a in steps[:k]), (steps, one)
        walked, accepted, first = walked + k, accepted + sum(steps[:k]), first + sum(a > 0 for a in steps[:k])
    assert offline["walk_blocks"] == walked
    assert abs(offline["walk_mal"] - (1 + accepted / walked)) < 1e-6
    assert abs(offline["walk_first_slot"] - first / walked) < 1e-6
    online = engine.metrics.mean_accept_length
    # the engine also counts the steps cut short by the length cap, which the trainer leaves out
    assert offline["tau_greedy"] > 1.3 and online > 1.3
    assert abs(offline["tau_greedy"] - online) / online < 0.15, (offline["tau_greedy"], online)


def test_walk_follows_the_accepted_prefix():
    hits = torch.tensor([[1, 0, 0], [1, 1, 1], [0, 1, 1], [1, 1, 0], [0, 0, 0], [1, 1, 1]], dtype=torch.bool)
    # anchor 3 accepts 1 -> anchor 5 accepts 0 -> anchor 6 accepts 2 -> anchor 9 has no block
    assert walk_blocks(torch.tensor([3, 4, 5, 6, 7, 8]), hits).int().tolist() == [[1, 0, 0], [0, 1, 1], [1, 1, 0]]
    # a gap in the anchors (a block that does not fit) ends the walk
    assert walk_blocks(torch.tensor([3, 5, 6]), hits[:3]).int().tolist() == [[1, 0, 0], [1, 1, 1]]
    assert walk_blocks(torch.tensor([4, 5, 6]), hits[1:4]).int().tolist() == [[1, 1, 1]]
    assert walk_blocks(torch.zeros(0, dtype=torch.long), hits[:0]).numel() == 0
