"""Issue 12: the native target runtime reproduces the HF model (logits, taps), keeps its cache by
lengths (commit/select/merge), and speculative decoding on it is lossless, also batched and ragged,
also with quantised weights (against that quantised model itself)."""

from __future__ import annotations

import pytest
import torch
from dspark import ops, packing
from dspark.engine.sampling import SamplingParams
from dspark.errors import DSparkError
from dspark.target.hf import HFTarget
from dspark.target.load import make_target
from dspark.target.native import NativeTarget, supports
from dspark.target.quant import is_int4_exact
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tests.tiny import FAMILY_SIZES, bigram_draft, engine_for, hf_greedy, q4_exact, tiny_target

COMMON = FAMILY_SIZES


def _llama(tied=False, kv=2, rope=None):
    extra = {"rope_parameters": rope} if rope else {}
    return LlamaForCausalLM(LlamaConfig(**{**COMMON, "num_key_value_heads": kv}, tie_word_embeddings=tied, **extra))


def _mk(name):
    torch.manual_seed(0)
    model = {
        "llama-untied-gqa": lambda: _llama(),
        "llama-tied-mha": lambda: _llama(tied=True, kv=4),
        "llama3-rope": lambda: _llama(
            rope={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        ),
        "linear-rope": lambda: _llama(rope={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
        "qwen2-bias": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON, tie_word_embeddings=False)),
        "qwen3-qknorm": lambda: Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=16, tie_word_embeddings=True)),
        "mistral": lambda: MistralForCausalLM(MistralConfig(**COMMON, sliding_window=None)),
    }[name]()
    with torch.no_grad():  # norms away from 1 so a mis-applied norm weight shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.normal_(1.0, 0.2)
    return model.float().eval()


FAMILIES = ["llama-untied-gqa", "llama-tied-mha", "llama3-rope", "linear-rope", "qwen2-bias", "qwen3-qknorm", "mistral"]


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_and_taps_equal_hf(name):
    """Prefill, then 1-token steps, then a 5-token verify: every logit within 1e-4 of HF's full
    forward; taps = HF hidden_states[i] (i < L) and the last layer's pre-norm output (i = L)."""
    model = _mk(name)
    L = model.config.num_hidden_layers
    assert model.config.num_key_value_heads < model.config.num_attention_heads or name == "llama-tied-mha"
    native = NativeTarget(model, (0, 2, L), weights="fp32")
    ref_taps = HFTarget(model, (0, 2, L))
    ids = torch.randint(4, 96, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    st = native.new_state(1)
    pieces, taps, at = [], [], 0
    for n in (30, 1, 1, 1, 2, 5):  # prompt, three decode steps, two verify blocks
        lg, tp = native.forward(st, ids[:, at : at + n])
        native.commit(st, torch.tensor([n]))
        pieces.append(lg)
        taps.append(tp)
        at += n
    assert (torch.cat(pieces, 1) - out.logits).abs().max() <= 1e-4
    taps = torch.cat(taps, 1)
    H = model.config.hidden_size
    assert torch.allclose(taps[..., :H], out.hidden_states[0], atol=1e-5)
    assert torch.allclose(taps[..., H : 2 * H], out.hidden_states[2], atol=1e-4)
    _, hf_taps = ref_taps.forward(ref_taps.new_state(1), ids)
    assert torch.allclose(taps, hf_taps, atol=1e-4)  # incl. the last layer's pre-norm output
    assert not torch.allclose(taps[..., 2 * H :], out.hidden_states[L], atol=1e-3)  # that one is normed


def test_unsupported_architectures_are_named():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=4))
    ok, why = supports(gpt2)
    assert not ok and "GPT2LMHeadModel" in why
    with pytest.raises(DSparkError, match="GPT2LMHeadModel.*--runtime hf"):
        make_target(gpt2, "native")
    assert isinstance(make_target(gpt2, "hf"), HFTarget)
    dyn = _llama(rope={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    assert not supports(dyn)[0] and "dynamic" in supports(dyn)[1]
    slide = MistralForCausalLM(MistralConfig(**COMMON, sliding_window=16))
    assert not supports(slide)[0] and "sliding" in supports(slide)[1]
    with pytest.raises(DSparkError, match="runtime"):
        make_target(_llama(), "vllm")


def test_commit_overwrites_rejected_entries_and_last_logits():
    """A partial commit is a length update: the rejected entries are overwritten by the next
    forward and the result equals a clean prefill of the committed tokens."""
    model = _mk("qwen3-qknorm")
    t = NativeTarget(model, (1,), weights="fp32")
    ids = torch.randint(4, 96, (1, 30), generator=torch.Generator().manual_seed(2))
    st = t.new_state(1)
    t.forward(st, ids[:, :20])
    t.commit(st, torch.tensor([20]))
    t.forward(st, torch.randint(4, 96, (1, 6)))
    t.commit(st, torch.tensor([1]))  # 5 "rejected" garbage entries stay
    assert int(st.lengths[0]) == 21 and st.pending == 0
    st.lengths -= 1  # back to 20 committed: the real continuation overwrites the slot too
    lg, tp = t.forward(st, ids[:, 20:])
    t.commit(st, torch.tensor([10]))
    clean = t.new_state(1)
    ref, ref_tp = t.forward(clean, ids)
    assert torch.allclose(lg, ref[:, 20:], atol=1e-5) and torch.allclose(tp, ref_tp[:, 20:], atol=1e-5)
    last, _ = t.forward_last(t.new_state(1), ids)
    assert last.shape == (1, 1, 96) and torch.allclose(last[:, 0], ref[:, -1], atol=1e-5)
    with pytest.raises(RuntimeError, match="commit"):
        t.forward(clean, ids[:, :1]), t.forward(clean, ids[:, :1])


def test_ragged_batch_select_merge_equal_single_rows():
    """Rows of different lengths batched (merge), verified with different counts, then a row
    leaving (select): each row's logits and taps equal that row run alone."""
    model = _mk("llama-untied-gqa")
    t = NativeTarget(model, (0, 3), weights="fp32")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, 96, (1, n), generator=gen) for n in (7, 19, 3)]
    blocks = torch.randint(4, 96, (3, 4), generator=gen)
    counts = torch.tensor([4, 2, 3])
    singles = []
    for p, blk, c in zip(prompts, blocks, counts):
        s = t.new_state(1)
        t.forward(s, p)
        t.commit(s, torch.tensor([p.shape[1]]))
        lg, tp = t.forward(s, blk[None, :c])
        t.commit(s, torch.tensor([c]))
        singles.append((lg[0], tp[0]))
    states = []
    for p in prompts:
        s = t.new_state(1)
        t.forward(s, p)
        t.commit(s, torch.tensor([p.shape[1]]))
        states.append(s)
    batch = t.merge(states)
    assert batch.lengths.tolist() == [7, 19, 3]
    lg, tp = t.forward(batch, blocks, counts)
    t.commit(batch, counts)
    for b, (slg, stp) in enumerate(singles):
        c = int(counts[b])
        assert torch.allclose(lg[b, :c], slg, atol=1e-5) and torch.allclose(tp[b, :c], stp, atol=1e-5)
        assert (lg[b, c:] == 0).all()  # padding positions: no head run
    sub = t.select(batch, torch.tensor([2, 0]))
    x = torch.tensor([[11], [12]])
    lg2, _ = t.forward(sub, x)
    t.commit(sub, torch.tensor([1, 1]))
    for row, b in ((0, 2), (1, 0)):
        s = t.new_state(1)
        full = torch.cat([prompts[b], blocks[b : b + 1, : counts[b]], x[row : row + 1]], 1)
        ref, _ = t.forward(s, full)
        assert torch.allclose(lg2[row, 0], ref[0, -1], atol=1e-5)


@pytest.mark.parametrize("layout", ["anchor_first", "bonus_anchor"])
def test_greedy_speculative_equals_transformers(layout):
    model = tiny_target()
    draft = bigram_draft(engine_for(model, runtime="native"), layout=layout, gamma=5)
    engine = engine_for(model, draft, runtime="native")
    assert isinstance(engine.target, NativeTarget) and engine.target.weights == "fp32"
    for prompt in ([5, 17, 33, 8, 9, 10], [40, 41], [7] * 23 + [3, 88]):
        req = engine.generate(prompt, SamplingParams(max_new_tokens=64))
        assert req.output_ids == hf_greedy(model, prompt, 64)
    assert 0 < engine.metrics.accepted < engine.metrics.verified  # accepts and rejects both ran


def test_batched_ragged_requests_equal_their_solo_runs():
    """Requests joining and leaving a batch (ragged lengths, every policy's variable verify
    counts) decode exactly as alone, on the native runtime."""
    from dspark.engine.costs import CostCurve
    from dspark.engine.scheduler import make_scheduler

    model = _mk("qwen2-bias")
    draft = bigram_draft(engine_for(model, runtime="native"))
    prompts = [
        [5, 6, 7, 8],
        [9, 10, 11, 12, 13, 14, 15],
        [20, 21],
        [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41],
        [50],
    ]
    lens = [30, 11, 25, 7, 18]
    solo = [hf_greedy(model, p, n) for p, n in zip(prompts, lens)]
    curve = CostCurve((1, 4, 16, 64), (0.010, 0.012, 0.030, 0.100))
    from dspark.engine.calibration import Calibration

    policies = {
        "full": lambda eng: make_scheduler("full", eng.target, eng.draft),
        "threshold": lambda eng: make_scheduler(
            "threshold", eng.target, eng.draft, threshold=0.45, calibration=Calibration((0.7, 1.5, 1.0, 3.0))
        ),
        # drafting every step: whether a step drafts depends on measured timings (skipped steps in
        # ragged batches: tests/test_batching.py), and this test needs accepts to mean anything
        "adaptive": lambda eng: make_scheduler("adaptive", eng.target, eng.draft, curve=curve, skip=False),
    }
    for policy, make in policies.items():
        eng = engine_for(model, draft, runtime="native", max_batch=3)
        eng.policy = make(eng)
        reqs = eng.generate_many(prompts, [SamplingParams(max_new_tokens=n) for n in lens])
        assert [r.output_ids for r in reqs] == solo, policy
        assert eng.metrics.accepted > 0, policy


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantised_weights_lossless_against_themselves(weights):
    """The quantised model is the verifier: greedy speculation on it reproduces ITS plain greedy
    decoding (fp32 activations, where the comparison is exact); its logits stay near fp32's."""
    from dspark.engine.engine import Engine

    model = tiny_target()
    target = NativeTarget(model, weights=weights, act_dtype=torch.float32)
    assert target.weights == weights
    plain = Engine(target, None)
    spec = Engine(NativeTarget(model, weights=weights, act_dtype=torch.float32), bigram_draft(plain))
    for prompt in ([5, 17, 33, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48], [7] * 23 + [3, 88]):
        a = plain.generate(prompt, SamplingParams(max_new_tokens=40)).output_ids
        b = spec.generate(prompt, SamplingParams(max_new_tokens=40)).output_ids
        assert a == b
    assert 0 < spec.metrics.accepted < spec.metrics.verified
    ids = torch.tensor([[5, 17, 33, 8, 9]])
    q, _ = target.forward(target.new_state(1), ids)
    with torch.no_grad():
        ref = model(ids).logits
    err = (q - ref).abs().max()
    assert 0 < err < 0.25 * ref.abs().max()  # a real change, of quantisation size (random weights: worst case)


def test_auto_keeps_the_model_or_repacks_exact_int4():
    """'auto' never changes a model's numbers: fp32 stays fp32, bf16 stays bf16; weights that
    already are 4-bit groups of 32 (a Q4 GGUF) are held as int4, which is then exact."""
    model = tiny_target()
    assert NativeTarget(model).weights == "fp32"
    assert NativeTarget(tiny_target(dtype=torch.bfloat16)).weights == "bf16"
    q4_exact(model)  # every decoder linear exactly Q4_1-like
    assert all(
        is_int4_exact(m.weight)
        for layer in model.model.layers
        for m in (*layer.self_attn.children(), *layer.mlp.children())
        if isinstance(m, torch.nn.Linear)
    )
    t = NativeTarget(model, act_dtype=torch.float32)
    assert t.weights == "int4" and t.head_format == "fp32"  # a head that is not 4-bit is not quantised
    ids = torch.tensor([[5, 17, 33, 8, 9]])
    lg, _ = t.forward(t.new_state(1), ids)
    with torch.no_grad():
        assert (lg - model(ids).logits).abs().max() <= 1e-4
        # one row past the 64-row screen that is not 4-bit: auto falls back to the model's fp32
        model.model.layers[1].mlp.up_proj.weight[100, 3] += 1e-3
    t = NativeTarget(model)
    assert t.weights == "fp32" and t.dtype == torch.float32
    lg, _ = t.forward(t.new_state(1), ids)
    with torch.no_grad():
        assert (lg - model(ids).logits).abs().max() <= 1e-4


@pytest.mark.slow
def test_smollm2_native_equals_hf_and_auto_is_int4():
    from dspark.target.load import load_target

    model, tok = load_target("smollm2", "fp32", "cpu")
    ok, _ = supports(model)
    assert ok
    t = NativeTarget(model, (1, 15, 30), weights="fp32")
    ids = torch.tensor([tok.encode("The capital of France is Paris. The capital of Italy is")])
    st = t.new_state(1)
    n = ids.shape[1] - 3
    a, ta = t.forward(st, ids[:, :n])
    t.commit(st, torch.tensor([n]))
    b, tb = t.forward(st, ids[:, n:])
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    assert (torch.cat([a, b], 1) - ref.logits).abs().max() <= 1e-4
    assert torch.allclose(torch.cat([ta, tb], 1)[..., :576], ref.hidden_states[1], atol=1e-4)
    auto = NativeTarget(model)

    # the head is Q8_0 in the GGUF: held as such on dspark's kernel, else kept in bf16
    head = "q8_0" if packing.tile_applies(*model.get_output_embeddings().weight.shape) else "bf16"
    assert auto.weights == "int4" and auto.head_format == head and auto.dtype == torch.bfloat16
    # the int4 runtime holds the shipped Q4_1 values (bf16 activations):
    # its next-token choice on the prompt is the fp32 model's
    lg, _ = auto.forward_last(auto.new_state(1), ids)
    assert int(lg[0, -1].argmax()) == int(ref.logits[0, -1].argmax())


def test_hf_target_last_logits_match_full_ragged():
    """forward_last (what a prefill asks for) on the HF runtime: each row's last valid position."""
    model = _mk("llama-untied-gqa")
    t = HFTarget(model)
    ids = torch.randint(4, 96, (2, 6), generator=torch.Generator().manual_seed(4))
    counts = torch.tensor([6, 4])
    full, _ = t.forward(t.new_state(2), ids, counts)
    last, _ = t.forward_last(t.new_state(2), ids, counts)
    assert last.shape == (2, 1, 96)
    assert torch.allclose(last[0, 0], full[0, 5], atol=1e-5) and torch.allclose(last[1, 0], full[1, 3], atol=1e-5)
    one, _ = t.forward_last(t.new_state(1), ids[:1])
    assert torch.allclose(one[0, 0], full[0, 5], atol=1e-5)
    # forward_argmax (what a greedy plain step asks for): the choice greedy verification makes
    best, _ = t.forward_argmax(t.new_state(2), ids, counts)
    assert best.shape == (2, 6) and torch.equal(best, ops.argmax(full))


def test_bf16_linears_run_prepacked_with_the_same_results(monkeypatch):
    """bf16 weights on a CPU go through oneDNN's prepacked linear (faster at 1-8 rows); its output
    equals F.linear's within bf16 rounding."""
    from dspark.target import quant

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    lin = quant.Linear(w, b, "bf16", torch.bfloat16)
    assert lin.packed is not None and lin.w is None  # only the packed copy is held
    for rows in (1, 3, 8):
        x = torch.randn(2, rows, 64, generator=g).to(torch.bfloat16)
        ref = torch.nn.functional.linear(x, w.to(torch.bfloat16), b.to(torch.bfloat16))
        out = lin(x)
        assert out.shape == ref.shape and out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), ref.float(), rtol=1.6e-2, atol=1e-2)
    model = tiny_target(seed=3)
    packed = NativeTarget(model, weights="bf16")
    assert packed.layers[0].w13.packed is not None
    ids = torch.randint(4, model.config.vocab_size, (1, 12), generator=g)
    a, _ = packed.forward(packed.new_state(1), ids)
    with torch.no_grad():
        ref = model.to(torch.bfloat16)(ids).logits.float()
    torch.testing.assert_close(a.float(), ref, rtol=5e-2, atol=5e-2)


def test_greedy_argmax_widens_half_precision_with_the_same_choice():
    """ops.argmax (greedy acceptance, the draft's greedy tokens, the doctor's text) widens bf16
    logits to fp32 for speed: the same index as torch's argmax, ties to the first maximum."""
    from dspark.ops import argmax

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, 4096, generator=g).to(torch.bfloat16)
    x[0, 0, 7] = x[0, 0, 4000] = 50.0  # a tie: the first index wins, as in torch.argmax
    x[1, 2, :] = 1.0  # all equal
    out = argmax(x)
    assert out.dtype == torch.long and torch.equal(out, x.argmax(-1))
    assert int(out[0, 0]) == 7 and int(out[1, 2]) == 0
    assert torch.equal(argmax(x, dim=1), x.argmax(1))
    f = x.float()
    assert torch.equal(argmax(f), f.argmax(-1))


def test_draft_linears_decode_packed_and_train_plain():
    """A bf16 draft on a CPU decodes through packed linears (same outputs as nn.Linear); with
    gradients on it runs the plain forward, and a weight changed in place is repacked."""
    from dspark.model.packed import PackedLinear, pack_linears
    from torch import nn

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    g = torch.Generator().manual_seed(1)
    net = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 32, bias=False)).to(torch.bfloat16)
    ref = [type(m)(m.in_features, m.out_features, bias=m.bias is not None).to(torch.bfloat16) for m in net]
    for r, m in zip(ref, net):
        r.load_state_dict(m.state_dict())
    keys = set(net.state_dict())
    assert pack_linears(net) == 2 and all(isinstance(m, PackedLinear) for m in net)
    assert set(net.state_dict()) == keys  # same parameters, same names
    x = torch.randn(3, 5, 64, generator=g).to(torch.bfloat16)
    want = ref[1](ref[0](x))
    with torch.inference_mode():
        torch.testing.assert_close(net(x).float(), want.float(), rtol=1.6e-2, atol=1e-2)
        assert net[0]._packed is not None
    out = net(x)  # grad enabled, trainable weights: plain nn.Linear, differentiable
    out.float().sum().backward()
    assert net[0].weight.grad is not None
    with torch.no_grad():
        net[1].weight.mul_(2.0)
        ref[1].weight.mul_(2.0)
        torch.testing.assert_close(net(x).float(), ref[1](ref[0](x)).float(), rtol=1.6e-2, atol=2e-2)


@pytest.mark.parametrize("runtime", ["native", "hf"])
def test_taps_stay_valid_after_later_forwards(runtime):
    """The engine keeps the taps of steps that did not draft (and of the prompt) until the next
    drafting step: a forward must return a new tensor, never a buffer the next forward rewrites."""
    model = _mk("llama-untied-gqa")
    target = NativeTarget(model, (0, 2), weights="fp32") if runtime == "native" else HFTarget(model, (0, 2))
    st = target.new_state(1)
    _, first = target.forward(st, torch.tensor([[5, 6, 7]]))
    target.commit(st, torch.tensor([3]))
    kept = first.clone()
    for tok in (8, 9):
        _, later = target.forward(st, torch.tensor([[tok]]))
        target.commit(st, torch.tensor([1]))
        assert later.data_ptr() != first.data_ptr()
    assert torch.equal(first, kept)


def test_the_cache_grows_under_a_running_state_and_the_layer_views_follow():
    """Past CACHE_CHUNK entries the KV tensor is reallocated; the per-layer K/V views a forward
    reads (NativeState.layer_kv, made once per tensor) must follow it: logits stay HF's."""
    from dspark.target.kvcache import CACHE_CHUNK

    model = _mk("llama-untied-gqa")
    native = NativeTarget(model, weights="fp32")
    n = CACHE_CHUNK + 40
    assert n < model.config.max_position_embeddings
    ids = torch.randint(4, 96, (1, n), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model(ids).logits
    st = native.new_state(1)
    at, kvs = 0, set()
    for size in (CACHE_CHUNK - 8, 16, 24):  # the second forward runs past the first allocation
        lg, _ = native.forward(st, ids[:, at : at + size])
        native.commit(st, torch.tensor([size]))
        kvs.add(st.kv.data_ptr())
        assert (lg - ref[:, at : at + size]).abs().max() <= 1e-4, at
        at += size
    assert len(kvs) > 1  # the cache did grow


def test_both_runtimes_implement_the_target_protocol():
    """The engine sees targets only through dspark.target.base.Target: both runtimes have every
    member, with the protocol's parameters (names and defaults), and so do their states."""
    import inspect

    from dspark.target import base
    from dspark.target.load import make_target

    model = tiny_target()
    for runtime in ("hf", "native"):
        target = make_target(model, runtime)
        assert isinstance(target, base.Target) and isinstance(target.new_state(2), base.TargetState), runtime
        for name, member in vars(base.Target).items():
            if callable(member) and not name.startswith("_"):
                want = [(p.name, p.default) for p in inspect.signature(member).parameters.values()]
                got = [(p.name, p.default) for p in inspect.signature(getattr(type(target), name)).parameters.values()]
                assert got == want, (runtime, name, got)
