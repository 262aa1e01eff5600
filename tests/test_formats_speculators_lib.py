"""Files written by the real speculators library are read correctly, and files dspark writes
load back in it (docs/DESIGN.md §3: the flag true, false, and absent)."""

import json

import pytest
import torch
from dspark.formats.convert import convert
from dspark.formats.load import load_spec, load_weights

from tests.formats_fixtures import random_tensors, tiny_deepspec, write_checkpoint

speculators_dspark = pytest.importorskip("speculators.models.dspark")


def _speculators_model(*, sample_from_anchor: bool, draft_vocab: int, head_type: str, seed: int):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config

    torch.manual_seed(seed)
    layer = Qwen3Config(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        vocab_size=64,
        max_position_embeddings=128,
        rope_parameters={"rope_theta": 50000.0, "rope_type": "default"},
    )
    layer._attn_implementation = "sdpa"  # flex attention has no CPU path
    block = 5
    config = speculators_dspark.DSparkSpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=draft_vocab,
        block_size=block,
        aux_hidden_state_layer_ids=[1, 3, 5],
        mask_token_id=7,
        sample_from_anchor=sample_from_anchor,
        markov_rank=4,
        markov_head_type=head_type,
        speculators_config=SpeculatorsConfig(
            algorithm="dspark",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=block if sample_from_anchor else block - 1)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"]),
        ),
    )
    model = speculators_dspark.DSparkDraftModel(config)
    with torch.no_grad():
        # Verifier-owned weights start as NaN until a verifier is loaded; give them values.
        model.lm_head.weight.normal_()
        model.embed_tokens.weight.normal_()
        if draft_vocab < 64:
            t2d = torch.zeros(64, dtype=torch.bool)
            t2d[torch.randperm(64)[:draft_vocab]] = True
            d2t = t2d.nonzero().squeeze(1) - torch.arange(draft_vocab)
            model.load_vocab_mappings(t2d, d2t)
    return model


CASES = {
    # name: (sample_from_anchor saved, delete the key, draft vocab, markov head type)
    "flag_true": (True, False, 64, "vanilla"),
    "flag_false": (False, False, 32, "gated"),
    "flag_deleted": (False, True, 64, "rnn"),
    # Deleted from an anchor-first file: speculative_tokens == block_size still tells.
    "flag_true_deleted": (True, True, 64, "vanilla"),
}
EXPECTED = {
    "flag_true": ("anchor_first", "flag", 5, 5),
    "flag_false": ("bonus_anchor", "flag", 4, 5),
    "flag_deleted": ("bonus_anchor", "legacy_default", 4, 5),
    "flag_true_deleted": ("anchor_first", "speculative_tokens", 5, 5),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = {}
    for seed, (name, (flag, delete, vocab, head)) in enumerate(CASES.items()):
        model = _speculators_model(sample_from_anchor=flag, draft_vocab=vocab, head_type=head, seed=seed)
        directory = tmp_path_factory.mktemp(name)
        model.save_pretrained(str(directory))
        if delete:
            cfg = json.loads((directory / "config.json").read_text())
            del cfg["sample_from_anchor"]
            (directory / "config.json").write_text(json.dumps(cfg))
        out[name] = (directory, {k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_library_files_are_read_correctly(saved, name):
    directory, state = saved[name]
    spec = load_spec(directory)
    layout, source, gamma, slots = EXPECTED[name]
    assert (spec.format, spec.layout, spec.layout_source, spec.gamma, spec.query_slots) == (
        "speculators",
        layout,
        source,
        gamma,
        slots,
    )
    assert spec.hidden_state_indices == (1, 3, 5)
    assert spec.markov_head_type == CASES[name][3] and spec.markov_rank == 4
    assert spec.backbone.rope_theta == 50000.0 and spec.backbone.qk_norm
    assert spec.draft_vocab_size == CASES[name][2] and spec.has_d2t == (CASES[name][2] < 64)

    tensors = load_weights(spec)
    # Everything the library saved, bit for bit, minus the target-owned copies it keeps on save.
    on_disk = _saved_names(directory)
    assert set(tensors) == on_disk - {"verifier_lm_head.weight", "verifier_norm.weight"}
    for key, tensor in tensors.items():
        assert torch.equal(tensor, state[key]), key


def _saved_names(directory):
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def _assert_loads_in_speculators(directory, tensors, *, sample_from_anchor):
    model = speculators_dspark.DSparkDraftModel.from_pretrained(str(directory))
    assert model.config.sample_from_anchor is sample_from_anchor
    state = model.state_dict()
    for key, tensor in tensors.items():
        assert torch.equal(state[key], tensor), key
    return model


def test_deepspec_converted_to_speculators_loads_in_library(tmp_path):
    cfg = tiny_deepspec(layer_types=["full_attention", "sliding_attention"], sliding_window=16, use_sliding_window=True)
    src = write_checkpoint(tmp_path / "ds", cfg)
    out = convert(src, tmp_path / "sp", "speculators")
    assert (out.format, out.layout, out.layout_source, out.gamma) == ("speculators", "anchor_first", "flag", 4)
    # DeepSpec t -> speculators aux t + 1
    assert json.loads((tmp_path / "sp" / "config.json").read_text())["aux_hidden_state_layer_ids"] == [2, 4]
    model = _assert_loads_in_speculators(tmp_path / "sp", load_weights(src), sample_from_anchor=True)
    # DeepSpec's bidirectional sliding layer stays bidirectional, with its window.
    assert (model.sliding_window, model.sliding_window_indices, model.sliding_window_non_causal) == (16, [1], True)
    assert model.block_size == 4 and model.mask_token_id == 5


def test_legacy_file_rewritten_with_explicit_flag(saved, tmp_path):
    directory, _ = saved["flag_deleted"]
    out = convert(directory, tmp_path / "explicit", "speculators")
    cfg = json.loads((tmp_path / "explicit" / "config.json").read_text())
    assert cfg["sample_from_anchor"] is False
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert cfg["speculators_config"]["verifier"]["architectures"] == ["Qwen3ForCausalLM"]
    assert (out.layout, out.layout_source) == ("bonus_anchor", "flag")
    _assert_loads_in_speculators(tmp_path / "explicit", load_weights(directory), sample_from_anchor=False)


def test_reduced_vocab_file_keeps_maps(saved, tmp_path):
    directory, state = saved["flag_false"]
    out = convert(directory, tmp_path / "copy", "speculators")
    assert out.has_d2t and out.draft_vocab_size == 32
    _assert_loads_in_speculators(tmp_path / "copy", load_weights(directory), sample_from_anchor=False)


def test_random_tensors_match_library_shapes(saved):
    """The shapes dspark expects are exactly the ones the library builds."""
    directory, state = saved["flag_false"]
    expected = random_tensors(load_spec(directory), include=("lm_head.weight", "d2t", "t2d"))
    for key, tensor in expected.items():
        assert tuple(state[key].shape) == tuple(tensor.shape), key
