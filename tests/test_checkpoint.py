"""A target read from its files (dspark.target.checkpoint) is the model transformers loads, and a
warm start builds neither transformers' model nor imports its modeling code."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from dspark.engine.engine import Engine
from dspark.engine.sampling import SamplingParams
from dspark.formats.convert import write_deepspec
from dspark.formats.spec import Backbone
from dspark.model.layers import MLP, RMSNorm, Rope, Rotary
from dspark.target.checkpoint import Checkpoint
from dspark.target.load import load_model, load_tokenizer, make_target, open_target
from dspark.target.native import NativeTarget
from transformers import (
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tests.test_train_fixtures import char_tokenizer
from tests.tiny import FAMILY_SIZES, hf_greedy, q4_exact, tiny_draft, tiny_target

COMMON = dict(FAMILY_SIZES, rms_norm_eps=1e-5)


def _llama_tied():
    return LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, rope_theta=5e4, **COMMON))


def _llama_biased():
    return LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, attention_bias=True, mlp_bias=True, **COMMON))


def _qwen2():
    return Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=False, **COMMON))


def _qwen3():
    return Qwen3ForCausalLM(Qwen3Config(tie_word_embeddings=True, head_dim=16, **COMMON))


FAMILIES = [tiny_target, _llama_tied, _llama_biased, _qwen2, _qwen3]
IDS = ["llama", "llama-tied", "llama-bias", "qwen2", "qwen3"]


def _saved(make, path):
    torch.manual_seed(0)
    model = make().float().eval()
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("make", FAMILIES, ids=IDS)
def test_a_checkpoint_read_from_the_files_is_the_model_transformers_loads(make, tmp_path):
    model = _saved(make, tmp_path)
    loaded = load_model(tmp_path, "fp32", "cpu")
    ck = Checkpoint.from_dir(tmp_path, lambda: loaded)
    assert ck is not None
    for name, t in loaded.state_dict().items():
        if ck.has(name):
            assert torch.equal(ck.tensor(name), t), name
            assert ck.shape(name) == tuple(t.shape)
    assert torch.equal(ck.embedding(), loaded.get_input_embeddings().weight)
    assert torch.equal(ck.head(), loaded.get_output_embeddings().weight)
    inv, scale = ck.rope()
    rot = loaded.model.rotary_emb
    assert torch.equal(inv, rot.inv_freq.float()) and scale == rot.attention_scaling
    assert ck.config.num_hidden_layers == model.config.num_hidden_layers
    assert ck.model() is loaded  # transformers' model only where a reference path asks


@pytest.mark.parametrize("make", FAMILIES, ids=IDS)
def test_the_native_runtime_computes_the_same_from_the_files(make, tmp_path):
    model = _saved(make, tmp_path)
    ck = Checkpoint.from_dir(tmp_path, lambda: model)
    assert ck is not None
    prompt = torch.tensor([[5, 17, 33, 8, 40, 41]])
    a, b = NativeTarget(ck, weights="fp32"), NativeTarget(model, weights="fp32")
    la, _ = a.forward(a.new_state(), prompt, None)
    lb, _ = b.forward(b.new_state(), prompt, None)
    assert torch.equal(la, lb)
    engine = Engine(make_target(ck, "native"), None)
    req = engine.generate([5, 17, 33, 8], SamplingParams(max_new_tokens=24))
    assert req.output_ids == hf_greedy(model, [5, 17, 33, 8], 24)


def test_int4_weights_read_from_the_files_are_recognised_and_packed_alike(tmp_path):
    model = q4_exact(tiny_target())
    model.save_pretrained(tmp_path)
    ck = Checkpoint.from_dir(tmp_path, lambda: model)
    assert ck is not None
    a, b = NativeTarget(ck), NativeTarget(model)
    assert a.weights == b.weights == "int4" and a.describe() == b.describe()
    prompt = torch.tensor([[5, 17, 33, 8]])
    la, _ = a.forward(a.new_state(), prompt, None)
    lb, _ = b.forward(b.new_state(), prompt, None)
    assert torch.equal(la, lb)


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "case",
    [
        "scaled rope",
        "eps left to the class",
        "qwen3 head_dim left to the class",
        "sliding window",
        "pytorch bin",
        "gpt2",
    ],
)
def test_what_the_files_alone_do_not_say_is_read_through_transformers(case, tmp_path):
    torch.manual_seed(0)
    if case == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=4)).eval()
    elif case.startswith("qwen3"):  # its class's default head_dim (128) is not hidden / heads (16)
        model = Qwen3ForCausalLM(Qwen3Config(tie_word_embeddings=True, head_dim=128, **COMMON)).eval()
    else:
        model = tiny_target()
    model.save_pretrained(tmp_path)
    if case == "pytorch bin":  # the weights as a pickle only
        torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
        (tmp_path / "model.safetensors").unlink()
    if case == "scaled rope":
        _edit_config(tmp_path, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    elif case == "eps left to the class":
        _edit_config(tmp_path, rms_norm_eps=None)
    elif case.startswith("qwen3"):
        _edit_config(tmp_path, head_dim=None)
    elif case == "sliding window":
        _edit_config(tmp_path, sliding_window=16)
    assert Checkpoint.from_dir(tmp_path, lambda: None) is None
    # the loader still opens it, through transformers' model, with its numbers
    reference = load_model(tmp_path, "fp32", "cpu")
    target, _, _ = open_target(str(tmp_path), "fp32", "cpu")
    assert target.model is not None
    engine = Engine(target, None)
    assert engine.generate([5, 17, 33], SamplingParams(max_new_tokens=12)).output_ids == hf_greedy(
        reference, [5, 17, 33], 12
    )


def test_the_tokenizer_loads_without_the_auto_classes_and_says_the_same(tmp_path):
    tok = char_tokenizer()
    tok.save_pretrained(tmp_path)
    ours, auto = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    assert type(ours) is type(auto)
    chat = [{"role": "user", "content": "abc de"}]
    assert ours.apply_chat_template(chat, tokenize=False) == auto.apply_chat_template(chat, tokenize=False)
    assert ours("abc de")["input_ids"] == auto("abc de")["input_ids"]
    assert (ours.eos_token_id, ours.pad_token_id, ours.bos_token_id) == (
        auto.eos_token_id,
        auto.pad_token_id,
        auto.bos_token_id,
    )
    assert load_tokenizer(tmp_path / "nothing-here") is None


def test_a_warm_start_builds_no_transformers_model(tmp_path):
    """build_engine on a target read from its files: neither transformers' modeling code nor its
    auto classes are imported (seconds of every start); `target.model` builds the model on demand."""
    model = tiny_target(vocab=len(char_tokenizer()))
    model.save_pretrained(tmp_path / "target")
    char_tokenizer().save_pretrained(tmp_path / "target")
    draft = tiny_draft(model, gamma=3)
    write_deepspec(draft.spec, draft.own_state_dict(), tmp_path / "draft")
    code = f"""
import sys
from dspark.api import load_engine
from dspark.engine.sampling import SamplingParams
engine = load_engine({str(tmp_path / "target")!r}, {str(tmp_path / "draft")!r}, dtype="fp32", check=False, threads=1)
out = engine.generate([5, 6, 7], SamplingParams(max_new_tokens=8)).output_ids
heavy = sorted(m for m in sys.modules if m in ("transformers.modeling_utils", "transformers.models.auto.auto_factory")
               or (m.startswith("transformers.models.") and ".modeling_" in m))
print(heavy)
print(out)
print(type(engine.target.model).__name__)
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "DSPARK_CACHE": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    heavy, out, cls = run.stdout.strip().splitlines()[-3:]
    assert heavy == "[]"
    assert json.loads(out) == hf_greedy(model, [5, 6, 7], 8)
    assert cls == "LlamaForCausalLM"


def _backbone(**kw) -> Backbone:
    base = dict(
        family="qwen3",
        hidden_size=64,
        intermediate_size=96,
        num_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        rope_scaling=None,
        max_position_embeddings=4096,
        attention_bias=False,
        qk_norm=True,
    )
    base.update(kw)
    return Backbone(**base)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_the_draft_layers_compute_what_transformers_qwen3_modules_compute(dtype, act):
    from dspark.model.layers import hf_config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

    b = _backbone(hidden_act=act)
    torch.manual_seed(0)
    x = torch.randn(2, 5, 64).to(dtype)
    ours, theirs = RMSNorm(64, eps=1e-6).to(dtype), Qwen3RMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(64))
        theirs.weight.copy_(ours.weight)
    assert torch.equal(ours(x), theirs(x))
    mlp, ref = MLP(b).to(dtype), Qwen3MLP(hf_config(b)).to(dtype)
    ref.load_state_dict(mlp.state_dict())
    assert torch.equal(mlp(x), ref(x))
    pos = torch.arange(300).view(2, 150)
    rot, hf_rot = Rotary(b), Qwen3RotaryEmbedding(hf_config(b))
    assert torch.equal(rot.inv_freq, hf_rot.inv_freq)
    for a, c in zip(rot(x, pos), hf_rot(x, pos)):
        assert torch.equal(a, c)
    # a scaled RoPE runs transformers' own module
    scaled = _backbone(rope_scaling={"rope_type": "linear", "factor": 4.0})
    assert isinstance(Rope(scaled).rotary, Qwen3RotaryEmbedding)
    assert isinstance(Rope(b).rotary, Rotary)
