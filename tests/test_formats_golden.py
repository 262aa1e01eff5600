"""Golden configs from real published heads: `dspark inspect --json` prints the expected fields."""

import copy
import json

import pytest
from dspark.cli import main
from dspark.errors import FormatError
from dspark.formats.load import load_spec

from tests.formats_fixtures import (
    FLAGGED_ANCHOR_FIRST,
    GLM52_SPECULATORS,
    QWEN3_4B_DEEPSPEC,
    QWEN3_8B_DEEPSPEC,
    tiny_deepspec,
    tiny_specforge,
    write_checkpoint,
    write_config,
)

JSON_KEYS = {
    "format",
    "layout",
    "layout_source",
    "gamma",
    "query_slots",
    "block_size",
    "hidden_state_indices",
    "mask_token_id",
    "vocab_size",
    "draft_vocab_size",
    "has_d2t",
    "markov_rank",
    "markov_head_type",
    "confidence_head",
    "confidence_head_with_markov",
    "num_layers",
    "hidden_size",
    "layer_attention",
    "verifier",
    "warnings",
}


def inspect_json(capsys, path, *extra) -> dict:
    assert main(["inspect", str(path), "--json", *extra]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == JSON_KEYS
    return out


def test_glm52_legacy_head_is_bonus_anchor(tmp_path, capsys):
    out = inspect_json(capsys, write_config(tmp_path, GLM52_SPECULATORS))
    assert out["format"] == "speculators"
    assert out["layout"] == "bonus_anchor"
    assert out["layout_source"] == "legacy_default"
    assert (out["gamma"], out["query_slots"], out["block_size"]) == (7, 8, 8)
    assert out["hidden_state_indices"] == [8, 23, 39, 55, 70]
    assert (out["mask_token_id"], out["vocab_size"], out["draft_vocab_size"]) == (154856, 154880, 154880)
    assert out["verifier"] == "zai-org/GLM-5.2"
    assert any("sample_from_anchor absent" in w for w in out["warnings"])


@pytest.mark.parametrize("config, hidden", [(QWEN3_4B_DEEPSPEC, 2560), (QWEN3_8B_DEEPSPEC, 4096)])
def test_deepspec_qwen3_heads_are_anchor_first(tmp_path, capsys, config, hidden):
    out = inspect_json(capsys, write_config(tmp_path, config))
    assert (out["format"], out["layout"], out["layout_source"]) == ("deepspec", "anchor_first", "format")
    assert (out["gamma"], out["query_slots"], out["block_size"]) == (7, 7, 7)
    # target layer t is HF hidden_states[t + 1]
    assert out["hidden_state_indices"] == [2, 10, 18, 26, 34]
    assert out["mask_token_id"] == 151669
    assert (out["markov_rank"], out["markov_head_type"]) == (256, "vanilla")
    assert out["confidence_head"] and out["confidence_head_with_markov"]
    assert (out["num_layers"], out["hidden_size"]) == (5, hidden)
    assert out["layer_attention"] == [{"sliding_window": None, "causal": False}] * 5
    spec = load_spec(tmp_path)
    assert spec.backbone.family == "qwen3" and spec.backbone.qk_norm
    assert spec.backbone.rope_theta == 1e6 and spec.target_hidden_size == hidden


def test_flagged_anchor_first_speculators_head(tmp_path, capsys):
    out = inspect_json(capsys, write_config(tmp_path, FLAGGED_ANCHOR_FIRST))
    assert (out["layout"], out["layout_source"]) == ("anchor_first", "flag")
    assert (out["gamma"], out["query_slots"], out["block_size"]) == (7, 7, 7)


def test_contradiction_is_refused(tmp_path, capsys):
    bad = copy.deepcopy(GLM52_SPECULATORS)
    bad["sample_from_anchor"] = True  # says anchor-first, but block 8 / 7 tokens is bonus-anchor
    write_config(tmp_path, bad)
    assert main(["inspect", str(tmp_path), "--json"]) == 2
    err = capsys.readouterr().err
    assert "sample_from_anchor=true contradicts" in err
    assert "speculative_tokens=7" in err


def test_forced_layout_is_reported(tmp_path, capsys):
    out = inspect_json(capsys, write_config(tmp_path, GLM52_SPECULATORS), "--layout", "anchor_first")
    assert (out["layout"], out["layout_source"], out["gamma"], out["query_slots"]) == ("anchor_first", "forced", 8, 8)
    assert any("layout forced to anchor_first" in w for w in out["warnings"])


def test_table_output(tmp_path, capsys):
    assert main(["inspect", str(write_config(tmp_path, GLM52_SPECULATORS))]) == 0
    out = capsys.readouterr().out
    assert "bonus_anchor" in out and "8, 23, 39, 55, 70" in out and "warning" in out


def test_config_file_path_is_accepted(tmp_path):
    write_config(tmp_path, QWEN3_4B_DEEPSPEC)
    assert load_spec(tmp_path / "config.json").gamma == 7


def test_specforge_export_is_bonus_anchor(tmp_path):
    spec = load_spec(write_checkpoint(tmp_path, tiny_specforge()))
    assert (spec.format, spec.layout, spec.layout_source) == ("specforge", "bonus_anchor", "format")
    assert (spec.gamma, spec.query_slots, spec.block_size) == (3, 4, 4)
    assert spec.hidden_state_indices == (2, 4)
    assert spec.mask_token_id == 5 and not spec.confidence_head_with_markov


def test_specforge_defaults_are_declared(tmp_path):
    cfg = tiny_specforge()
    del cfg["markov_rank"], cfg["markov_head_type"]
    spec = load_spec(write_config(tmp_path, cfg))
    assert spec.markov_rank == 256
    assert any("markov_rank absent" in w for w in spec.warnings)


def test_gemma4_deepspec_family(tmp_path):
    cfg = tiny_deepspec(architectures=["Gemma4DSparkModel"], model_type="gemma4_text")
    del cfg["hidden_act"]
    cfg["hidden_activation"] = "gelu_pytorch_tanh"
    spec = load_spec(write_config(tmp_path, cfg))
    assert spec.backbone.family == "gemma4" and spec.backbone.hidden_act == "gelu_pytorch_tanh"


def test_deepseek_v4_is_recognized_and_refused(tmp_path, capsys):
    cfg = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "hidden_size": 4096,
        "dspark_block_size": 5,
        "dspark_target_layer_ids": [40, 41, 42],
        "dspark_markov_rank": 256,
        "dspark_noise_token_id": 31,
    }
    write_config(tmp_path, cfg)
    with pytest.raises(FormatError, match="DeepSeek-V4 bundled DSpark draft .*dspark_block_size=5.*MoE"):
        load_spec(tmp_path)
    assert main(["inspect", str(tmp_path)]) == 2
    assert "hyper-connections" in capsys.readouterr().err


def test_sliding_layers(tmp_path):
    from tests.formats_fixtures import tiny_speculators

    cfg = tiny_speculators(sliding_window_non_causal=False)
    cfg["transformer_layer_config"].update(
        layer_types=["sliding_attention", "full_attention"], sliding_window=32, use_sliding_window=True
    )
    spec = load_spec(write_config(tmp_path / "s", cfg))
    assert [(a.sliding_window, a.causal) for a in spec.layer_attention] == [(32, True), (None, False)]
    cfg["sliding_window_non_causal"] = True
    spec = load_spec(write_config(tmp_path / "n", cfg))
    assert spec.layer_attention[0].causal is False
    ds = tiny_deepspec(layer_types=["sliding_attention", "full_attention"], sliding_window=16, use_sliding_window=True)
    spec = load_spec(write_config(tmp_path / "d", ds))
    assert [(a.sliding_window, a.causal) for a in spec.layer_attention] == [(16, False), (None, False)]


def test_implicit_layer_types_follow_transformers(tmp_path):
    cfg = tiny_deepspec(use_sliding_window=True, sliding_window=16, max_window_layers=1)
    del cfg["layer_types"]
    spec = load_spec(write_config(tmp_path, cfg))
    assert [a.sliding_window for a in spec.layer_attention] == [None, 16]
