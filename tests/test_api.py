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
from dspark.target import load as target_load
from dspark.target.load import auto_dtype, make_target, parse_dtype
from tests.test_train_fixtures import char_tokenizer
from tests.tiny import hf_greedy, tiny_draft, tiny_target


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


def test_runtime_switch():
    assert make_target(tiny_target(), "hf").vocab_size == 96
    with pytest.raises(DSparkError, match="native runtime not available"):
        make_target(tiny_target(), "native")
    with pytest.raises(DSparkError, match="unknown target runtime"):
        make_target(tiny_target(), "onnx")


def test_build_engine_assembles_everything_from_the_config(saved):
    target, draft, model = saved
    eng = build_engine(EngineConfig(target=target, draft=draft, dtype="fp32", device="cpu", verify="threshold",
                                    threshold=0.3, max_batch=3))
    assert eng.config.draft == draft and eng.config.device == "cpu" and eng.notes == []
    assert isinstance(eng.policy, ThresholdScheduler) and eng.policy.threshold == 0.3 and eng.max_batch == 3
    assert eng.target.tap_indices == eng.draft.spec.hidden_state_indices and eng.tokenizer is not None
    ids = eng.encode("ab")
    out = eng.generate(ids, SamplingParams(max_new_tokens=8, ignore_eos=True)).output_ids
    assert out == hf_greedy(model, ids, 8)  # fp32: the target's own greedy decoding
    plain = eng.derive(speculative=False)
    assert plain.draft is None and plain.target.tap_indices == () and plain.target.model is eng.target.model
    assert isinstance(plain.policy, FullScheduler) and plain.metrics is not eng.metrics
    assert plain.generate(ids, SamplingParams(max_new_tokens=8, ignore_eos=True)).output_ids == out
    # the keyword form is the same thing
    same = load_engine(target, draft, dtype="fp32", device="cpu", no_spec=True)
    assert same.draft is None and same.config.no_spec


def test_build_engine_refuses_bad_settings_before_loading(saved, tmp_path):
    target, draft, _ = saved
    with pytest.raises(DSparkError, match="no draft given"):
        build_engine(EngineConfig(target=target, device="cpu"))
    with pytest.raises(DSparkError, match="needs a draft"):
        build_engine(EngineConfig(target=target, no_spec=True, verify="adaptive", device="cpu"))
    with pytest.raises(DSparkError, match="--max-batch"):
        build_engine(EngineConfig(target=target, no_spec=True, max_batch=0, device="cpu"))
    with pytest.raises(DSparkError, match="native runtime"):
        build_engine(EngineConfig(target=target, draft=draft, runtime="native", device="cpu"))
    curve = tmp_path / "curve.json"
    from dspark.engine.costs import CostCurve

    CostCurve((1, 16), (0.01, 0.02)).save(curve)
    eng = build_engine(EngineConfig(target=target, draft=draft, dtype="fp32", device="cpu", verify="adaptive",
                                    cost_curve=str(curve), always_draft=True, check=False))
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
