"""Every validation error of issue 2 triggered once from the CLI: exit code 2 and one line
on stderr that names the key or tensor at fault."""

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dspark.cli import main
from dspark.formats.load import load_spec
from safetensors.torch import save_file

from tests.formats_fixtures import (
    random_tensors,
    tiny_deepspec,
    tiny_speculators,
    write_checkpoint,
    write_config,
)


def _spec_cfg(**kw):
    return tiny_speculators(flag=True, **kw)


def _with_tokens(tokens):
    cfg = _spec_cfg()
    cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = tokens
    return cfg


def _with_default_method(name):
    cfg = _spec_cfg()
    cfg["speculators_config"]["default_proposal_method"] = name
    return cfg


def _without(key):
    cfg = tiny_deepspec()
    del cfg[key]
    return cfg


CONFIG_ERRORS = {
    "contradictory_layout": (
        tiny_speculators(flag=False, tokens=4),
        "sample_from_anchor=false contradicts speculators_config.proposal_methods[0].speculative_tokens=4",
    ),
    "flag_not_boolean": (_spec_cfg(sample_from_anchor="true"), "sample_from_anchor must be true or false"),
    "tokens_fit_no_layout": (tiny_speculators(flag=None, tokens=2), "speculative_tokens=2 fits neither layout"),
    "model_type_not_string": (_spec_cfg(speculators_model_type=["dspark"]), "speculators_model_type must be a string"),
    "model_type_unknown": (_spec_cfg(speculators_model_type="eagle3"), "speculators_model_type is 'eagle3'"),
    "markov_head_type_unknown": (tiny_deepspec(markov_head_type="lstm"), "markov_head_type is 'lstm'"),
    "rank_negative": (tiny_deepspec(markov_rank=-1), "markov_rank must be >= 0"),
    "rank_not_integer": (tiny_deepspec(markov_rank=2.5), "markov_rank must be an integer"),
    "mask_missing": (_without("mask_token_id"), "mask_token_id is missing"),
    "mask_negative": (tiny_deepspec(mask_token_id=-3), "mask_token_id must be >= 0"),
    "mask_outside_vocab": (
        tiny_deepspec(mask_token_id=64),
        "mask_token_id=64 is outside the vocabulary (vocab_size 64)",
    ),
    "layer_ids_not_increasing": (
        tiny_deepspec(target_layer_ids=[3, 1]),
        "target_layer_ids must be strictly increasing",
    ),
    "aux_ids_repeated": (
        _spec_cfg(aux_hidden_state_layer_ids=[2, 2]),
        "aux_hidden_state_layer_ids must be strictly increasing",
    ),
    "confidence_with_markov_rank0": (
        tiny_deepspec(markov_rank=0),
        "confidence_head_with_markov is true but markov_rank is 0",
    ),
    "unknown_default_proposal_method": (
        _with_default_method("sampling"),
        "default_proposal_method 'sampling' matches no proposal_type",
    ),
    "speculative_tokens_zero": (
        _with_tokens(0),
        "speculators_config.proposal_methods[0].speculative_tokens must be >= 1",
    ),
    "speculative_tokens_not_integer": (_with_tokens("7"), "speculative_tokens must be an integer"),
    "block_size_missing": (_without("block_size"), "block_size is missing"),
    "sliding_without_window": (
        tiny_deepspec(layer_types=["sliding_attention", "full_attention"], sliding_window=8),
        "layer_types[0] is 'sliding_attention' but use_sliding_window is not true",
    ),
    "not_a_dspark_draft": ({"architectures": ["LlamaForCausalLM"]}, "not a recognized DSpark draft"),
}


def _run_inspect(capsys, path) -> str:
    assert main(["inspect", str(path), "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dspark inspect: error: ")
    return lines[0]


@pytest.mark.parametrize("name", list(CONFIG_ERRORS))
def test_config_error(tmp_path, capsys, name):
    config, message = CONFIG_ERRORS[name]
    assert message in _run_inspect(capsys, write_config(tmp_path, copy.deepcopy(config)))


def test_malformed_json(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"block_size": 7,,}')
    assert "malformed JSON at line 1 column 18" in _run_inspect(capsys, tmp_path)


def test_missing_path(tmp_path, capsys):
    assert "does not exist" in _run_inspect(capsys, tmp_path / "nowhere")


# ---------------------------------------------------------------- weights against config


def _broken(tmp_path, config, mutate):
    write_config(tmp_path, config)
    tensors = random_tensors(load_spec(tmp_path))
    mutate(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path


def _reshape(name, *shape):
    return lambda t: t.__setitem__(name, torch.zeros(shape))


def _poison(name, value):
    def mutate(t):
        t[name] = t[name].clone()
        t[name].view(-1)[0] = value

    return mutate


WEIGHT_ERRORS = {
    # H=16, 2 taps, V=64, r=4
    "fc_width": (
        tiny_deepspec(),
        _reshape("fc.weight", 16, 48),
        "tensor fc.weight has shape [16, 48], expected [16, 32]: [hidden_size, taps x target hidden] = [16, 2 x 16]",
    ),
    "markov_w1_rows": (
        tiny_deepspec(),
        _reshape("markov_head.markov_w1.weight", 60, 4),
        "tensor markov_head.markov_w1.weight has shape [60, 4], expected [64, 4]",
    ),
    "markov_w2_rows": (
        tiny_deepspec(),
        _reshape("markov_head.markov_w2.weight", 60, 4),
        "tensor markov_head.markov_w2.weight has shape [60, 4], expected [64, 4]: rows = draft_vocab_size 64",
    ),
    "lm_head_rows": (
        tiny_deepspec(),
        _reshape("lm_head.weight", 32, 16),
        "tensor lm_head.weight has shape [32, 16], expected [64, 16]",
    ),
    "confidence_width": (
        tiny_deepspec(),
        _reshape("confidence_head.proj.weight", 1, 16),
        "tensor confidence_head.proj.weight has shape [1, 16], expected [1, 20]: "
        "width = hidden_size 16 + markov_rank 4",
    ),
    "d2t_missing": (_spec_cfg(draft_vocab_size=32), lambda t: t.pop("d2t"), "tensor d2t is missing"),
    "nan": (
        tiny_deepspec(),
        _poison("layers.1.mlp.up_proj.weight", float("nan")),
        "tensor layers.1.mlp.up_proj.weight holds 1 NaN/inf value(s)",
    ),
    "inf": (tiny_deepspec(), _poison("norm.weight", float("inf")), "tensor norm.weight holds 1 NaN/inf value(s)"),
    "unexpected_head": (
        tiny_deepspec(markov_rank=0, enable_confidence_head=False),
        lambda t: t.update({"markov_head.markov_w1.weight": torch.zeros(64, 4)}),
        "unexpected tensor markov_head.markov_w1.weight",
    ),
    "missing_layer_tensor": (
        tiny_deepspec(),
        lambda t: t.pop("layers.0.self_attn.k_proj.weight"),
        "tensor layers.0.self_attn.k_proj.weight is missing",
    ),
}


@pytest.mark.parametrize("name", list(WEIGHT_ERRORS))
def test_weight_error(tmp_path, capsys, name):
    config, mutate, message = WEIGHT_ERRORS[name]
    assert message in _run_inspect(capsys, _broken(tmp_path, config, mutate))


def test_corrupt_safetensors(tmp_path, capsys):
    write_config(tmp_path, tiny_deepspec())
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    assert "model.safetensors: not a readable safetensors file" in _run_inspect(capsys, tmp_path)


def test_d2t_out_of_range(tmp_path, capsys):
    def mutate(t):
        t["d2t"] = torch.full((32,), 40, dtype=torch.int64)  # draft id 31 -> 71 >= 64

    line = _run_inspect(capsys, _broken(tmp_path, _spec_cfg(draft_vocab_size=32), mutate))
    assert "tensor d2t maps draft ids outside the target vocabulary" in line


# ---------------------------------------------------------------- convert


def test_convert_bonus_anchor_to_deepspec_is_refused(tmp_path, capsys):
    src = write_checkpoint(tmp_path / "src", tiny_speculators(flag=False))
    assert main(["convert", str(src), str(tmp_path / "dst"), "--to", "deepspec"]) == 2
    err = capsys.readouterr().err
    assert "dspark convert: error: a bonus_anchor draft cannot be written in DeepSpec format" in err
    assert not (tmp_path / "dst").exists()


def test_convert_cli_writes(tmp_path, capsys):
    src = write_checkpoint(tmp_path / "src", tiny_deepspec())
    assert main(["convert", str(src), str(tmp_path / "dst"), "--to", "speculators"]) == 0
    assert "wrote speculators draft" in capsys.readouterr().out
    assert main(["convert", str(src), str(tmp_path / "dst"), "--to", "speculators"]) == 2
    assert "is not an empty directory" in capsys.readouterr().err


def test_real_process_exit_code_and_no_traceback(tmp_path):
    write_config(tmp_path, tiny_deepspec(markov_head_type="lstm"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-m", "dspark", "inspect", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=repo,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "dspark inspect: error: markov_head_type is 'lstm': expected one of vanilla, gated, rnn"
    ]
