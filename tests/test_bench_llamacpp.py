"""Issue 12: the optional llama.cpp arm of `dspark bench-runtime` (llama-cpp-python is not a CI
dependency: its loop is tested against a recording stand-in here, and for real where installed)."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import numpy as np
import pytest
from dspark.bench import llamacpp, runtime
from dspark.cli import main
from dspark.errors import DSparkError

from tests.test_train_fixtures import char_tokenizer
from tests.tiny import tiny_target


def _write_gguf(path, tensor_dtype=np.float32):
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), tensor_dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture()
def target_dir(tmp_path):
    tok = char_tokenizer()
    model = tiny_target(vocab=len(tok))
    model.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    return tmp_path / "target"


class _FakeLlama:
    """Records what the arm asks of llama.cpp; decodes token 2 (the tiny tokenizer's end of text)
    forever, so an arm that stopped at end-of-text would come back short."""

    made: list = []

    def __init__(self, model_path, n_ctx, n_batch, n_threads, n_threads_batch, verbose, logits_all):
        self.path, self.n_ctx, self.logits_all, self.threads = model_path, n_ctx, logits_all, n_threads
        self.n_tokens, self.evals, self.prompts, self.closed = 0, [], [], False
        _FakeLlama.made.append(self)

    def n_vocab(self):
        return 32

    def reset(self):
        self.n_tokens = 0

    def eval(self, tokens):
        assert self.n_tokens + len(tokens) <= self.n_ctx, "past the context the arm asked for"
        self.evals.append((self.n_tokens, len(tokens)))
        self.n_tokens += len(tokens)

    def generate(self, tokens, temp, top_k, top_p, min_p, repeat_penalty, reset):
        assert temp == 0.0 and reset
        self.prompts.append(list(tokens))
        self.eval(tokens)
        while True:
            yield 2
            self.eval([2])

    def close(self):
        self.closed = True


def test_llamacpp_arm_is_refused_by_name_when_not_installed(monkeypatch, target_dir, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # find_spec answers None: not installed
    with pytest.raises(DSparkError, match="needs llama-cpp-python.*dspark\\[llamacpp\\]"):
        runtime.parse_arms("native-auto,llamacpp")
    assert (
        main(
            [
                "bench-runtime",
                "--target",
                str(target_dir),
                "--arms",
                "hf-fp32,llamacpp",
                "--tokens",
                "4",
                "--rounds",
                "1",
                "--context",
                "8",
                "--threads",
                "1",
            ]
        )
        == 2
    )
    assert "needs llama-cpp-python" in capsys.readouterr().err


def test_llamacpp_arm_needs_exactly_one_gguf_file(target_dir):
    with pytest.raises(DSparkError, match="holds 0 .gguf files"):
        llamacpp.gguf_file(str(target_dir))
    _write_gguf(target_dir / "a.gguf")
    assert llamacpp.gguf_file(str(target_dir)) == target_dir / "a.gguf"
    _write_gguf(target_dir / "b.gguf")
    with pytest.raises(DSparkError, match="holds 2 .gguf files"):
        llamacpp.gguf_file(str(target_dir))


def test_llamacpp_arm_measures_decoding_and_verify_forwards_with_llama_cpps_loop(monkeypatch, target_dir):
    _write_gguf(target_dir / "model.gguf")
    fake = types.ModuleType("llama_cpp")
    fake.Llama = _FakeLlama
    fake.__spec__ = importlib.machinery.ModuleSpec("llama_cpp", None)  # what find_spec answers: installed
    _FakeLlama.made = []
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    rows = runtime.run(["native-fp32", "llamacpp"], threads=1, tokens=6, rounds=2, context=16, target=str(target_dir))
    row = {r["arm"]: r for r in rows}["llamacpp"]
    assert row["format"] == "gguf F32" and row["engine_overhead"] is None  # llama.cpp's own loop: no engine
    assert set(row["ms"]) == {1, 2, 4, 8} and row["tokens_per_s"] > 0
    plain, verify = _FakeLlama.made
    assert (plain.logits_all, verify.logits_all) == (False, True)  # a verify needs every position's logits
    assert plain.path == verify.path == str(target_dir / "model.gguf") and plain.threads == 1
    assert plain.closed and verify.closed
    # decode: the same prompt every time, n tokens whatever end-of-text says (warm-up 8, then 6 a round)
    assert len({tuple(p) for p in plain.prompts}) == 1 and len(plain.prompts) == 3
    assert [n for start, n in plain.evals if start > 0].count(1) == 7 + 5 + 5  # the last token needs no forward
    # verify forwards: each of s tokens on exactly `context` cached ones (the cache cut back first)
    ctx_evals = [e for e in verify.evals if e[0] == 0]
    assert [n for _, n in ctx_evals] == [32, 16, 16]  # warm-up context, then one per round
    assert all(start in (32, 16) and n in (1, 2, 4, 8) for start, n in verify.evals if start > 0)
    assert sum(1 for start, n in verify.evals if start == 16 and n == 8) == 2 * 6  # 2 rounds x (5 + 1 discarded)


@pytest.mark.slow
def test_llamacpp_arm_on_smollm2s_shipped_file(capsys):
    pytest.importorskip("llama_cpp")
    assert (
        main(
            [
                "bench-runtime",
                "--arms",
                "native-auto,llamacpp",
                "--tokens",
                "8",
                "--rounds",
                "1",
                "--context",
                "32",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| llamacpp | gguf Q4_1 |" in out and "| native-auto |" in out
