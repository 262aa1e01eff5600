"""Issue 52: the native runtime's packed weights are computed once per target, request and code,
then read back from the dspark cache (dspark.target.packcache), bit for bit what packing makes."""

from __future__ import annotations

import logging

import pytest
import torch
from dspark import kernels
from dspark import packing as tile_packing
from dspark.api import EngineConfig, build_engine
from dspark.engine.sampling import SamplingParams
from dspark.target import packcache, quant
from dspark.target.quant import Linear

from tests.test_train_fixtures import char_tokenizer
from tests.tiny import q4_exact, tiny_target

PROMPT = [5, 9, 14, 7, 22, 5, 9]
AUTO = b'\\"request\\": {\\"weights\\": \\"auto\\"'  # the identity's request, in the file's header


def _save(model, path):
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def saved(tmp_path, monkeypatch):
    """A tiny target whose layers are exact 4-bit groups (weights auto -> int4, as SmolLM2), and a
    fresh cache folder."""
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    return _save(q4_exact(tiny_target(vocab=len(char_tokenizer()))), tmp_path / "target")


PACKERS = ((quant, "int4_groups"), (quant, "q8_groups"), (tile_packing, "pack_q4"), (tile_packing, "pack_q8"))


@pytest.fixture
def packing(monkeypatch):
    """Counts every call that packs or screens weights: the int4 / Q8_0 groups, the tile layouts,
    and each Linear made in a stored format (int8's rule is its own)."""
    calls: list[str] = []

    def counted(module, name):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, **k: calls.append(name) or real(*a, **k))

    for module, name in PACKERS:
        counted(module, name)
    init = Linear.__init__

    def made(self, w, b, fmt, *a, **k):
        if fmt in packcache.STORED:
            calls.append(f"Linear {fmt}")
        init(self, w, b, fmt, *a, **k)

    monkeypatch.setattr(Linear, "__init__", made)
    return calls


def _build(path, **kw):
    kw = {"no_spec": True, "device": "cpu", "check": False, **kw}
    return build_engine(EngineConfig(target=str(path), **kw))


def _greedy(engine) -> list[int]:
    return engine.generate(list(PROMPT), SamplingParams(max_new_tokens=16)).output_ids


def _linears(engine) -> list[Linear]:
    t = engine.target
    return [lin for ly in t.layers for lin in (ly.wqkv, ly.wo, ly.w13, ly.w2)] + [t.head]


def _state(lin: Linear) -> dict:
    """A Linear's attributes, its tensors as (dtype, shape, bytes): equal means bit for bit."""

    def bits(v):
        if isinstance(v, torch.Tensor) and v.layout != torch.strided:  # oneDNN's packed bf16: not stored
            return ("opaque", v.dtype, tuple(v.shape))
        if isinstance(v, torch.Tensor):
            return (v.dtype, tuple(v.shape), v.contiguous().flatten().view(torch.uint8).tolist())
        return tuple(bits(t) for t in v) if isinstance(v, tuple) else v

    return {k: bits(v) for k, v in vars(lin).items()}


def _files():
    return sorted((packcache.envs.cache_dir() / "packed").glob("*.safetensors"))


def _said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "dspark"]


def test_the_second_build_reads_the_packed_weights_and_decodes_the_same(saved, packing, monkeypatch, caplog):
    first = _build(saved)
    assert first.target.weights == "int4" and packing.count("int4_groups") > 0
    (path,) = _files()
    tokens = _greedy(first)

    def refuse(*a, **k):
        raise AssertionError("weights were packed or screened again although the cache holds them")

    for module, name in PACKERS:
        monkeypatch.setattr(module, name, refuse)
    init = Linear.__init__
    monkeypatch.setattr(
        Linear, "__init__", lambda s, w, b, fmt, *a: refuse() if fmt in packcache.STORED else init(s, w, b, fmt, *a)
    )
    with caplog.at_level(logging.INFO, logger="dspark"):
        second = _build(saved)
    assert any(m.startswith("loaded target ") and "(cached: " in m for m in _said(caplog)), _said(caplog)
    assert second.target.describe() == first.target.describe()
    assert [lin.fmt for lin in _linears(second)] == [lin.fmt for lin in _linears(first)]
    assert all(_state(a) == _state(b) for a, b in zip(_linears(first), _linears(second)))
    assert _greedy(second) == tokens  # token for token
    assert _files() == [path]


def test_the_packed_tensors_are_those_packing_makes(saved, tmp_path, monkeypatch):
    """Bit for bit against packing afresh, in every stored format; each format its own file."""
    for weights in ("auto", "int8", "int4"):
        cached = [_build(saved, weights=weights) for _ in range(2)][1]
        monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / f"fresh-{weights}"))
        fresh = _build(saved, weights=weights)
        monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
        assert any(lin.fmt == (weights if weights != "auto" else "int4") for lin in _linears(cached))
        assert all(_state(a) == _state(b) for a, b in zip(_linears(fresh), _linears(cached)))
    assert len(_files()) == 3


def test_a_changed_weight_file_format_or_kernel_packs_again(saved, packing, monkeypatch, caplog):
    _build(saved)
    packed = len(packing)
    _build(saved)
    assert len(packing) == packed  # nothing packed: the cache
    # the target's weights rewritten (other 4-bit values): packed again, and decoding follows them
    _save(q4_exact(tiny_target(seed=7, vocab=len(char_tokenizer()))), saved)
    with caplog.at_level(logging.INFO, logger="dspark"):
        changed = _build(saved)
    assert len(packing) > packed and any("are stale (target_files changed)" in m for m in _said(caplog))
    monkeypatch.setenv("DSPARK_CACHE", str(saved.parent / "elsewhere"))
    assert _greedy(changed) == _greedy(_build(saved))  # as packed without a cache
    monkeypatch.setenv("DSPARK_CACHE", str(saved.parent / "cache"))
    # another weight format, and another kernel build or activation format, pack again
    tag = kernels.build_tag()
    other = "bf16" if kernels.q4_activations() == "int8" else "int8"  # the activations this build does not take
    for change, weights in (
        (lambda: None, "int8"),
        (lambda: monkeypatch.setattr(kernels, "build_tag", lambda: f"{tag}-rebuilt"), "auto"),
        (lambda: monkeypatch.setattr(kernels, "q4_activations", lambda: other), "auto"),
    ):
        change()
        before = len(packing)
        _build(saved, weights=weights)
        assert len(packing) > before
        before = len(packing)
        _build(saved, weights=weights)
        assert len(packing) == before  # and cached again


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda good: b"not a safetensors file at all",
        lambda good: good[: len(good) // 2],  # cut short
        lambda good: good[:8] + b"[" + good[9:],  # its header broken (no longer JSON)
        lambda good: good.replace(AUTO, AUTO.replace(b"auto", b"int8"), 1),  # another request's (as JSON in JSON)
    ],
    ids=["garbage", "truncated", "header", "foreign"],
)
def test_a_corrupt_or_foreign_cache_file_is_ignored_with_a_warning_and_rewritten(
    saved, packing, caplog, corrupt, monkeypatch
):
    tokens = _greedy(_build(saved))
    (path,) = _files()
    good = path.read_bytes()
    assert AUTO in good  # what "foreign" rewrites
    path.write_bytes(corrupt(good))
    before = len(packing)
    with caplog.at_level(logging.INFO, logger="dspark"):
        again = _build(saved)
    warned = [m for m in _said(caplog) if m.startswith("WARNING: ") and "packed-weights cache" in m]
    assert len(warned) == 1 and str(path) in warned[0], _said(caplog)
    assert len(packing) > before and _greedy(again) == tokens
    before = len(packing)
    _build(saved)  # rewritten: read back
    assert len(packing) == before and _files() == [path]


def test_explicit_fp32_stores_no_matrix_and_an_unwritable_cache_only_warns(saved, packing, tmp_path, monkeypatch):
    fp32 = _build(saved, dtype="fp32")
    assert fp32.target.weights == "fp32" and all(lin.fmt == "fp32" for lin in _linears(fp32))
    (path,) = _files()
    assert b"layers.0.wqkv" not in path.read_bytes()  # float formats: the model's own tensors, not stored
    screened = len(packing)
    _build(saved, dtype="fp32")
    assert len(packing) == screened  # the format's screen was read back
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder would be")
    monkeypatch.setenv("DSPARK_CACHE", str(blocked))
    assert _greedy(_build(saved)) == _greedy(_build(saved, weights="int4"))
