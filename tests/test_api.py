"""dspark.api: one EngineConfig -> build_engine; dtype "auto"; the runtime switch; derived engines."""

from __future__ import annotations

import pytest
import torch
from dspark.api import EngineConfig, build_engine, load_engine, resolve
from dspark.engine.detok import Detokenizer
from dspark.engine.sampling import SamplingParams
from dspark.engine.scheduler import AdaptiveScheduler, FullScheduler, ThresholdScheduler
from dspark.errors import DSparkError
from dspark.formats.convert import write_deepspec
from dspark.model import fast as fast_draft
from dspark.target import load as target_load
from dspark.target.hf import HFTarget
from dspark.target.load import auto_dtype, make_target, open_target, parse_dtype
from dspark.target.native import NativeTarget
from transformers import GPT2Config, GPT2LMHeadModel

from tests.test_train_fixtures import char_tokenizer
from tests.tiny import hf_greedy, q4_exact, tiny_draft, tiny_target


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("api")
    model = tiny_target(vocab=len(char_tokenizer()))
    model.save_pretrained(root / "target")
    char_tokenizer().save_pretrained(root / "target")
    draft = tiny_draft(model, gamma=3)
    write_deepspec(draft.spec, draft.own_state_dict(), root / "draft")
    return str(root / "target"), str(root / "draft"), model


def test_dtype_auto_follows_the_hardware(monkeypatch):
    monkeypatch.setattr(target_load, "cpu_bf16_feature", lambda: None)
    assert auto_dtype("cpu") == ("fp32", "dtype auto -> fp32 (this CPU has no native bf16: AVX512-BF16 or AMX)")
    assert parse_dtype("auto", "cpu") == torch.float32
    monkeypatch.setattr(target_load, "cpu_bf16_feature", lambda: "AMX-BF16")
    assert auto_dtype("cpu") == ("bf16", "dtype auto -> bf16 (CPU has AMX-BF16)")
    assert parse_dtype("auto", "cpu") == torch.bfloat16
    assert auto_dtype("cuda:0")[0] == "bf16"
    config, notes = resolve(EngineConfig(dtype="auto", device="cpu", no_spec=True))
    assert config.dtype == "bf16" and notes == ["dtype auto -> bf16 (CPU has AMX-BF16)"]
    assert parse_dtype("float32") == torch.float32 and parse_dtype("bfloat16") == torch.bfloat16
    with pytest.raises(DSparkError, match="fp16 is not supported on CPU"):
        parse_dtype("float16", "cpu")


def test_runtime_switch(tmp_path):
    m = tiny_target()
    assert isinstance(make_target(m, "hf"), HFTarget) and isinstance(make_target(m, "native"), NativeTarget)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=96))
    with pytest.raises(DSparkError, match="use --runtime hf"):
        make_target(gpt2, "native")
    with pytest.raises(DSparkError, match="unknown runtime"):
        make_target(m, "onnx")
    # open_target: auto is native where supported, and says so; hf where not, and says why
    m.save_pretrained(tmp_path / "llama")
    t, _, notes = open_target(str(tmp_path / "llama"), "fp32", "cpu")
    assert isinstance(t, NativeTarget) and t.weights == "fp32" and notes == [f"runtime auto -> {t.describe()}"]
    t, _, notes = open_target(str(tmp_path / "llama"), "fp32", "cpu", "hf")
    assert isinstance(t, HFTarget) and notes == []
    gpt2.save_pretrained(tmp_path / "gpt2")
    t, _, notes = open_target(str(tmp_path / "gpt2"), "fp32", "cpu")
    assert isinstance(t, HFTarget) and notes[0].startswith("runtime auto -> hf (")
    with pytest.raises(DSparkError, match="--weights int8 needs the native runtime"):
        open_target(str(tmp_path / "llama"), "fp32", "cpu", "hf", "int8")
    # weights auto: exact 4-bit layers run as int4 with bf16 activations unless fp32 was asked for
    q4_exact(tiny_target()).save_pretrained(tmp_path / "q4")
    t, _, notes = open_target(str(tmp_path / "q4"), "fp32", "cpu", dtype_given=False)
    assert t.weights == "int4" and t.dtype == torch.bfloat16 and notes[0].startswith("weights auto -> int4")
    assert t.head_format != "int4"  # auto never quantises what is not 4-bit already (the head)
    t, _, _ = open_target(str(tmp_path / "q4"), "fp32", "cpu", dtype_given=True)
    assert t.weights == "fp32" and t.dtype == torch.float32


def test_the_start_up_lines_agree_on_what_runs(tmp_path, monkeypatch):
    """A CPU without native bf16 and a model of exact 4-bit layers: "auto" alone would say fp32,
    but the int4 weights run with bf16 activations; the dtype line says that, once, and the
    engine's resolved config holds the dtype that runs."""
    monkeypatch.setattr(target_load, "cpu_bf16_feature", lambda: None)
    q4_exact(tiny_target()).save_pretrained(tmp_path / "q4")
    eng = build_engine(EngineConfig(target=str(tmp_path / "q4"), device="cpu", no_spec=True))
    assert eng.config.dtype == "bf16" and eng.target.dtype == torch.bfloat16
    assert eng.notes[0].startswith("dtype auto -> bf16: the model's int4 weights run with bf16 activations")
    assert eng.notes[0].endswith("other models would get fp32 here (this CPU has no native bf16: AVX512-BF16 or AMX)")
    assert not any(n.startswith("dtype auto -> fp32") for n in eng.notes)
    plain = build_engine(EngineConfig(target=str(tmp_path / "q4"), device="cpu", no_spec=True, weights="fp32"))
    assert plain.config.dtype == "fp32" and plain.notes[0].startswith("dtype auto -> fp32 (")


def test_build_engine_assembles_everything_from_the_config(saved):
    target, draft, model = saved
    eng = build_engine(
        EngineConfig(
            target=target, draft=draft, dtype="fp32", device="cpu", verify="threshold", threshold=0.3, max_batch=3
        )
    )
    assert eng.config.draft == draft and eng.config.device == "cpu"
    assert eng.notes == [
        f"runtime auto -> {eng.target.describe()}",
        fast_draft.describe(eng.draft),
        eng.lookup.describe(),  # on by default: the start-up says so
    ]
    assert eng.policy.curve is not None  # threshold: the lookup prices its proposals on the target's curve
    # --dtype fp32 given: the draft's own numbers, computed in fp32 by its modules (the kernels' are bf16)
    assert eng.notes[1] == f"draft decodes through its modules ({fast_draft.FP32_REASON})"
    assert eng.config.draft_weights == "fp32" and fast_draft.weights(eng.draft) == "fp32"
    assert isinstance(eng.target, NativeTarget)
    assert eng.draft.fc.weight.dtype == eng.target.dtype
    assert isinstance(eng.policy, ThresholdScheduler) and eng.policy.threshold == 0.3 and eng.max_batch == 3
    assert eng.target.tap_indices == eng.draft.spec.hidden_state_indices and eng.tokenizer is not None
    ids = eng.encode("ab")
    out = eng.generate(ids, SamplingParams(max_new_tokens=8, ignore_eos=True)).output_ids
    assert out == hf_greedy(model, ids, 8)  # fp32: the target's own greedy decoding
    plain = eng.derive(speculative=False)
    assert plain.draft is None and plain.target.tap_indices == () and plain.target.model is eng.target.model
    assert isinstance(plain.policy, FullScheduler) and plain.metrics is not eng.metrics
    assert plain.generate(ids, SamplingParams(max_new_tokens=8, ignore_eos=True)).output_ids == out
    # the load-time check's measurement is kept for every policy of this engine to start from
    assert eng.prior is not None and eng.prior.gamma == eng.draft.spec.gamma and eng.prior.draft_seconds > 0
    assert eng.prior.anchors > 0 and plain.prior is None and eng.derive().prior is eng.prior
    ada = build_engine(EngineConfig(target=target, draft=draft, dtype="fp32", device="cpu"))  # default: adaptive
    assert isinstance(ada.policy, AdaptiveScheduler) and ada.policy.prior is ada.prior is not None
    assert ada.notes[-1].startswith("adaptive: acceptance by depth") and "load-time check" in ada.notes[-1]
    assert build_engine(EngineConfig(target=target, draft=draft, dtype="fp32", device="cpu", check=False)).prior is None
    # the keyword form is the same thing
    same = load_engine(target, draft, dtype="fp32", device="cpu", no_spec=True)
    assert same.draft is None and same.config.no_spec


def test_no_draft_speculates_from_the_text_alone_on_any_target(saved):
    """--no-draft: no draft is loaded (a target without one speculates), the lookup proposes, verified
    in full; greedy output is the target's own decoding in fp32, and the start-up says what runs."""
    target, _, model = saved
    eng = build_engine(EngineConfig(target=target, no_draft=True, dtype="fp32", device="cpu"))
    assert eng.draft is None and eng.lookup is not None and isinstance(eng.policy, FullScheduler)
    assert eng.policy.curve is not None and eng.notes[-1] == eng.lookup.describe(False)
    assert "against plain decoding (no draft loaded)" in eng.notes[-1]
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
    req = eng.generate(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))
    assert req.output_ids == hf_greedy(model, prompt, 40)
    look = eng.metrics.lookup
    assert look is not None and look.steps > 0 and eng.metrics.steps == 0  # the lookup's steps alone
    plain = eng.derive(speculative=False)
    assert (
        plain.lookup is None
        and plain.generate(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True)).output_ids == req.output_ids
    )
    for bad, match in (
        (dict(no_spec=True), "pass one of them"),
        (dict(draft="somewhere"), "pass one of them"),
        (dict(lookup=False), "leaves nothing to propose"),
        (dict(verify="adaptive"), "leave --verify out"),
    ):
        with pytest.raises(DSparkError, match=match):
            build_engine(EngineConfig(target=target, no_draft=True, device="cpu", **bad))


def test_build_engine_refuses_bad_settings_before_loading(saved, tmp_path):
    target, draft, _ = saved
    with pytest.raises(DSparkError, match="no draft given"):
        build_engine(EngineConfig(target=target, device="cpu"))
    with pytest.raises(DSparkError, match="needs a draft"):
        build_engine(EngineConfig(target=target, no_spec=True, verify="adaptive", device="cpu"))
    with pytest.raises(DSparkError, match="--max-batch"):
        build_engine(EngineConfig(target=target, no_spec=True, max_batch=0, device="cpu"))
    with pytest.raises(DSparkError, match="needs the native runtime"):
        build_engine(EngineConfig(target=target, draft=draft, runtime="hf", weights="int8", device="cpu"))
    curve = tmp_path / "curve.json"
    from dspark.engine.costs import CostCurve

    CostCurve((1, 16), (0.01, 0.02)).save(curve)
    eng = build_engine(
        EngineConfig(
            target=target,
            draft=draft,
            dtype="fp32",
            device="cpu",
            verify="adaptive",
            cost_curve=str(curve),
            always_draft=True,
            check=False,
        )
    )
    assert isinstance(eng.policy, AdaptiveScheduler) and not eng.policy.skip and eng.policy.curve.tokens == (1, 16)


class _Bytes:
    """A byte-level tokenizer: one token per UTF-8 byte (multi-byte characters span tokens)."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_detokenizer_is_incremental_waits_for_whole_characters_and_finds_stops():
    text = "héllo wörld. STOP here"
    ids = list(text.encode())
    d = Detokenizer(_Bytes(), stop=("STOP",))
    seen = []
    for n in range(1, len(ids) + 1):
        d.update(ids[:n])
        seen.append(d.text)
        assert "\ufffd" not in d.text and text.startswith(d.text)
        assert d.streamable() == d.text[: max(0, len(d.text) - 3)]  # a stop string's first 3 chars held back
        if d.find_stop() is not None:
            break
    assert d.text[: d.find_stop() if d.find_stop() is not None else None] == "héllo wörld. "
    assert all(len(a) <= len(b) for a, b in zip(seen, seen[1:]))
    plain = Detokenizer(_Bytes())
    plain.update(ids)
    assert plain.text == text and plain.streamable() == text and plain.find_stop() is None


def test_explicit_numerics_are_honored_or_refused_naming_the_flags(tmp_path, monkeypatch):
    """Issue 52: --dtype fp32 runs fp32 throughout (the target's exact dequantised 4-bit values, the
    draft's own numbers on its modules), said in the start-up lines; every combination the runtime
    cannot honor is refused before anything loads, naming the flags that can."""
    monkeypatch.setattr(target_load, "cpu_bf16_feature", lambda: "AVX512-BF16")
    q4_exact(tiny_target(vocab=len(char_tokenizer()))).save_pretrained(tmp_path / "q4")
    model = tiny_target(vocab=len(char_tokenizer()))
    draft = tiny_draft(model, gamma=3)
    write_deepspec(draft.spec, draft.own_state_dict(), tmp_path / "draft")
    base = dict(target=str(tmp_path / "q4"), draft=str(tmp_path / "draft"), device="cpu", check=False, lookup=False)
    eng = build_engine(EngineConfig(**base, dtype="fp32"))
    assert eng.target.weights == "fp32" and eng.target.dtype == torch.float32
    assert eng.draft.fc.weight.dtype == torch.float32 and fast_draft.weights(eng.draft) == "fp32"
    assert eng.notes[0].startswith("weights auto -> fp32 (--dtype fp32: the model's exact 4-bit values")
    assert f"draft decodes through its modules ({fast_draft.FP32_REASON})" in eng.notes
    # explicit int4 with fp32: torch's weight-only kernel takes fp32 activations (honored, and said)
    eng = build_engine(EngineConfig(**base, dtype="fp32", weights="int4"))
    assert eng.target.weights == "int4" and eng.target.dtype == torch.float32 and "activations float32" in eng.notes[0]
    # dtype auto follows float weights asked for, in one line
    eng = build_engine(EngineConfig(**base, weights="fp32"))
    assert eng.target.dtype == torch.float32 and eng.config.dtype == "fp32"
    assert eng.notes[0].startswith("dtype auto -> fp32: --weights fp32 runs with fp32 activations")
    refusals = [
        (
            {"dtype": "fp32", "weights": "bf16"},
            "--weights bf16 runs with bf16 activations, but --dtype fp32",
            "--dtype bf16 with --weights bf16",
        ),
        (
            {"dtype": "bf16", "weights": "fp32"},
            "--weights fp32 runs with fp32 activations, but --dtype bf16",
            "--dtype fp32 with --weights fp32",
        ),
        (
            {"dtype": "fp32", "draft_weights": "q4"},
            "--draft-weights q4 runs the draft on dspark's CPU kernels",
            "--dtype fp32 with --draft-weights auto",
        ),
        (
            {"dtype": "float32", "draft_weights": "bf16"},
            "--draft-weights bf16",
            "--dtype auto or bf16 with --draft-weights bf16",
        ),
        (
            {"dtype": "fp32", "activations": "int8"},
            "--activations int8 sets what dspark's int4 / Q8_0",
            "--dtype fp32 with --activations auto",
        ),
        (
            {"draft_weights": "fp32"},
            "--draft-weights fp32 runs the draft's modules in fp32",
            "pass --dtype fp32 with --draft-weights fp32",
        ),
        ({"dtype": "bf16", "draft_weights": "fp32"}, "which --dtype bf16 does not give", "--dtype fp32"),
    ]
    for settings, what, fix in refusals:
        with pytest.raises(DSparkError) as refused:
            resolve(EngineConfig(**base, **settings))
        assert what in str(refused.value) and fix in str(refused.value), (settings, str(refused.value))
    # the kernels' formats on a draft they cannot run (its vocabulary of 75): refused, not ignored
    with pytest.raises(DSparkError, match=r"--draft-weights q8 sets the matrices .* pass --draft-weights auto"):
        build_engine(EngineConfig(**base, draft_weights="q8"))
    assert resolve(EngineConfig(**base, dtype="fp32"))[0].draft_weights == "fp32"
    assert resolve(EngineConfig(**base))[0].draft_weights == "auto"  # auto stays the fast default
