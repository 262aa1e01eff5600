"""Issue 3: the engine is lossless, keeps its caches clean, and samples from the q it reports."""

import itertools

import pytest
import torch
from dspark.engine.batch import Batch
from dspark.engine.drafting import propose
from dspark.engine.sampling import SamplingParams, probs
from dspark.engine.scheduler import FullScheduler

from tests.tiny import engine_for, hf_greedy, tiny_draft, tiny_target

PROMPTS = [[5, 17, 33, 8, 9, 10], [40, 41], [7] * 23 + [3, 88]]


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.mark.parametrize("layout", ["anchor_first", "bonus_anchor"])
@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_greedy_equals_transformers_fp32(target, layout, head):
    draft = tiny_draft(target, layout=layout, markov_head_type=head, gamma=5)
    engine = engine_for(target, draft)
    for prompt in PROMPTS:
        req = engine.generate(prompt, SamplingParams(max_new_tokens=128))
        assert req.output_ids == hf_greedy(target, prompt, 128)
        assert req.metrics.steps >= 1 and req.metrics.drafted == 5 * req.metrics.steps


def test_plain_decoding_same_path(target):
    engine = engine_for(target, None)
    req = engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=64))
    assert req.output_ids == hf_greedy(target, PROMPTS[0], 64)


def test_stop_tokens_and_length(target):
    ref = hf_greedy(target, PROMPTS[0], 40)
    stop = ref[12]
    first = ref.index(stop)
    engine = engine_for(target, tiny_draft(target), eos_token_ids=(stop,))
    req = engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=40))
    assert req.output_ids == ref[: first + 1] and req.finish_reason == "stop"
    req = engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=7, ignore_eos=True))
    assert req.output_ids == ref[:7] and req.finish_reason == "length"


def _flat_target():
    """A tiny target with 6 tokens and spread-out distributions: drafts get partly accepted."""
    torch.manual_seed(3)
    m = tiny_target(seed=3, vocab=6, layers=2, hidden=32)
    with torch.no_grad():
        m.lm_head.weight.mul_(8.0)  # sharpen a little so p and q really differ
    return m


def _exact_joint(model, prompt, params, n):
    """P(x_1..x_n | prompt) under the processed target distribution, by enumeration."""
    V = model.config.vocab_size
    out = {}
    for seq in itertools.product(range(V), repeat=n):
        ids = torch.tensor([prompt + list(seq)])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + n]
        p = probs(logits, params)
        out[seq] = float(torch.prod(p[torch.arange(n), torch.tensor(seq)]))
    return out


@pytest.mark.parametrize("runtime", ["hf", "native"])
@pytest.mark.parametrize("temperature,top_p,draft_vocab", [(1.0, 1.0, None), (0.7, 0.8, None), (1.0, 1.0, 4)])
def test_sampling_is_lossless_chi_square(temperature, top_p, draft_vocab, runtime):
    """Speculative sampling reproduces the target's joint law of the first 3 tokens.

    Chi-square goodness of fit at significance 0.001 over 3000 seeded generations. With a reduced
    draft vocabulary (4 of 6 tokens) q is 0 on two tokens the target still produces: only the
    residual distribution can emit them.
    """

    model = _flat_target()
    draft = tiny_draft(model, gamma=3, markov_rank=4, mask_token_id=5, draft_vocab_size=draft_vocab)
    if draft_vocab:
        ids = torch.tensor([0, 2, 3, 5])
        with torch.no_grad():
            draft.d2t.copy_(ids - torch.arange(4))
            draft.lm_head.weight.copy_(model.lm_head.weight[ids])
    prompt = [1, 2, 3]
    params = [SamplingParams(max_new_tokens=3, temperature=temperature, top_p=top_p, seed=s) for s in range(3000)]
    engine = engine_for(model, draft, runtime=runtime, max_batch=256)
    reqs = engine.generate_many([prompt] * len(params), params)
    exact = _exact_joint(model, prompt, params[0], 3)
    assert engine.metrics.accepted > 0 and engine.metrics.accepted < engine.metrics.verified  # both branches ran
    assert chi_square_pvalue([r.output_ids for r in reqs], exact) > 1e-3


def chi_square_pvalue(outputs: list[list[int]], exact: dict) -> float:
    """Goodness of fit of the outputs' sequences to the exact law {sequence: probability}, rare cells
    merged so that every expected count is >= 5; a sequence outside the support fails the test."""
    from scipy.stats import chisquare

    keys = sorted((k for k, v in exact.items() if v > 0), key=exact.get)
    counts = dict.fromkeys(keys, 0)
    for out in outputs:
        counts[tuple(out)] += 1  # KeyError outside the support: a failure
    e, o, acc_e, acc_o = [], [], 0.0, 0.0
    for k in keys:
        acc_e += exact[k] * len(outputs)
        acc_o += counts[k]
        if acc_e >= 5:
            e.append(acc_e)
            o.append(acc_o)
            acc_e = acc_o = 0.0
    e[-1] += acc_e
    o[-1] += acc_o
    e = [x * sum(o) / sum(e) for x in e]  # float rounding of the exact law
    return float(chisquare(o, e).pvalue)


def test_q_is_the_markov_corrected_distribution():
    model = _flat_target()
    draft = tiny_draft(model, gamma=3, markov_rank=4, mask_token_id=5)
    with torch.no_grad():
        draft.markov_head.markov_w2.weight.normal_(0, 3.0)  # a strong Markov correction
    engine = engine_for(model, draft)
    req = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=3, temperature=1.0, seed=0))
    engine._admit()
    batch: Batch = engine.batch
    prop = propose(draft, batch)
    # recompute by hand: base logits + W2 W1[prev], prev = anchor then the sampled tokens
    block = torch.tensor([[int(batch.anchors[0])] + [5] * 2])
    h = draft(block, batch.ctx.valid(), batch.ctx.lengths)
    prev = [int(batch.anchors[0])] + prop.tokens[0, :-1].tolist()
    for k in range(3):
        base = draft.lm_head(h[0, k])
        corrected = base + draft.markov_head.markov_w2(draft.markov_head.markov_w1(torch.tensor(prev[k])))
        assert torch.allclose(prop.q[0][k], probs(corrected, req.params), atol=1e-6)
        assert not torch.allclose(prop.q[0][k], probs(base, req.params), atol=1e-3)


def test_caches_hold_only_committed_positions():
    """After partial accepts the target cache and the draft context equal a clean prefill."""
    from dspark.engine.drafting import flush_context

    model = _flat_target()
    draft = tiny_draft(model, gamma=4, markov_rank=4, mask_token_id=5)
    engine = engine_for(model, draft)
    engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=200, temperature=1.0, seed=7, ignore_eos=True))
    engine._admit()
    partial = 0
    for _ in range(12):
        engine.step()
        if not engine.running:
            break
        acc = engine.running[0].metrics.histogram
        partial = sum(acc[1:-1])
        req, b = engine.running[0], engine.batch
        committed = req.prompt_ids + req.output_ids[:-1]  # the last token is the anchor: not run yet
        assert int(b.target.lengths[0]) == len(committed)
        assert b.target.cache.get_seq_length() == len(committed)
        # the step's committed taps wait for the next drafting call (Batch.unposted): exactly those
        waiting = int(b.unposted[1][0]) if b.unposted is not None else 0
        assert int(b.ctx.lengths[0]) + waiting == len(committed)
        flush_context(draft, b)
        assert int(b.ctx.lengths[0]) == len(committed) and b.unposted is None
        # a clean run over exactly the committed tokens gives the same cache contents
        clean = engine.target.new_state(1)
        _, taps = engine.target.forward(clean, torch.tensor([committed]))
        engine.target.commit(clean, torch.tensor([len(committed)]))
        for mine, ref in zip(b.target.cache.layers, clean.cache.layers):
            assert torch.allclose(mine.keys, ref.keys, atol=1e-5)
        ctx = draft.new_context_cache(1, "cpu", torch.float32)
        draft.extend_context(ctx, taps, torch.tensor([len(committed)]))
        for mine, ref in zip(b.ctx.valid(), ctx.valid()):  # past the lengths: scratch
            assert torch.allclose(mine.k, ref.k, atol=1e-5) and torch.allclose(mine.v, ref.v, atol=1e-5)
    assert partial > 0  # some steps accepted part of the block: the crop path really ran


def test_bad_requests_are_refused(target):
    from dspark.errors import RequestError

    engine = engine_for(target, tiny_draft(target))
    with pytest.raises(RequestError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(RequestError, match="context"):
        engine.add_request([1] * 500, SamplingParams(max_new_tokens=100))
    # a request that fits the context but not with a draft block after it: the message says so
    positions = engine.target.max_length
    with pytest.raises(RequestError, match=r"one draft block \(\d+ positions a verify needs\) exceeds"):
        engine.add_request([1] * (positions - 12), SamplingParams(max_new_tokens=10))
    with pytest.raises(RequestError, match=r"max_new_tokens \(100\) exceeds"):  # past the context itself
        engine.add_request([1] * (positions - 12), SamplingParams(max_new_tokens=100))
    with pytest.raises(RequestError, match="vocabulary|token ids"):
        engine.add_request([10_000], SamplingParams())
    for bad in (
        {"temperature": -1.0},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_k": -2},
        {"max_new_tokens": 0},
    ):
        with pytest.raises(RequestError):
            SamplingParams(**bad)


class _DraftsEvery(FullScheduler):
    """Full verification that drafts on every n-th step only, recording each step's catch-up."""

    def __init__(self, n: int):
        super().__init__()
        self.n, self.calls, self.caught = n, 0, []

    def should_draft(self, batch):
        self.calls += 1
        return self.calls % self.n == 0

    def observe(self, res, requests):
        self.caught.append(res.caught_up)


def test_skipped_steps_defer_the_draft_context_and_it_catches_up_exactly():
    """The prompt and steps that skip drafting leave their taps pending (no draft work); the next
    drafting step adds them, and the draft context then equals a clean prefill of the committed
    tokens."""
    from dspark.engine.drafting import flush_context

    policy = _DraftsEvery(3)
    caught = policy.caught
    model = _flat_target()
    draft = tiny_draft(model, gamma=4, markov_rank=4, mask_token_id=5)
    engine = engine_for(model, draft, policy=policy)
    engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=200, temperature=1.0, seed=7, ignore_eos=True))
    engine._admit()
    waited = []
    for _ in range(10):
        engine.step()
        req, b = engine.running[0], engine.batch
        committed = req.prompt_ids + req.output_ids[:-1]
        waiting = sum(p.shape[1] for p in b.pending) + (int(b.unposted[1][0]) if b.unposted is not None else 0)
        waited.append(waiting)
        assert int(b.ctx.lengths[0]) + waiting == len(committed)
    # the prompt's 3 positions and two skipped steps wait for the first drafting step
    assert waited[1] == 3 + 2 and engine.metrics.plain_steps > 0
    # each drafting step says how many positions it caught up (the prompt's, the skipped steps'), which
    # the adaptive policy leaves out of what a drafting step costs
    assert caught == [0, 0, 3 + 2, 0, 0, 2, 0, 0, 2, 0]
    flush_context(draft, engine.batch)
    clean = engine.target.new_state(1)
    _, taps = engine.target.forward(clean, torch.tensor([committed]))
    ctx = draft.new_context_cache(1, "cpu", torch.float32)
    draft.extend_context(ctx, taps, torch.tensor([len(committed)]))
    for mine, ref in zip(engine.batch.ctx.valid(), ctx.valid()):
        assert torch.allclose(mine.k, ref.k, atol=1e-5) and torch.allclose(mine.v, ref.v, atol=1e-5)


def test_a_request_joining_leaves_the_batchs_waiting_taps_waiting_and_every_context_catches_up():
    """A request joining a batch whose steps skipped drafting: the batch's waiting taps keep waiting
    (no draft call at the join: the new row commits none of them) and later plain steps only append;
    once the draft has run, every row's draft context equals a clean prefill of its own committed
    tokens. Tokens 0-5 (the tiny target's vocabulary)."""
    from dspark.engine.drafting import flush_context

    model = _flat_target()
    draft = tiny_draft(model, gamma=4, markov_rank=4, mask_token_id=5)
    engine = engine_for(model, draft, policy=_DraftsEvery(4))
    params = {"max_new_tokens": 200, "temperature": 1.0, "ignore_eos": True}
    engine.add_request([1, 2, 3], SamplingParams(seed=7, **params))
    engine._admit()
    engine.step()
    engine.step()  # two plain steps: the prompt's taps and theirs wait
    waiting = sum(p.shape[1] for p in engine.batch.pending)
    assert waiting == 3 + 2 and engine.batch.unposted is None
    engine.add_request([4, 1, 0, 2], SamplingParams(seed=8, **params))
    engine._admit()
    b = engine.batch
    assert len(engine.running) == 2 and not b.pending and b.unposted is not None
    assert b.unposted[1].tolist() == [waiting, 0] and b.joined == waiting  # a catch-up for the next draft
    assert b.ctx is not None and b.ctx.lengths.tolist() == [0, 4]  # only the new prompt entered the context
    before = b.unposted[0]
    engine.step()  # plain: appends for both rows, and what waited stays as it was (no join a step)
    assert len(engine.batch.pending) == 1 and engine.batch.unposted is not None
    assert engine.batch.unposted[0] is before
    for _ in range(8):  # drafting steps (the fourth call and every fourth after it) and plain ones between
        engine.step()
    assert engine.metrics.plain_steps > 0 and len(engine.running) == 2
    flush_context(draft, engine.batch)
    ctx_all = engine.batch.ctx
    for r, req in enumerate(engine.running):
        committed = req.prompt_ids + req.output_ids[:-1]  # the last token is the anchor: not run yet
        assert int(ctx_all.lengths[r]) == len(committed)
        clean = engine.target.new_state(1)
        _, taps = engine.target.forward(clean, torch.tensor([committed]))
        ref = draft.new_context_cache(1, "cpu", torch.float32)
        draft.extend_context(ref, taps, torch.tensor([len(committed)]))
        mine = ctx_all.select(torch.tensor([r]))
        for a, c in zip(mine.valid(), ref.valid()):
            n = len(committed)
            assert torch.allclose(a.k[:, :, :n], c.k, atol=1e-5) and torch.allclose(a.v[:, :, :n], c.v, atol=1e-5), r


def test_drafting_fewer_slots_drafts_the_same_first_slots():
    """propose(depth=d) gives the first d tokens, distributions and confidences of a full proposal
    (greedy and sampled rows, with and without the walk kernel); a depth outside 1..g is refused."""
    from dspark.engine import drafting as S

    model = _flat_target()
    draft = tiny_draft(model, gamma=4, markov_rank=4, mask_token_id=5)
    engine = engine_for(model, draft)
    greedy, sampled = SamplingParams(max_new_tokens=4), SamplingParams(max_new_tokens=4, temperature=1.0, seed=3)
    for params in (greedy, sampled):
        engine.add_request([1, 2, 3], params)
        engine._admit()
        batch = engine.batch
        full = S.propose(draft, batch)
        for d in (1, 2, 4):
            if not params.greedy:
                batch.generators = [torch.Generator().manual_seed(9)]
                full = S.propose(draft, batch)
                batch.generators = [torch.Generator().manual_seed(9)]
            part = S.propose(draft, batch, d)
            assert torch.equal(part.tokens, full.tokens[:, :d])
            assert torch.allclose(part.conf_logits, full.conf_logits[:, :d])
            if not params.greedy:
                assert torch.allclose(part.q[0], full.q[0][:d])
        for bad in (0, 5):
            with pytest.raises(ValueError, match="depth"):
                S.propose(draft, batch, bad)
        engine.running.clear()
        engine.batch = None


def test_a_policy_that_drafts_one_slot_stays_lossless():
    """decode_step drafts what the policy's draft_depth asks for, and greedy output is the target's."""
    from dspark.engine.scheduler import FullScheduler

    class OneSlot(FullScheduler):
        def draft_depth(self, batch):
            return 1

    model = _flat_target()
    draft = tiny_draft(model, gamma=4, markov_rank=4, mask_token_id=5)
    engine = engine_for(model, draft, policy=OneSlot())
    req = engine.generate([1, 2, 3], SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert req.output_ids == hf_greedy(model, [1, 2, 3], 20)
    assert engine.metrics.steps > 0 and engine.metrics.drafted == engine.metrics.steps


def test_greedy_verification_reads_the_argmax_and_sampled_verification_the_logits(target, monkeypatch):
    """A greedy verify step asks the target for its argmax alone (no fp32 logits [B, 1+m, V]) and
    stays the target's own greedy decoding; a sampled one still reads the full logits."""
    draft = tiny_draft(target, gamma=4)
    engine = engine_for(target, draft)
    asked = []

    def spy(name):
        forward = getattr(engine.target, name)

        def run(state, tokens, counts=None):
            if tokens.shape[1] > 1:  # a verify (a prefill reads its last position's logits: forward_last)
                asked.append(name)
            return forward(state, tokens, counts)

        return run

    for name in ("forward", "forward_argmax"):
        monkeypatch.setattr(engine.target, name, spy(name))
    req = engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert req.output_ids == hf_greedy(target, PROMPTS[0], 24)
    assert asked and set(asked) == {"forward_argmax"}
    asked.clear()
    engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.8, seed=3))
    assert asked and set(asked) == {"forward"}


def test_the_draft_context_cache_keeps_exactly_the_committed_entries():
    """ContextCache (any device, no kernels): ragged appends keep each row's first counts[b] new
    entries after its own length, capacity grows past CONTEXT_CHUNK without losing any, and
    select / merge carry rows with their entries; what lies past a row's length is never read."""
    from dspark.model.draft import CONTEXT_CHUNK, ContextCache
    from dspark.model.layers import LayerKV

    gen = torch.Generator().manual_seed(11)
    B, kv, D = 3, 2, 4
    empty = torch.zeros(B, kv, 0, D)
    cache = ContextCache([LayerKV(empty, empty)], torch.zeros(B, dtype=torch.long))
    rows = [[] for _ in range(B)]  # the committed entries, as a reference
    for n, counts in [
        (5, [5, 3, 1]),
        (2, [1, 2, 0]),
        (CONTEXT_CHUNK, [CONTEXT_CHUNK, 7, CONTEXT_CHUNK - 1]),
        (1, [1, 1, 1]),
    ]:
        k = torch.randn(B, kv, n, D, generator=gen)
        cache.append([LayerKV(k, -k)], torch.tensor(counts))
        for b, c in enumerate(counts):
            rows[b].extend(k[b, :, j] for j in range(c))
    assert cache.lengths.tolist() == [len(r) for r in rows] and cache.capacity >= max(len(r) for r in rows)
    (valid,) = cache.valid()
    assert valid.k.shape[2] == max(len(r) for r in rows)
    for b, r in enumerate(rows):
        want = torch.stack(r, 1)  # [kv, len, D]
        assert torch.equal(valid.k[b, :, : len(r)], want) and torch.equal(valid.v[b, :, : len(r)], -want)
    picked = cache.select(torch.tensor([2, 0]))
    assert picked.lengths.tolist() == [len(rows[2]), len(rows[0])]
    assert torch.equal(picked.layers[0].k[0, :, : len(rows[2])], torch.stack(rows[2], 1))
    small = ContextCache([LayerKV(torch.ones(1, kv, 3, D), torch.ones(1, kv, 3, D))], torch.tensor([3]))
    merged = ContextCache.merge([picked, small])
    assert merged.lengths.tolist() == [len(rows[2]), len(rows[0]), 3]
    assert torch.equal(merged.layers[0].k[1, :, : len(rows[0])], torch.stack(rows[0], 1))
    assert torch.equal(merged.layers[0].k[2, :, :3], torch.ones(kv, 3, D))


def test_sampling_params_hold_the_floors_api_users_rely_on():
    """The server's 400 / floor for temperature and top_p also hold for Python callers: a tiny
    temperature is refused naming the floor (it made NaN probabilities), a tiny top_p keeps the
    most likely token alone instead of none."""
    from dspark.engine.sampling import MIN_TEMPERATURE, MIN_TOP_P, probs
    from dspark.errors import RequestError

    with pytest.raises(RequestError, match=r"temperature must be 0 \(greedy\) or at least 1e-05, got 1e-06"):
        SamplingParams(temperature=1e-6)
    assert SamplingParams(temperature=MIN_TEMPERATURE).temperature == MIN_TEMPERATURE
    p = SamplingParams(temperature=1.0, top_p=1e-300)
    assert p.top_p == MIN_TOP_P
    logits = torch.tensor([0.5, 3.0, 1.0, -2.0])
    assert probs(logits, p).tolist() == [0.0, 1.0, 0.0, 0.0]
