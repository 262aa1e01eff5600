"""The DeepSpec objective: label alignment per layout, decay, prefix masks, confidence labels,
and that the teacher-forced training forward is exactly what decoding samples from."""

import math

import pytest
import torch
import torch.nn.functional as F
from dspark.engine.batch import Batch
from dspark.engine.drafting import propose, teacher_forced
from dspark.engine.sampling import SamplingParams
from dspark.train.errors import TrainError
from dspark.train.loss import (
    LossWeights,
    RowOutputs,
    draft_rows,
    loss_sums,
    make_blocks,
    row_terms,
    sample_anchors,
    slot_decay,
    valid_anchors,
)

from tests.tiny import tiny_draft, tiny_target

MASK = 3


def seq(n_prompt=4, n_answer=12):
    ids = torch.arange(10, 10 + n_prompt + n_answer)  # distinct tokens: position p holds token 10+p
    mask = torch.tensor([0] * n_prompt + [1] * n_answer, dtype=torch.bool)
    return ids, mask


def test_anchor_first_rows_predict_anchor_plus_k_plus_1():
    ids, mask = seq()
    a = 6
    b = make_blocks(ids, mask, torch.tensor([a]), layout="anchor_first", gamma=4, mask_token_id=MASK)
    assert b.block_ids.tolist() == [[ids[a].item(), MASK, MASK, MASK]]
    assert b.label_pos.tolist() == [[a + 1, a + 2, a + 3, a + 4]]
    assert ids[b.label_pos].tolist() == [[10 + a + 1, 10 + a + 2, 10 + a + 3, 10 + a + 4]]
    # Markov input of row k is the token just before the one it predicts; row 0 sees the anchor.
    assert b.prev_ids.tolist() == [[10 + a, 10 + a + 1, 10 + a + 2, 10 + a + 3]]
    assert b.slot_valid.tolist() == [[True] * 4]


def test_bonus_anchor_row0_masked_rows_predict_anchor_plus_k():
    ids, mask = seq()
    a = 6
    b = make_blocks(ids, mask, torch.tensor([a]), layout="bonus_anchor", gamma=4, mask_token_id=MASK)
    assert b.block_ids.tolist() == [[ids[a].item(), MASK, MASK, MASK, MASK]]
    assert b.label_pos[0, 1:].tolist() == [a + 1, a + 2, a + 3, a + 4]  # row k -> token a+k
    assert b.slot_valid.tolist() == [[False, True, True, True, True]]
    assert b.weight[0, 0] == 0
    # rows 0 and 1 both condition on the anchor (speculators' shifted prev tokens)
    assert b.prev_ids.tolist() == [[10 + a, 10 + a, 10 + a + 1, 10 + a + 2, 10 + a + 3]]


def test_decay_weights_per_layout():
    af = slot_decay("anchor_first", 5, 4.0)
    ba = slot_decay("bonus_anchor", 5, 4.0)
    expect = [math.exp(-k / 4) for k in range(5)]
    assert af.tolist() == pytest.approx(expect)
    assert ba.tolist() == pytest.approx([0.0] + expect)
    assert slot_decay("anchor_first", 3, 1.0).tolist() == pytest.approx([1.0, math.exp(-1), math.exp(-2)])
    with pytest.raises(TrainError):
        slot_decay("fill_in", 3, 4.0)


def test_prefix_mask_stops_at_end_of_response_and_at_holes():
    ids = torch.arange(20, 32)
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1], dtype=torch.bool)  # a hole at 6 (e.g. a tool turn)
    b = make_blocks(ids, mask, torch.tensor([3, 8]), layout="anchor_first", gamma=4, mask_token_id=MASK)
    # anchor 3: predicts 4, 5 (response), 6 (not), 7 (response but after the hole) -> prefix of 2
    assert b.slot_valid[0].tolist() == [True, True, False, False]
    # anchor 8: predicts 9, 10, 11, then 12 = past the end of the sequence
    assert b.slot_valid[1].tolist() == [True, True, True, False]
    bb = make_blocks(ids, mask, torch.tensor([3, 8]), layout="bonus_anchor", gamma=4, mask_token_id=MASK)
    assert bb.slot_valid.tolist() == [[False, True, True, False, False], [False, True, True, True, False]]
    assert (bb.weight[:, 1:] == b.weight).all()  # same absolute predictions, same weights


def test_valid_and_sampled_anchors():
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 0, 1], dtype=torch.bool)
    # a >= 1, mask[a] and mask[a+1]
    assert valid_anchors(mask).tolist() == [3, 4]
    ids, m = seq(4, 40)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    a1, a2 = sample_anchors(m, 8, g1), sample_anchors(m, 8, g2)
    assert a1.tolist() == a2.tolist() and len(set(a1.tolist())) == 8 and a1.tolist() == sorted(a1.tolist())
    assert set(a1.tolist()) <= set(valid_anchors(m).tolist())
    assert sample_anchors(m, None, None).tolist() == valid_anchors(m).tolist()
    # a window keeps the answer's first tokens only: counted from its first answer token
    first = int(m.nonzero()[0])
    windowed = sample_anchors(m, None, None, window=6)
    assert windowed.tolist() == [a for a in valid_anchors(m).tolist() if a < first + 6] and windowed.numel() > 0
    assert set(sample_anchors(m, 3, torch.Generator().manual_seed(1), window=6).tolist()) <= set(windowed.tolist())
    with pytest.raises(TrainError):
        make_blocks(ids, m, torch.tensor([0]), layout="anchor_first", gamma=2, mask_token_id=MASK)


def _rows(logits, target, labels, conf, weight, draft_ids=None):
    """Rows whose target distribution is softmax(target) over the whole vocabulary."""
    logp = F.log_softmax(target, -1)
    logp = logp if draft_ids is None else logp[:, draft_ids]
    return RowOutputs(
        logits,
        conf,
        logp,
        target.argmax(-1),
        torch.arange(len(labels)),
        labels,
        weight,
        torch.zeros(len(labels), 2, dtype=torch.long),
        draft_ids,
    )


def test_confidence_label_is_one_minus_half_l1():
    V = 6
    target = torch.tensor([[5.0, 0, 0, 0, 0, 0], [0.0, 0, 0, 0, 0, 9.0], [1.0, 2.0, 0, 0, 0, 0]])
    logits = torch.tensor([[5.0, 0, 0, 0, 0, 0], [30.0, 0, 0, 0, 0, 0], [2.0, 1.0, 0, 0, 0, 0]])
    out = _rows(logits, target, torch.tensor([0, 5, 1]), torch.zeros(3), torch.ones(3))
    ce, l1, bce, label = row_terms(out)
    p, q = F.softmax(logits, -1), F.softmax(target, -1)
    assert l1.tolist() == pytest.approx((p - q).abs().sum(-1).tolist(), abs=1e-6)
    assert label[0] == pytest.approx(1.0)  # identical distributions: always accepted
    assert label[1] == pytest.approx(1 - 0.5 * float(l1[1]), abs=1e-6) and label[1] < 0.01  # near-disjoint
    assert label[2] == pytest.approx(float((torch.minimum(p[2], q[2])).sum()), abs=1e-6)  # = sum min(p, q)
    assert bce.tolist() == pytest.approx(
        F.binary_cross_entropy_with_logits(torch.zeros(3), label, reduction="none").tolist()
    )
    assert not label.requires_grad and V == logits.shape[1]


def test_loss_sums_is_the_weighted_deepspec_formula():
    torch.manual_seed(0)
    logits = torch.randn(5, 11, requires_grad=True)
    target, conf = torch.randn(5, 11), torch.randn(5)
    labels, w = torch.randint(0, 11, (5,)), torch.tensor([1.0, 0.7, 0.5, 0.0, 0.3])
    s = loss_sums(_rows(logits, target, labels, conf, w), LossWeights())
    p, q = F.softmax(logits, -1), F.softmax(target, -1)
    l1 = (p - q).abs().sum(-1)
    lab = (1 - 0.5 * l1).clamp(0, 1).detach()
    manual = (
        w
        * (
            0.1 * F.cross_entropy(logits, labels, reduction="none")
            + 0.9 * l1
            + F.binary_cross_entropy_with_logits(conf, lab, reduction="none")
        )
    ).sum()
    assert float(s.total.detach()) == pytest.approx(float(manual.detach()), rel=1e-5)
    assert s.weight == pytest.approx(2.5)
    s.total.backward()
    assert logits.grad[3].abs().max() == 0  # a zero-weight row contributes nothing


@pytest.mark.parametrize(
    "layout,markov,rank",
    [
        ("anchor_first", "vanilla", 16),
        ("bonus_anchor", "rnn", 16),
        ("bonus_anchor", "gated", 8),
        ("anchor_first", "vanilla", 0),
    ],
)
def test_teacher_forced_rows_equal_what_decoding_samples_from(layout, markov, rank):
    """Train/inference consistency: feed the draft's own sampled tokens back as data; the training
    rows must reproduce the q the engine sampled each token from, slot by slot."""
    torch.set_num_threads(1)
    model = tiny_target()
    draft = tiny_draft(model, layout=layout, markov_rank=rank, markov_head_type=markov, gamma=4)
    L, a = 14, 9
    taps = torch.randn(L, len(draft.spec.hidden_state_indices) * 64)
    anchor_tok = 17
    ctx = draft.new_context_cache(1, "cpu", torch.float32)
    draft.extend_context(ctx, taps[None, :a], torch.tensor([a]))
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    prop = propose(draft, Batch(None, ctx, torch.tensor([anchor_tok]), [params], [gen]))
    ids = torch.cat([torch.randint(4, 90, (a,)), torch.tensor([anchor_tok]), prop.tokens[0]])
    ids = torch.cat([ids, torch.randint(4, 90, (L - len(ids),))])
    mask = torch.zeros(L, dtype=torch.bool)
    mask[a - 1 :] = True
    blocks = make_blocks(ids, mask, torch.tensor([a]), layout=layout, gamma=4, mask_token_id=3)
    with torch.no_grad():
        kv = draft.context_kv(taps[None], torch.arange(L)[None])
        out = draft_rows(draft, kv, blocks, ids, torch.randn(L, 64), model.get_output_embeddings())
    assert out.logits.shape[0] == 4
    assert torch.allclose(out.logits.softmax(-1), prop.q[0], atol=1e-5)
    assert out.labels.tolist() == prop.tokens[0].tolist()
    # the doctor's teacher-forced scores: fed the sampled tokens, the same q, slot by slot
    _, logp = teacher_forced(draft, torch.tensor([anchor_tok]), ctx, prop.tokens)
    want = prop.q[0].gather(1, prop.tokens[0][:, None])[:, 0].log().clamp(min=-10.0)
    assert torch.allclose(logp[0], want, atol=1e-4)
    if draft.confidence_head is not None:
        assert torch.allclose(out.conf_logits, prop.conf_logits[0], atol=1e-5)


def test_target_distribution_of_a_row_is_the_target_at_the_previous_position():
    torch.set_num_threads(1)
    model = tiny_target()
    for layout in ("anchor_first", "bonus_anchor"):
        draft = tiny_draft(model, layout=layout, gamma=3)
        ids, mask = seq(4, 10)
        L = len(ids)
        final = torch.randn(L, 64)
        blocks = make_blocks(ids, mask, torch.tensor([5, 8]), layout=layout, gamma=3, mask_token_id=3)
        with torch.no_grad():
            kv = draft.context_kv(torch.randn(1, L, 64 * len(draft.spec.hidden_state_indices)), torch.arange(L)[None])
            out = draft_rows(draft, kv, blocks, ids, final, model.get_output_embeddings())
            head = model.get_output_embeddings()(final)
        pos = [a + 1 + i for a in (5, 8) for i in range(3) if a + 1 + i < L]
        assert out.labels.tolist() == ids[pos].tolist()
        want = F.log_softmax(head[[p - 1 for p in pos]], -1)
        assert torch.allclose(out.target_logp[out.target_index], want, atol=1e-5)
        assert out.target_top[out.target_index].tolist() == want.argmax(-1).tolist()
        assert out.target_logp.shape[0] == len(set(pos))  # one target row per distinct position


def test_reduced_vocab_l1_counts_target_mass_outside_and_ce_skips_missing_labels():
    """A reduced draft vocabulary: q is 0 outside it, so ||p - q||_1 over the full vocabulary is the
    in-vocabulary distance plus the target's mass outside; a label outside has no draft logit."""
    torch.manual_seed(1)
    V, ids = 9, torch.tensor([0, 2, 3, 7])
    logits = torch.randn(3, ids.numel(), requires_grad=True)
    target = torch.randn(3, V)
    labels = torch.tensor([2, 5, 7])  # 5 is outside the draft vocabulary
    out = _rows(logits, target, labels, torch.zeros(3), torch.ones(3), draft_ids=ids)
    ce, l1, _, label = row_terms(out)
    q_full = torch.zeros(3, V)
    q_full[:, ids] = F.softmax(logits, -1)
    p = F.softmax(target, -1)
    assert l1.tolist() == pytest.approx((q_full - p).abs().sum(-1).tolist(), abs=1e-6)
    assert label.tolist() == pytest.approx(torch.minimum(q_full, p).sum(-1).tolist(), abs=1e-6)
    logq = F.log_softmax(logits.detach(), -1)
    assert ce.tolist() == pytest.approx([-float(logq[0, 1]), 0.0, -float(logq[2, 3])], abs=1e-6)
    assert out.draft_argmax().tolist() == ids[logits.argmax(-1)].tolist()


def test_draft_vocab_selection_ranks_answer_then_prompt_tokens():
    from dspark.train.dataset import Sequence
    from dspark.train.vocab import d2t_offsets, select_draft_vocab

    s = [
        Sequence("a", torch.tensor([8, 8, 8, 6, 5, 5, 9, 9, 1]), torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1]).bool()),
        Sequence("b", torch.tensor([6, 7, 9]), torch.tensor([0, 1, 1]).bool()),
    ]
    # answers: 9 x3, 5 x2, 7 x1, 1 x1; prompts: 8 x3, 6 x2
    assert select_draft_vocab(s, 10, 2).tolist() == [5, 9]
    assert select_draft_vocab(s, 10, 3).tolist() == [1, 5, 9]  # answer-count tie (1 and 7): lower id first
    assert select_draft_vocab(s, 10, 6).tolist() == [1, 5, 6, 7, 8, 9]  # then prompt tokens by count
    ids = select_draft_vocab(s, 10, 6)
    assert (d2t_offsets(ids) + torch.arange(6)).tolist() == ids.tolist()


@pytest.mark.parametrize("group", [32, 3])
def test_blocks_of_one_sequence_attended_together_equal_each_block_on_its_own_context(group, monkeypatch):
    """Training runs every block of a sequence as one masked attention over that sequence's
    context (and several sequences padded together): each block must get exactly the states,
    and the weights exactly the gradients, it gets run alone on its own copy of the context.
    A sliding-window causal layer and a full bidirectional one; group 3 splits a sequence's
    blocks over several attention groups."""
    import dataclasses

    from dspark.formats.spec import LayerAttention
    from dspark.model import draft as draft_mod

    monkeypatch.setattr(draft_mod, "GROUP_BLOCKS", group)
    torch.set_num_threads(1)
    model = tiny_target()
    base = tiny_draft(model, num_layers=2, gamma=3)
    spec = dataclasses.replace(base.spec, layer_attention=(LayerAttention(4, True), LayerAttention(None, False)))
    draft = draft_mod.DSparkDraft(spec)
    draft.load_state_dict(base.state_dict())
    n_taps = len(spec.hidden_state_indices)
    lengths = [12, 9, 15]
    taps = torch.zeros(3, 15, 64 * n_taps)
    for r, L in enumerate(lengths):
        taps[r, :L] = torch.randn(L, 64 * n_taps)
    anchors = [torch.tensor([1, 4, 5, 9]), torch.tensor([3, 7]), torch.tensor([2, 6, 8, 11, 13])]
    seq = torch.cat([torch.full((a.numel(),), r) for r, a in enumerate(anchors)])
    anchor = torch.cat(anchors)
    ids = torch.randint(4, 90, (anchor.numel(), spec.query_slots))

    def run(together: bool):
        draft.zero_grad()
        ctx = draft.context_kv(taps, torch.arange(15)[None].expand(3, -1))
        if together:
            h = draft(ids, ctx, anchor, seq)
        else:
            h = torch.cat(
                [
                    draft(
                        ids[i : i + 1],
                        [type(kv)(kv.k[seq[i]][None], kv.v[seq[i]][None]) for kv in ctx],
                        anchor[i : i + 1],
                    )
                    for i in range(anchor.numel())
                ]
            )
        (h * torch.linspace(-1, 1, h.numel()).view_as(h)).sum().backward()
        return h.detach(), {k: p.grad.clone() for k, p in draft.named_parameters() if p.grad is not None}

    h1, g1 = run(True)
    h0, g0 = run(False)
    assert torch.allclose(h1, h0, atol=1e-5)
    # fp32 sums in another order: within 1e-5 of each gradient's largest entry (the embedding's
    # reaches a few hundred here)
    assert set(g1) == set(g0)
    assert all(float((g1[k] - g0[k]).abs().max()) <= 1e-5 * float(g0[k].abs().max()) + 1e-6 for k in g0)


def test_the_target_head_computes_each_positions_full_vocabulary_once_and_agrees_without_its_memo():
    from dspark.train.loss import TargetHead

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 40, bias=True)
    calls = []
    head.register_forward_hook(lambda _m, inp, _o: calls.append(inp[0].shape[0]))
    ids = torch.tensor([1, 5, 6, 20, 33])
    final = torch.randn(10, 16)
    memo = TargetHead(head, ids, positions=10)
    plain = TargetHead(head, ids)
    for keys, new in ((torch.tensor([0, 3, 4]), 3), (torch.tensor([3, 4, 7, 9]), 2), (torch.tensor([0, 9]), 0)):
        with torch.no_grad():
            want_logp, want_top = F.log_softmax(head(final[keys]), -1)[:, ids], head(final[keys]).argmax(-1)
        calls.clear()
        got = memo(final[keys], keys)
        assert sum(calls) == new  # the whole vocabulary runs only on keys not seen before
        assert torch.allclose(got[0], want_logp, atol=1e-5) and got[1].tolist() == want_top.tolist()
        assert torch.allclose(plain(final[keys])[0], want_logp, atol=1e-5)
    assert int(memo.lse.isnan().sum()) == 10 - 5  # keys 0, 3, 4, 7, 9 and no other
