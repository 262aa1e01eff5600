"""The draft phase in one compiled call (csrc/draft.cpp via dspark/model/fast.py) against the
reference: the draft's modules (`DSparkDraft.forward`, `extend_context` on torch's ops) and a
float64 walk over their states."""

from __future__ import annotations

import copy

import pytest
import torch
from dspark import kernels
from dspark.engine import drafting as S
from dspark.engine.engine import Engine
from dspark.engine.sampling import SamplingParams
from dspark.model import fast
from dspark.target.native import NativeTarget

from tests.tiny import bigram_draft, q4_exact, tiny_draft, tiny_target

FORMATS = ("bf16", "q8", "q4", "auto")


@pytest.fixture(scope="module", autouse=True)
def tile():
    if kernels.extension() is None or kernels.tile_name() is None:
        pytest.skip(f"dspark's CPU kernels do not run here: {kernels.why_unavailable()}")


def _batch(draft, taps, counts, anchors, *, modules: bool):
    """A batch whose draft context holds `taps` (first counts[b] committed), built on the kernels
    or on the modules."""
    ctx = draft.new_context_cache(taps.shape[0], "cpu", torch.bfloat16, kernels=not modules)
    draft.extend_context(ctx, taps, counts)
    return S.Batch(None, ctx, anchors, [SamplingParams()] * taps.shape[0], [None] * taps.shape[0])


def _rounded(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """w as the kernels hold it in `fmt`, dequantised to fp32 (groups of 32 inputs, zero-padded)."""
    if fmt == "bf16":
        return w.float()
    pad = -w.shape[1] % 32
    g = torch.nn.functional.pad(w.float(), (0, pad)).reshape(w.shape[0], -1, 32)
    if fmt == "q8":
        d = (g.abs().amax(-1) / 127).half().float()[..., None]
        out = (g / torch.where(d > 0, d, 1.0)).round().clamp(-127, 127) * d
    else:
        lo = g.amin(-1).half().float()[..., None]
        d = ((g.amax(-1, keepdim=True) - lo) / 15).half().float()
        out = ((g - lo) / torch.where(d > 0, d, 1.0)).round().clamp(0, 15) * d + lo
    return out.reshape(w.shape[0], -1)[:, : w.shape[1]]


def _reference(draft, fmt: str):
    """The model the one call computes: an fp32 copy of the draft with every matrix rounded as the
    kernels hold it (the head and W2 Q8_0, Q4_1 in the q4 format; auto: the q4 format's matrices
    with the Q8_0 head)."""
    held, draft._fast = draft._fast, {}  # the kernels' copy holds the extension: not copied
    ref = copy.deepcopy(draft).float()
    draft._fast = held
    with torch.no_grad():
        mats = [ref.fc] + [
            m
            for ly in ref.layers
            for m in (
                ly.self_attn.q_proj,
                ly.self_attn.k_proj,
                ly.self_attn.v_proj,
                ly.self_attn.o_proj,
                ly.mlp.gate_proj,
                ly.mlp.up_proj,
                ly.mlp.down_proj,
            )
        ]
        for m in mats:
            m.weight.copy_(_rounded(m.weight, "q4" if fmt == "auto" else fmt))
        head_fmt = "q4" if fmt == "q4" else "q8"
        ref.lm_head.weight.copy_(_rounded(ref.lm_head.weight, head_fmt))
        w2 = ref.markov_head.markov_w2.weight
        w2.copy_(_rounded(w2, head_fmt))
    return ref


def _reference_walk(ref, taps, counts, anchors, tokens):
    """The reference's block states over the same context, and float64 logits of each slot with
    the Markov bias of the previous token the kernels chose: (h, logits [B, g, Vd])."""
    with torch.inference_mode():
        ctx = ref.new_context_cache(taps.shape[0], "cpu", torch.float32)
        ref.extend_context(ctx, taps.float(), counts)
        h = ref.block_states(anchors, ctx)[:, : tokens.shape[1]].double()
    mh = ref.markov_head
    prev = torch.cat([anchors[:, None], tokens[:, :-1]], 1)
    logits = h @ ref.lm_head.weight.double().T + mh.markov_w1.weight.double()[prev] @ mh.markov_w2.weight.double().T
    return h, logits


@pytest.mark.parametrize("kv", [None, 4], ids=["gqa", "mha"])  # the target's 2 key/value heads, or one per head
@pytest.mark.parametrize("fmt", FORMATS)
def test_one_call_drafts_what_the_modules_would(fmt, kv):
    """Greedy proposals from the one call, in a ragged batch, against the draft's modules in fp32
    with each matrix rounded as the kernels hold it in `fmt`: the head's logits within 2^-5 of the
    largest (bf16 activations), each slot's token the modules' argmax of U h + W2 W1[previous
    token] wherever the top two are clear of that rounding, the confidences up to it."""
    model = tiny_target()
    draft = tiny_draft(model, gamma=5, markov_rank=24, num_key_value_heads=kv).to(torch.bfloat16)
    fast.set_weights(draft, fmt)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():  # a head with real margins, as a trained draft has
        draft.lm_head.weight.mul_(4)
    taps = torch.randn(3, 40, draft.fc.weight.shape[1], generator=gen).to(torch.bfloat16)
    counts, anchors = torch.tensor([40, 23, 7]), torch.tensor([5, 17, 40])
    batch = _batch(draft, taps, counts, anchors, modules=False)
    prop = S.propose(draft, batch)
    assert "fast" in draft._fast and prop.tokens.shape == (3, 5) and prop.q == [None] * 3
    assert batch.ctx.lengths.tolist() == counts.tolist()  # the block's rows are scratch, not committed
    ref = _reference(draft, fmt)
    h, logits = _reference_walk(ref, taps, counts, anchors, prop.tokens)
    fresh = _batch(draft, taps, counts, anchors, modules=False)
    with torch.inference_mode():
        _, base = fast.for_draft(draft).call(draft.spec, fresh.ctx, None, None, anchors, 0, 5)
    ref_base = h @ ref.lm_head.weight.double().T
    err = float((base.double() - ref_base).abs().max())
    assert err <= 2**-5 * float(ref_base.abs().max())
    top2 = logits.topk(2, -1).values
    clear = (top2[..., 0] - top2[..., 1]) > 4 * err
    assert clear[:, 0].any() and clear.float().mean() > 0.5
    assert torch.equal(prop.tokens[clear], logits.argmax(-1)[clear])
    ch = ref.confidence_head.proj
    feats = torch.cat(
        [h, ref.markov_head.markov_w1.weight.double()[torch.cat([anchors[:, None], prop.tokens[:, :-1]], 1)]], -1
    )
    conf = feats @ ch.weight.double()[0] + ch.bias.double()
    assert (prop.conf_logits.double() - conf).abs().max() <= 0.02 + 2**-5 * conf.abs().max()


def test_waiting_taps_join_the_same_call():
    """Taps left in batch.pending (a prompt, skipped steps) enter the context inside the drafting
    call: the same proposal, the same cache, as a separate context update first."""
    model = tiny_target()
    draft = tiny_draft(model, gamma=4).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(12)
    taps = torch.randn(2, 12, draft.fc.weight.shape[1], generator=gen).to(torch.bfloat16)
    one = _batch(draft, taps[:, :9], torch.tensor([9, 9]), torch.tensor([4, 8]), modules=False)
    two = _batch(draft, taps[:, :9], torch.tensor([9, 9]), torch.tensor([4, 8]), modules=False)
    one.pending = [taps[:, 9:11], taps[:, 11:12]]
    fused = S.propose(draft, one)
    S.flush_context(draft, two.__class__(None, two.ctx, two.anchors, two.params, two.generators, [taps[:, 9:12]]))
    apart = S.propose(draft, two)
    assert one.pending == [] and one.ctx.lengths.tolist() == two.ctx.lengths.tolist() == [12, 12]
    assert torch.equal(fused.tokens, apart.tokens) and torch.equal(fused.conf_logits, apart.conf_logits)
    for a, b in zip(one.ctx.layers, two.ctx.layers):
        assert torch.equal(a.k[:, :, :12], b.k[:, :, :12]) and torch.equal(a.v[:, :, :12], b.v[:, :, :12])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_speculation_through_the_one_call_is_lossless(fmt, dtype):
    """A draft in any format and dtype (fp32: a CPU without native bf16) drafts through the one
    call in a ragged batch, all slots or one: every output is the target's own greedy decoding, and
    drafts are accepted."""
    from dspark.engine.scheduler import FullScheduler

    class OneSlot(FullScheduler):
        def draft_depth(self, batch):
            return 1

    model = q4_exact(tiny_target())
    plain = Engine(NativeTarget(model, act_dtype=torch.bfloat16), None)
    draft = bigram_draft(plain).to(dtype)
    fast.set_weights(draft, fmt)
    prompts = [[5, 17, 33, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48], [7] * 23 + [3, 88]]
    params = SamplingParams(max_new_tokens=40)
    want = [plain.generate(p, params).output_ids for p in prompts]
    for policy in (None, OneSlot()):
        spec = Engine(NativeTarget(model, act_dtype=torch.bfloat16), draft, policy=policy, max_batch=3)
        assert [r.output_ids for r in spec.generate_many(prompts, params)] == want
        assert 0 < spec.metrics.accepted < spec.metrics.verified
    assert fast.for_draft(draft).weights == fmt  # the kernels' copy ran


def test_sampled_requests_walk_the_call_s_logits():
    """A sampled request drafts in the call: the distributions q it records are proper over the
    target's vocabulary and hold every token drawn."""
    model = tiny_target()
    draft = tiny_draft(model, gamma=3).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(13)
    taps = torch.randn(1, 10, draft.fc.weight.shape[1], generator=gen).to(torch.bfloat16)
    batch = _batch(draft, taps, torch.tensor([10]), torch.tensor([9]), modules=False)
    batch.params, batch.generators = [SamplingParams(temperature=1.0)], [torch.Generator().manual_seed(0)]
    prop = S.propose(draft, batch)
    q = prop.q[0]
    assert q.shape == (3, draft.spec.vocab_size) and torch.allclose(q.sum(-1), torch.ones(3, dtype=q.dtype), atol=1e-5)
    assert all(q[k, prop.tokens[0, k]] > 0 for k in range(3))


def test_bad_input_to_the_call_is_named():
    """An anchor outside the vocabulary, or a cache of the wrong shape, is an error naming it."""
    model = tiny_target()
    draft = tiny_draft(model).to(torch.bfloat16)
    k = fast.for_draft(draft)
    batch = _batch(
        draft,
        torch.zeros(1, 3, draft.fc.weight.shape[1], dtype=torch.bfloat16),
        torch.tensor([3]),
        torch.tensor([5]),
        modules=False,
    )
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match="anchor 96 outside the vocabulary of 96"):
            k.call(draft.spec, batch.ctx, None, None, torch.tensor([96]), 0, 1, walk=True)
        with pytest.raises(RuntimeError, match="rows 0..9 of a block of 4"):
            k.call(draft.spec, batch.ctx, None, None, torch.tensor([5]), 0, 9, walk=True)
    # a gated Markov head whose projection does not fit [h ; W1[prev]] is refused when registered
    gated = tiny_draft(model, markov_head_type="gated").to(torch.bfloat16)
    r = gated.spec.markov_rank
    gated.markov_head.gate_proj = torch.nn.Linear(r, r).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="the Markov head's projection must be"):
        fast.for_draft(gated)


@pytest.mark.slow
def test_the_bundled_draft_drafts_through_the_one_call_as_through_its_modules():
    """SmolLM2 and the bundled draft over held-out answers (contexts from the target's own taps,
    64 anchors): the one call's first-slot tokens are the modules' (bf16, the draft's own numbers)
    at >= 90 % of anchors in q8 and >= 75 % in q4 (8-bit and 4-bit matrices move near-ties: 94 % and
    80 % measured on the bundled draft, 64 anchors; a broken call agrees at a few %), and its head
    logits (bf16 matrices) are the modules' within 2^-4 of their largest."""
    from pathlib import Path

    from dspark.api import EngineConfig, build_engine
    from dspark.train.dataset import load_sequences

    eng = build_engine(EngineConfig(target="smollm2", dtype="bf16", verify="full", check=False))
    draft, target = eng.draft, eng.target
    held = load_sequences(str(Path(__file__).parents[1] / "data" / "smollm2" / "heldout-v1"))[:8]
    contexts, anchors = [], []
    with torch.inference_mode():
        for seq in held:
            ids = seq.ids[None, :]
            _, taps = target.forward_final(target.new_state(1), ids, None)
            start = int(seq.loss_mask.nonzero()[0])  # the answer's first token
            for a in torch.linspace(start + 4, len(seq.ids) - 2, 8).long().tolist():
                contexts.append(taps[:, :a])
                anchors.append(int(seq.ids[a]))

    def first_slots(fmt: str | None):
        fast.set_weights(draft, fmt or "bf16")
        out, logits = [], []
        with torch.inference_mode():
            for taps, a in zip(contexts, anchors):
                ctx = draft.new_context_cache(1, "cpu", torch.bfloat16, kernels=fmt is not None)
                batch = S.Batch(None, ctx, torch.tensor([a]), [SamplingParams()], [None], [taps])
                out.append(int(S.propose(draft, batch, 1).tokens[0, 0]))
                if fmt == "bf16" or fmt is None:
                    block = S.draft_block(draft, torch.tensor([a]), batch.ctx, 1)
                    logits.append(block.base[0, 0].float())
        return torch.tensor(out), logits

    ref, ref_logits = first_slots(None)
    for fmt, floor in (("q8", 0.90), ("q4", 0.75)):
        got, _ = first_slots(fmt)
        same = float((got == ref).float().mean())
        assert same >= floor, (fmt, same)
    _, bf16_logits = first_slots("bf16")
    for a, b in zip(bf16_logits, ref_logits):
        assert (a - b).abs().max() <= 2**-4 * b.abs().max()


def test_the_phase_is_priced_at_its_least_time(monkeypatch):
    """A start-up that meets interference in some reps still prices the phase at what it costs:
    the least of the reps after the warm-up, not a median an outlier can move."""
    draft = tiny_draft(tiny_target(), gamma=3)
    clock = iter([0.0, 9.0, 10.0, 10.5, 20.0, 20.2, 30.0, 31.0, 40.0, 40.3, 50.0, 50.9])
    monkeypatch.setattr(S, "now", lambda _dev: next(clock))
    # warm-up 9.0 (dropped), then 0.5, 0.2, 1.0, 0.3, 0.9: the median would read 0.5
    assert S.draft_phase_seconds(draft, context=8, reps=5) == pytest.approx(0.2)


@pytest.mark.parametrize(
    "head,layout",
    [("vanilla", "anchor_first"), ("gated", "anchor_first"), ("rnn", "anchor_first"), ("rnn", "bonus_anchor")],
)
def test_the_call_walks_every_markov_head_as_the_walk_in_python_does(head, layout):
    """A batch of a greedy row and rows that sample (temperature, top-k, top-p) drafts in one call,
    whatever the Markov head's kind (an rnn head's recurrence through a bonus-anchor block's row 0
    included): the greedy row's tokens are those of an all-greedy batch; each sampled slot's token
    is what its own distribution q and its uniform (`walk_sampling`, from the row's generator)
    draw; and tokens and q are what the walk in torch (`walk_in_torch`, `sampling.probs`' shaping)
    makes of the call's own states and base logits."""
    model = tiny_target()
    draft = tiny_draft(model, gamma=3, markov_head_type=head, layout=layout).to(torch.bfloat16)
    with torch.no_grad():  # a Markov bias that decides tokens
        draft.markov_head.markov_w2.weight.normal_(0, 0.5)
    gen = torch.Generator().manual_seed(21)
    taps = torch.randn(4, 12, draft.fc.weight.shape[1], generator=gen).to(torch.bfloat16)
    counts, anchors = torch.tensor([12, 7, 9, 12]), torch.tensor([9, 30, 4, 77])
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.6),
    ]
    rows = draft.spec.sampled_rows

    def batch_of(params):
        batch = _batch(draft, taps, counts, anchors, modules=False)
        batch.params = params
        batch.generators = [torch.Generator().manual_seed(100 + b) for b in range(4)]
        return batch

    prop = S.propose(draft, batch_of(params))
    greedy = S.propose(draft, batch_of([SamplingParams()] * 4))
    assert torch.equal(prop.tokens[0], greedy.tokens[0]) and prop.q[0] is None
    for b in (1, 2, 3):
        u = torch.rand(3, generator=torch.Generator().manual_seed(100 + b))
        q = prop.q[b]
        assert q.shape == (3, draft.spec.vocab_size) and torch.allclose(q.sum(-1), torch.ones(3), atol=1e-5)
        assert [S.draw(q[k], float(u[k])) for k in range(3)] == prop.tokens[b].tolist()
    assert ((prop.q[2] > 0).sum(-1) <= 5).all()
    assert ((prop.q[3] > 0).sum(-1) < draft.spec.vocab_size).all()  # top-p dropped some
    # the walk in torch over the call's states and head logits: the same tokens
    for ps, want in ((params, prop), ([SamplingParams()] * 4, greedy)):
        batch = batch_of(ps)
        shaping = S.walk_sampling(batch, [b for b, p in enumerate(ps) if not p.greedy], len(rows))
        with torch.inference_mode():
            block = S.draft_block(draft, batch.anchors, batch.ctx, len(rows))
            ref = S.walk_in_torch(draft, block, batch, rows, shaping)
        assert torch.equal(ref.tokens, want.tokens)
        for b in range(4):
            assert (ref.q[b] is None) == (want.q[b] is None)
            if ref.q[b] is not None:  # the first slot's W2 is in the call's head format (Q8_0), torch's bf16
                assert (ref.q[b][0] - want.q[b][0]).abs().max() < 0.1
                assert (ref.q[b][1:] - want.q[b][1:]).abs().max() < 2e-3
        assert torch.allclose(ref.conf_logits.float(), want.conf_logits.float(), atol=0.05)
