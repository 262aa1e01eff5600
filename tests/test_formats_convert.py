"""Conversion between families: bit-for-bit tensors, converted layer ids, clear refusals;
and load_weights' normalized names."""

import json

import pytest
import torch
from dspark.errors import FormatError
from dspark.formats.convert import convert, write_deepspec, write_speculators
from dspark.formats.load import load_spec, load_weights
from safetensors.torch import save_file

from tests.formats_fixtures import (
    random_tensors,
    tiny_deepspec,
    tiny_specforge,
    tiny_speculators,
    write_checkpoint,
    write_config,
)

# What must survive a conversion (warnings and layout_source legitimately change).
KEPT = (
    "layout",
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
)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def bf16_checkpoint(directory, config):
    write_config(directory, config)
    tensors = {
        k: (v.to(torch.bfloat16) if v.is_floating_point() else v)
        for k, v in random_tensors(load_spec(directory)).items()
    }
    tensors["norm.weight"][0] = -0.0  # a sign bit that value comparison would miss
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def kept(spec) -> dict:
    j = spec.to_json()
    return {k: j[k] for k in KEPT}


def test_deepspec_speculators_round_trip_is_bit_exact(tmp_path):
    cfg = tiny_deepspec(
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=16,
        use_sliding_window=True,
        rope_scaling={"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64},
    )
    src = bf16_checkpoint(tmp_path / "ds", cfg)
    mid = convert(src, tmp_path / "sp", "speculators")
    back = convert(tmp_path / "sp", tmp_path / "ds2", "deepspec")
    original = load_spec(src)
    assert kept(mid) == kept(original) == kept(back)
    assert mid.layer_attention[0].causal is False  # written as sliding_window_non_causal: true
    assert json.loads((tmp_path / "ds2" / "config.json").read_text())["target_layer_ids"] == [1, 3]
    a, b = load_weights(src), load_weights(tmp_path / "ds2")
    assert a.keys() == b.keys() == load_weights(tmp_path / "sp").keys()
    for key in a:
        assert same_bits(a[key], b[key]), key
    assert back.backbone == original.backbone
    assert original.backbone.rope_scaling == {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": 64,
    }


def test_speculators_round_trip_keeps_bonus_anchor_and_maps(tmp_path):
    cfg = tiny_speculators(flag=None, tokens=3, draft_vocab_size=32, markov_head_type="rnn")
    write_config(tmp_path / "sp", cfg)
    tensors = random_tensors(load_spec(tmp_path / "sp"), include=("lm_head.weight", "d2t", "t2d"))
    tensors["t2d"][:32] = True
    save_file(tensors, str(tmp_path / "sp" / "model.safetensors"))
    original = load_spec(tmp_path / "sp")
    assert (original.layout, original.layout_source) == ("bonus_anchor", "legacy_default")
    out = convert(tmp_path / "sp", tmp_path / "sp2", "speculators")
    assert (out.layout, out.layout_source) == ("bonus_anchor", "flag")
    assert kept(out) == kept(original)
    b = load_weights(out)
    for key, tensor in tensors.items():
        assert same_bits(tensor, b[key]), key


def test_specforge_to_speculators(tmp_path):
    src = write_checkpoint(tmp_path / "sf", tiny_specforge())
    out = convert(src, tmp_path / "sp", "speculators")
    assert (out.layout, out.gamma, out.block_size, out.hidden_state_indices) == ("bonus_anchor", 3, 4, (2, 4))
    with pytest.raises(FormatError, match="bonus_anchor draft cannot be written in DeepSpec format"):
        convert(src, tmp_path / "ds", "deepspec")


def test_forced_layout_conversion_is_reported(tmp_path):
    src = write_checkpoint(tmp_path / "sp", tiny_speculators(flag=False))
    out = convert(src, tmp_path / "ds", "deepspec", layout="anchor_first")
    assert (out.format, out.layout, out.gamma) == ("deepspec", "anchor_first", 4)


@pytest.mark.parametrize(
    "config, to, message",
    [
        (tiny_speculators(flag=True, draft_vocab_size=32), "deepspec", "reduced draft vocabulary"),
        (tiny_speculators(flag=True, target_hidden_size=24), "deepspec", "target_hidden_size 24 != hidden_size 16"),
        (tiny_deepspec(architectures=["Gemma4DSparkModel"]), "speculators", "layers are gemma4"),
    ],
)
def test_refusals(tmp_path, config, to, message):
    src = write_checkpoint(tmp_path / "src", config)
    with pytest.raises(FormatError, match=message):
        convert(src, tmp_path / "dst", to)


def test_causal_sliding_layers_cannot_become_deepspec(tmp_path):
    cfg = tiny_speculators(flag=True)
    cfg["transformer_layer_config"].update(
        layer_types=["sliding_attention", "full_attention"], sliding_window=8, use_sliding_window=True
    )
    src = write_checkpoint(tmp_path / "src", cfg)
    with pytest.raises(FormatError, match="causal draft layers"):
        convert(src, tmp_path / "dst", "deepspec")


def test_llama_layers_without_qk_norm(tmp_path):
    cfg = tiny_speculators(flag=True)
    cfg["transformer_layer_config"]["model_type"] = "llama"
    write_config(tmp_path / "src", cfg)
    tensors = {
        k: v
        for k, v in random_tensors(load_spec(tmp_path / "src")).items()
        if not k.endswith(("q_norm.weight", "k_norm.weight"))
    }
    save_file(tensors, str(tmp_path / "src" / "model.safetensors"))
    spec = load_spec(tmp_path / "src")
    assert (spec.backbone.family, spec.backbone.qk_norm) == ("llama", False)
    with pytest.raises(FormatError, match=r"layers are llama \(qk_norm=False\)"):
        convert(tmp_path / "src", tmp_path / "dst", "speculators")


def test_writers_take_only_normalized_names(tmp_path):
    spec = load_spec(write_checkpoint(tmp_path / "ds", tiny_deepspec()))
    tensors = load_weights(spec)
    tensors["model.norm.weight"] = tensors.pop("norm.weight")
    with pytest.raises(FormatError, match="normalized names"):
        write_speculators(spec, tensors, tmp_path / "out")
    tensors["norm.weight"] = tensors.pop("model.norm.weight")
    tensors["fc.weight"] = tensors["fc.weight"][:, :8]
    with pytest.raises(FormatError, match="tensor fc.weight has shape"):
        write_deepspec(spec, tensors, tmp_path / "out")


# ---------------------------------------------------------------- load_weights


def test_load_weights_strips_prefix_and_drops_verifier_copies(tmp_path):
    write_config(tmp_path, tiny_deepspec())
    tensors = random_tensors(load_spec(tmp_path))
    stored = {f"model.{k}": v for k, v in tensors.items()}
    stored["verifier_lm_head.weight"] = torch.zeros(64, 16)
    save_file(stored, str(tmp_path / "model.safetensors"))
    out = load_weights(tmp_path)
    assert out.keys() == tensors.keys()
    assert all(same_bits(out[k], tensors[k]) for k in tensors)


def test_name_stored_twice_is_refused(tmp_path):
    write_config(tmp_path, tiny_deepspec())
    tensors = random_tensors(load_spec(tmp_path))
    tensors["model.norm.weight"] = tensors["norm.weight"].clone()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(FormatError, match="tensor norm.weight is stored twice"):
        load_spec(tmp_path)


def test_sharded_checkpoint(tmp_path):
    write_config(tmp_path, tiny_deepspec())
    tensors = random_tensors(load_spec(tmp_path))
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"a.safetensors": names[:half], "b.safetensors": names[half:]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / file))
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    out = load_weights(tmp_path)
    assert all(same_bits(out[k], tensors[k]) for k in tensors)


def test_load_weights_refuses_nan(tmp_path):
    write_config(tmp_path, tiny_deepspec())
    tensors = random_tensors(load_spec(tmp_path))
    tensors["fc.weight"][0, 0] = float("nan")
    save_file(tensors, str(tmp_path / "model.safetensors"))
    spec = load_spec(tmp_path, check_values=False)
    with pytest.raises(FormatError, match="tensor fc.weight holds 1 NaN/inf"):
        load_weights(spec)


def test_qk_norm_follows_weights(tmp_path):
    spec = load_spec(write_checkpoint(tmp_path, tiny_deepspec()))
    assert spec.backbone.qk_norm and spec.path == str(tmp_path)
    assert not any("weights not checked" in w for w in spec.warnings)
