"""Write a DraftSpec plus normalized tensors as a speculators or DeepSpec checkpoint.

Tensor names are the same in both families, so conversion rewrites config.json and copies
every tensor byte for byte; what changes is how the layout and the tap layers are spelled.
"""

from __future__ import annotations

import json
import os
import stat
from collections import Counter
from pathlib import Path

from safetensors.torch import save_file

from dspark.errors import FormatError
from dspark.formats.load import load_spec, load_weights, locate, read_config
from dspark.formats.spec import DraftSpec, backbone_of
from dspark.formats.weights import WeightsMeta, check_dtypes, check_finite, check_shapes, check_vocab_maps

TARGETS = ("speculators", "deepspec")
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose DSpark config this writer emits
DEEPSPEC_NUM_ANCHORS = 512  # DeepSpec's training default; its model requires the key


def convert(src, dst, to: str, *, layout: str | None = None, verifier=None) -> DraftSpec:
    """Rewrite the draft at `src` into `dst` (a new or empty directory) in family `to`.

    Returns the description of the written checkpoint, read back from disk.
    """
    if to not in TARGETS:
        raise FormatError(f"--to must be one of {', '.join(TARGETS)}, got {to!r}")
    dst = Path(dst)
    src_dir, src_config = locate(src)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise FormatError(f"{dst} exists and is not an empty directory: refusing to overwrite")
    spec = load_spec(src, layout, check_values=False)
    tensors = load_weights(spec)
    if to == "speculators":
        if verifier is None:
            verifier = file_verifier(spec, src_config)
        write_speculators(spec, tensors, dst, verifier=verifier)
    else:
        write_deepspec(spec, tensors, dst)
    return load_spec(dst, check_values=False)


def file_verifier(spec: DraftSpec, config_path: Path) -> dict | None:
    """A speculators file's own verifier record (its architectures too, which DraftSpec does not
    carry), to write again with the draft; None for another family."""
    if spec.format != "speculators":
        return None
    return (read_config(config_path).get("speculators_config") or {}).get("verifier")


# ---------------------------------------------------------------- speculators


def write_speculators(spec: DraftSpec, tensors: dict, dst, verifier=None) -> None:
    """config.json + model.safetensors that the speculators library (0.9) loads as DSparkDraftModel.

    `verifier`: a name/path, a {name_or_path, architectures} dict, or None (spec.verifier).
    """
    b = _qwen3_backbone(spec, "speculators")
    layer_types, window, non_causal = _speculators_attention(spec)
    if any(i < 0 for i in spec.hidden_state_indices):
        raise FormatError(f"hidden_state_indices {list(spec.hidden_state_indices)} must be >= 0")
    _check_tensors(spec, tensors)
    config = {
        "architectures": ["DSparkDraftModel"],
        "speculators_model_type": "dspark",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "dspark",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": spec.gamma,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "verifier": _verifier_dict(spec, verifier),
        },
        "transformer_layer_config": {
            # speculators picks the layer config class from model_type; its layers are Qwen3's.
            "model_type": "qwen3",
            **_backbone_keys(spec),
            "layer_types": layer_types,
            "sliding_window": window,
            "use_sliding_window": window is not None,
        },
        "draft_vocab_size": spec.draft_vocab_size,
        "block_size": spec.query_slots,
        "target_hidden_size": spec.target_hidden_size or b.hidden_size,
        "aux_hidden_state_layer_ids": list(spec.hidden_state_indices),
        "mask_token_id": spec.mask_token_id,
        "sliding_window_non_causal": non_causal,
        # Always explicit: an absent flag is read as anchor-first by some engines, bonus-anchor by others.
        "sample_from_anchor": spec.layout == "anchor_first",
        **_head_keys(spec, explicit=True),
        "tie_word_embeddings": False,
        "dtype": _dtype_name(tensors),
    }
    _write(dst, config, tensors)


def _speculators_attention(spec: DraftSpec) -> tuple[list[str], int | None, bool]:
    sliding = [a for a in spec.layer_attention if a.sliding_window is not None]
    for i, a in enumerate(spec.layer_attention):
        if a.sliding_window is None and a.causal:
            raise FormatError(
                f"layer {i} is causal full attention: speculators full-attention layers are bidirectional"
            )
    if len({(a.sliding_window, a.causal) for a in sliding}) > 1:
        raise FormatError("speculators stores one sliding_window and one causality for all sliding layers")
    types = ["sliding_attention" if a.sliding_window is not None else "full_attention" for a in spec.layer_attention]
    window = sliding[0].sliding_window if sliding else None
    return types, window, bool(sliding) and not sliding[0].causal


def _verifier_dict(spec: DraftSpec, verifier) -> dict:
    if isinstance(verifier, dict):
        name = verifier.get("name_or_path")
        archs = verifier.get("architectures") or []
    else:
        name, archs = (verifier if verifier is not None else spec.verifier), []
    if name is not None and not isinstance(name, str):
        raise FormatError(f"verifier name_or_path must be a string, got {name!r}")
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise FormatError(f"verifier architectures must be a list of strings, got {archs!r}")
    return {"name_or_path": name, "architectures": archs}


# ---------------------------------------------------------------- DeepSpec


def write_deepspec(spec: DraftSpec, tensors: dict, dst) -> None:
    """config.json + model.safetensors in DeepSpec's Qwen3DSparkModel layout (anchor-first only)."""
    if spec.layout != "anchor_first":
        raise FormatError(
            f"a {spec.layout} draft cannot be written in DeepSpec format: DeepSpec drafts are anchor-first "
            "(row k predicts anchor+k+1) and have no unused row 0; keep it in speculators format"
        )
    b = _qwen3_backbone(spec, "DeepSpec")
    if any(a.causal for a in spec.layer_attention):
        raise FormatError("causal draft layers cannot be written in DeepSpec format (its attention is bidirectional)")
    if (spec.target_hidden_size or b.hidden_size) != b.hidden_size:
        raise FormatError(
            f"target_hidden_size {spec.target_hidden_size} != hidden_size {b.hidden_size}: DeepSpec's fc "
            "assumes the draft is as wide as the target"
        )
    if spec.draft_vocab_size != spec.vocab_size or "d2t" in tensors or "t2d" in tensors:
        raise FormatError("a reduced draft vocabulary (d2t/t2d) cannot be written in DeepSpec format")
    _check_tensors(spec, tensors)
    windows = {a.sliding_window for a in spec.layer_attention if a.sliding_window is not None}
    if len(windows) > 1:
        raise FormatError(f"DeepSpec stores one sliding_window for all layers, got {sorted(windows)}")
    config = {
        "architectures": ["Qwen3DSparkModel"],
        "model_type": "qwen3",
        **_backbone_keys(spec),
        "rope_theta": b.rope_theta,  # transformers 4 reads this key; 5 reads rope_parameters
        "tie_word_embeddings": False,
        "block_size": spec.gamma,
        "mask_token_id": spec.mask_token_id,
        "target_layer_ids": [i - 1 for i in spec.hidden_state_indices],
        "num_anchors": DEEPSPEC_NUM_ANCHORS,
        "layer_types": [
            "sliding_attention" if a.sliding_window is not None else "full_attention" for a in spec.layer_attention
        ],
        "sliding_window": next(iter(windows), None),
        "use_sliding_window": bool(windows),
        **_head_keys(spec, explicit=False),
        "dtype": _dtype_name(tensors),
    }
    _write(dst, config, tensors)


# ---------------------------------------------------------------- shared


def _qwen3_backbone(spec: DraftSpec, family_name: str):
    b = spec.backbone
    if b is None:
        raise FormatError("the draft description has no backbone: cannot write a config")
    if b.family != "qwen3" or not b.qk_norm:
        raise FormatError(
            f"{family_name} format stores Qwen3 draft layers (with q/k norm); this draft's layers are "
            f"{b.family} (qk_norm={b.qk_norm})"
        )
    return b


def _backbone_keys(spec: DraftSpec) -> dict:
    b = backbone_of(spec)
    rope = {"rope_type": "default", **(b.rope_scaling or {}), "rope_theta": b.rope_theta}
    return {
        "hidden_size": b.hidden_size,
        "intermediate_size": b.intermediate_size,
        "num_hidden_layers": b.num_layers,
        "num_attention_heads": b.num_attention_heads,
        "num_key_value_heads": b.num_key_value_heads,
        "head_dim": b.head_dim,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": b.max_position_embeddings,
        "rms_norm_eps": b.rms_norm_eps,
        "hidden_act": b.hidden_act,
        "attention_bias": b.attention_bias,
        "rope_parameters": rope,
        "tie_word_embeddings": False,
    }


def _head_keys(spec: DraftSpec, *, explicit: bool) -> dict:
    """Head settings; DeepSpec omits the keys it does not use, speculators writes them all."""
    keys: dict[str, int | str] = {"markov_rank": spec.markov_rank, "enable_confidence_head": spec.confidence_head}
    if explicit or spec.markov_rank > 0:
        keys["markov_head_type"] = spec.markov_head_type
    if explicit or spec.confidence_head:
        keys["confidence_head_with_markov"] = spec.confidence_head_with_markov
    return keys


def _check_tensors(spec: DraftSpec, tensors: dict) -> None:
    meta = WeightsMeta.from_tensors(tensors)
    if set(meta.infos) != set(tensors):
        odd = sorted(set(tensors) - set(meta.infos))
        raise FormatError(f"tensors must use normalized names (no model. prefix, no verifier copies): {odd}")
    check_shapes(spec, meta)
    check_dtypes(meta)
    for name, tensor in tensors.items():
        check_finite(name, tensor)
        check_vocab_maps(spec, name, tensor)


def _dtype_name(tensors: dict) -> str:
    counts = Counter(str(t.dtype).removeprefix("torch.") for t in tensors.values() if t.is_floating_point())
    return counts.most_common(1)[0][0] if counts else "float32"


def _write(dst, config: dict, tensors: dict) -> None:
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    weights, config_file = dst / "model.safetensors", dst / "config.json"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(weights), metadata={"format": "pt"})
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    # safetensors writes through a private temporary file (mode 0600): give the weights the mode the
    # config got (0644 less the umask), or another user who can read the config cannot load the draft
    os.chmod(weights, stat.S_IMODE(config_file.stat().st_mode))
