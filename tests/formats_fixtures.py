"""Config builders and tiny checkpoints for the format tests.

Golden configs carry the values of real published heads (docs/DESIGN.md §3-§4); the tiny
ones are small enough that a checkpoint with weights costs milliseconds.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

# Qwen3-4B target config as DeepSpec copies it into the draft (published DeepSpec head:
# dspark_qwen3_4b: block 7, 5 draft layers, taps [1, 9, 17, 25, 33], mask 151669).
QWEN3_4B_DEEPSPEC = {
    "architectures": ["Qwen3DSparkModel"],
    "model_type": "qwen3",
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 5,
    "num_target_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
    "block_size": 7,
    "mask_token_id": 151669,
    "target_layer_ids": [1, 9, 17, 25, 33],
    "num_anchors": 512,
    "layer_types": ["full_attention"] * 5,
    "enable_confidence_head": True,
    "confidence_head_with_markov": True,
    "markov_rank": 256,
    "markov_head_type": "vanilla",
}
QWEN3_8B_DEEPSPEC = {**QWEN3_4B_DEEPSPEC, "hidden_size": 4096, "intermediate_size": 12288}

# RedHatAI/GLM-5.2-speculator.dspark: written before sample_from_anchor existed.
GLM52_SPECULATORS = {
    "architectures": ["DSparkDraftModel"],
    "speculators_model_type": "dspark",
    "speculators_version": "0.8.0",
    "block_size": 8,
    "draft_vocab_size": 154880,
    "aux_hidden_state_layer_ids": [8, 23, 39, 55, 70],
    "mask_token_id": 154856,
    "target_hidden_size": None,
    "sliding_window_non_causal": False,
    "markov_rank": 256,
    "markov_head_type": "vanilla",
    "enable_confidence_head": True,
    "confidence_head_with_markov": True,
    "speculators_config": {
        "algorithm": "dspark",
        "default_proposal_method": "greedy",
        "proposal_methods": [
            {"proposal_type": "greedy", "speculative_tokens": 7, "verifier_accept_k": 1, "accept_tolerance": 0.0}
        ],
        "verifier": {"name_or_path": "zai-org/GLM-5.2", "architectures": ["GlmMoeDsaForCausalLM"]},
    },
    "transformer_layer_config": {
        "model_type": "qwen3",
        "hidden_size": 6144,
        "intermediate_size": 12288,
        "num_hidden_layers": 1,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 154880,
        "max_position_embeddings": 202752,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "hidden_act": "silu",
        "layer_types": ["full_attention"],
    },
}

# A head written by speculators 0.9 with the flag: anchor-first, block_size == speculative_tokens.
FLAGGED_ANCHOR_FIRST = copy.deepcopy(GLM52_SPECULATORS)
FLAGGED_ANCHOR_FIRST.update(block_size=7, sample_from_anchor=True, speculators_version="0.9.0")
FLAGGED_ANCHOR_FIRST["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 7


# ---------------------------------------------------------------- tiny configs

TINY_BACKBONE = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 8,
    "vocab_size": 64,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-06,
    "hidden_act": "silu",
    "attention_bias": False,
}


def tiny_deepspec(**overrides) -> dict:
    cfg = {
        "architectures": ["Qwen3DSparkModel"],
        "model_type": "qwen3",
        **TINY_BACKBONE,
        "rope_theta": 10000.0,
        "num_target_layers": 6,
        "tie_word_embeddings": False,
        "block_size": 4,
        "mask_token_id": 5,
        "target_layer_ids": [1, 3],
        "num_anchors": 8,
        "layer_types": ["full_attention", "full_attention"],
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "markov_rank": 4,
        "markov_head_type": "vanilla",
    }
    cfg.update(overrides)
    return cfg


def tiny_speculators(*, flag=True, block_size=4, tokens=None, **overrides) -> dict:
    """flag: True / False / None (key absent). tokens: speculative_tokens (None: from the flag)."""
    if tokens is None:
        tokens = block_size if flag in (True, None) else block_size - 1
    cfg = {
        "architectures": ["DSparkDraftModel"],
        "speculators_model_type": "dspark",
        "speculators_version": "0.9.0",
        "block_size": block_size,
        "draft_vocab_size": 64,
        "aux_hidden_state_layer_ids": [2, 4],
        "mask_token_id": 5,
        "target_hidden_size": None,
        "sliding_window_non_causal": False,
        "markov_rank": 4,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "speculators_config": {
            "algorithm": "dspark",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens}],
            "verifier": {"name_or_path": None, "architectures": []},
        },
        "transformer_layer_config": {
            "model_type": "qwen3",
            **TINY_BACKBONE,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
            "layer_types": ["full_attention", "full_attention"],
        },
    }
    if flag is not None:
        cfg["sample_from_anchor"] = flag
    cfg.update(overrides)
    return cfg


def tiny_specforge(**overrides) -> dict:
    cfg = {
        "architectures": ["DSparkDraftModel"],
        "model_type": "dspark",
        **TINY_BACKBONE,
        "rope_theta": 10000.0,
        "block_size": 4,
        "num_target_layers": 6,
        "layer_types": ["full_attention", "full_attention"],
        "dflash_config": {"projector_type": "dspark", "target_layer_ids": [1, 3], "mask_token_id": 5},
        "markov_rank": 4,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": False,
    }
    cfg.update(overrides)
    return cfg


# ---------------------------------------------------------------- files


def write_config(directory: Path, config: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def random_tensors(spec, *, seed: int = 0, include=("embed_tokens.weight", "lm_head.weight")) -> dict:
    """Random tensors with every shape the spec requires (plus the optional names in `include`)."""
    import torch
    from dspark.formats.weights import expected_shapes

    required, optional = expected_shapes(spec)
    shapes = {**required, **{k: v for k, v in optional.items() if k in include}}
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(shapes.items()):
        if name == "d2t":
            out[name] = torch.zeros(shape, dtype=torch.int64)
        elif name == "t2d":
            out[name] = torch.zeros(shape, dtype=torch.bool)
        else:
            out[name] = torch.randn(shape, generator=g, dtype=torch.float32)
    return out


def write_checkpoint(directory: Path, config: dict, tensors: dict | None = None, **tensor_kw) -> Path:
    """config.json + model.safetensors whose tensors fit `config` (read back through load_spec)."""
    from dspark.formats.load import load_spec
    from safetensors.torch import save_file

    write_config(directory, config)
    if tensors is None:
        tensors = random_tensors(load_spec(directory), **tensor_kw)
    save_file(tensors, str(directory / "model.safetensors"))
    return directory
