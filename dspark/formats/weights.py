"""Tensor metadata and checks: what model.safetensors holds, under the normalized names of
docs/DESIGN.md §4, checked against a DraftSpec.

Shapes come from the safetensors header (no tensor is materialized); values are read one
tensor at a time for the NaN/inf check so a multi-GB head never sits in memory twice.

torch and safetensors are imported by the functions that read tensor data, on purpose: the
config and header checks (`dspark inspect` of a config, the format readers) run without them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from dspark.errors import FormatError
from dspark.formats.spec import DraftSpec, backbone_of

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Target-owned copies a training run may save next to the draft (speculators excludes them
# on save, a plain state_dict dump does not): never part of the draft, dropped on read.
IGNORED = {"verifier_lm_head.weight", "verifier_norm.weight", "rotary_emb.inv_freq"}

# SpecForge's early DSpark checkpoints nested the heads under a `logit_head` container.
_RENAMES = (("logit_head.markov_head.", "markov_head."), ("logit_head.confidence_head.", "confidence_head."))

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def normalize_tensor_name(raw: str) -> str:
    name = raw[len("model.") :] if raw.startswith("model.") else raw
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str  # safetensors' name (F32, BF16, ...) from files, torch's for in-memory tensors
    file: Path | None  # None for in-memory tensors
    raw_name: str


class WeightsMeta:
    """Normalized name -> TensorInfo for one checkpoint (or an in-memory tensor dict)."""

    def __init__(self, infos: dict[str, TensorInfo], origin: str):
        self.infos = infos
        self.origin = origin

    def has(self, name: str) -> bool:
        return name in self.infos

    def shape(self, name: str) -> tuple[int, ...] | None:
        info = self.infos.get(name)
        return info.shape if info else None

    def names(self) -> list[str]:
        return sorted(self.infos)

    @classmethod
    def from_dir(cls, directory: Path) -> WeightsMeta | None:
        files = _weight_files(directory)
        if not files:
            return None
        infos: dict[str, TensorInfo] = {}
        for file in files:
            for raw, (shape, dtype) in _read_header(file).items():
                _add(infos, raw, TensorInfo(shape, dtype, file, raw), file.name)
        return cls(infos, str(directory))

    @classmethod
    def from_tensors(cls, tensors: dict) -> WeightsMeta:
        infos: dict[str, TensorInfo] = {}
        for raw, t in tensors.items():
            _add(infos, raw, TensorInfo(tuple(t.shape), str(t.dtype), None, raw), "tensors")
        return cls(infos, "tensors")


def _add(infos: dict[str, TensorInfo], raw: str, info: TensorInfo, where: str) -> None:
    name = normalize_tensor_name(raw)
    if name in IGNORED:
        return
    if name in infos:
        first = infos[name]
        raise FormatError(
            f"tensor {name} is stored twice: as {first.raw_name!r} in {_where(first)} and as {raw!r} in {where}"
        )
    infos[name] = info


def _where(info: TensorInfo) -> str:
    return info.file.name if info.file is not None else "tensors"


def _weight_files(directory: Path) -> list[Path]:
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            files = sorted({directory / name for name in json.loads(index.read_text())["weight_map"].values()})
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise FormatError(f"{index}: malformed index ({type(exc).__name__}: {exc})") from None
        for file in files:
            if not file.is_file():
                raise FormatError(f"{index} names {file.name}, which does not exist")
        return files
    single = directory / SINGLE_FILE
    return [single] if single.is_file() else []


def _read_header(file: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    from safetensors import safe_open  # heavy: see the module docstring

    out = {}
    try:
        with safe_open(str(file), framework="pt") as f:
            for raw in f.keys():
                sl = f.get_slice(raw)
                out[raw] = (tuple(sl.get_shape()), sl.get_dtype())
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise FormatError(f"{file}: not a readable safetensors file ({exc})") from None
    return out


# ---------------------------------------------------------------- reading values


def iter_tensors(meta: WeightsMeta):
    """(normalized name, tensor) pairs, one file open at a time."""
    from safetensors import safe_open  # heavy: see the module docstring

    by_file: dict[Path, list[str]] = {}
    for name, info in meta.infos.items():
        if info.file is None:
            raise FormatError(f"tensor {name} of {meta.origin} is held in memory: there is no file to read it from")
        by_file.setdefault(info.file, []).append(name)
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for name in sorted(names):
                yield name, f.get_tensor(meta.infos[name].raw_name)


def check_finite(name: str, tensor) -> None:
    import torch  # heavy: see the module docstring

    if not tensor.is_floating_point():
        return
    if tensor.dtype not in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        tensor = tensor.float()  # torch has no isfinite for float8_e4m3fn (a NotImplementedError)
    if not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise FormatError(f"tensor {name} holds {bad} NaN/inf value(s)")


# Storage a draft's weights may have: what the layers compute in once cast. Anything else (integers,
# float8) is quantised storage without its scales: cast to float it loads and runs, on numbers that
# mean nothing. Names as safetensors writes them, and as torch does for in-memory tensors.
FLOAT_STORAGE = frozenset(
    {"F64", "F32", "F16", "BF16", "torch.float64", "torch.float32", "torch.float16", "torch.bfloat16"}
)
INT_STORAGE = frozenset(
    {
        "I64",
        "I32",
        "I16",
        "I8",
        "U8",
        "U16",
        "U32",
        "U64",
        "torch.int64",
        "torch.int32",
        "torch.int16",
        "torch.int8",
        "torch.uint8",
    }
)
BOOL_STORAGE = frozenset({"BOOL", "torch.bool"})


def check_dtypes(meta: WeightsMeta) -> None:
    """From the header alone: weights in a float storage, d2t integer offsets, t2d a bool mask."""
    for name in meta.names():
        dtype = meta.infos[name].dtype
        if name == "d2t":
            allowed, what = INT_STORAGE, "integer offsets"
        elif name == "t2d":
            allowed, what = BOOL_STORAGE, "a bool mask"
        else:
            allowed = FLOAT_STORAGE
            what = "F32, F16, BF16 or F64 (integers and float8 are quantised storage, without its scales)"
        if dtype not in allowed:
            raise FormatError(f"tensor {name} in {meta.origin} is stored as {dtype}: it must be {what}")


def check_vocab_maps(spec: DraftSpec, name: str, tensor) -> None:
    """d2t offsets must land inside the target vocabulary; t2d must select exactly the draft vocabulary."""
    import torch  # heavy: see the module docstring

    if name == "d2t":
        if tensor.is_floating_point() or tensor.dtype == torch.bool:
            raise FormatError(f"tensor d2t must hold integer offsets, got {tensor.dtype}")
        ids = torch.arange(tensor.shape[0], dtype=torch.long) + tensor.long()
        if tensor.numel() and (int(ids.min()) < 0 or int(ids.max()) >= spec.vocab_size):
            raise FormatError(f"tensor d2t maps draft ids outside the target vocabulary (vocab_size {spec.vocab_size})")
    elif name == "t2d":
        if tensor.dtype != torch.bool:
            raise FormatError(f"tensor t2d must be bool, got {tensor.dtype}")
        if int(tensor.sum()) != spec.draft_vocab_size:
            raise FormatError(
                f"tensor t2d selects {int(tensor.sum())} tokens, expected draft_vocab_size {spec.draft_vocab_size}"
            )


# ---------------------------------------------------------------- shapes against the spec


def expected_shapes(spec: DraftSpec) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """(required name -> shape, optional name -> shape) for a draft described by `spec`."""
    b = spec.backbone
    if b is None:
        raise FormatError("draft description has no backbone")
    H, V, Vd, r = b.hidden_size, spec.vocab_size, spec.draft_vocab_size, spec.markov_rank
    Ht = spec.target_hidden_size or H
    req: dict[str, tuple[int, ...]] = {
        "norm.weight": (H,),
        "hidden_norm.weight": (H,),
        "fc.weight": (H, len(spec.hidden_state_indices) * Ht),
    }
    opt = {"embed_tokens.weight": (V, H), "lm_head.weight": (Vd, H), "d2t": (Vd,), "t2d": (V,)}
    if Vd < V:
        # A reduced draft vocabulary can neither borrow the target's head nor map ids without d2t.
        req["lm_head.weight"] = opt.pop("lm_head.weight")
        req["d2t"] = opt.pop("d2t")
    if r > 0:
        req["markov_head.markov_w1.weight"] = (V, r)
        req["markov_head.markov_w2.weight"] = (Vd, r)
        if spec.markov_head_type == "gated":
            req["markov_head.gate_proj.weight"] = (r, H + r)
            req["markov_head.gate_proj.bias"] = (r,)
        elif spec.markov_head_type == "rnn":
            req["markov_head.joint_proj.weight"] = (3 * r, 2 * r + H)
            req["markov_head.joint_proj.bias"] = (3 * r,)
    if spec.confidence_head:
        req["confidence_head.proj.weight"] = (1, H + (r if spec.confidence_head_with_markov else 0))
        req["confidence_head.proj.bias"] = (1,)
    for i in range(b.num_layers):
        req.update(_layer_shapes(spec, i))
    return req, opt


def _why(spec: DraftSpec, name: str) -> str:
    """The config fields a tensor's expected shape comes from, for the error message."""
    H = spec.hidden_size
    if name == "fc.weight":
        return (
            f"[hidden_size, taps x target hidden] = [{H}, {len(spec.hidden_state_indices)} x "
            f"{spec.target_hidden_size or H}]"
        )
    if name == "markov_head.markov_w1.weight":
        return f"[vocab_size, markov_rank] = [{spec.vocab_size}, {spec.markov_rank}]"
    if name in ("markov_head.markov_w2.weight", "lm_head.weight", "d2t"):
        return f"rows = draft_vocab_size {spec.draft_vocab_size}"
    if name == "confidence_head.proj.weight":
        extra = f" + markov_rank {spec.markov_rank}" if spec.confidence_head_with_markov else ""
        return f"width = hidden_size {H}{extra} (confidence_head_with_markov={spec.confidence_head_with_markov})"
    return "from the backbone config"


def check_shapes(spec: DraftSpec, meta: WeightsMeta) -> None:
    req, opt = expected_shapes(spec)
    for name, shape in req.items():
        if not meta.has(name):
            raise FormatError(f"tensor {name} is missing from {meta.origin} (expected shape {list(shape)})")
    gemma_layers = backbone_of(spec).family == "gemma4"
    for name in meta.names():
        expected = req.get(name, opt.get(name))
        if expected is None:
            m = _LAYER.match(name)
            if gemma_layers and m and int(m.group(1)) < spec.num_layers:
                continue
            raise FormatError(f"unexpected tensor {name} in {meta.origin}: {_unexpected_reason(spec, name)}")
        got = meta.infos[name].shape
        if got != expected:
            raise FormatError(f"tensor {name} has shape {list(got)}, expected {list(expected)}: {_why(spec, name)}")


def _unexpected_reason(spec: DraftSpec, name: str) -> str:
    if name.startswith("markov_head."):
        return f"config says markov_rank={spec.markov_rank}, markov_head_type={spec.markov_head_type!r}"
    if name.startswith("confidence_head."):
        return f"config says the confidence head is {'on' if spec.confidence_head else 'off'}"
    if name.startswith("layers."):
        b = backbone_of(spec)
        return f"config says {spec.num_layers} draft layer(s) (qk_norm={b.qk_norm}, attention_bias={b.attention_bias})"
    return "not part of a DSpark draft"


def _layer_shapes(spec: DraftSpec, i: int) -> dict[str, tuple[int, ...]]:
    b = backbone_of(spec)
    H, F = b.hidden_size, b.intermediate_size  # F: the MLP width
    q, kv = b.num_attention_heads * b.head_dim, b.num_key_value_heads * b.head_dim
    p = f"layers.{i}."
    if b.family == "gemma4":
        # Gemma4 layers carry family-specific extras; only the query projection is pinned here.
        return {p + "self_attn.q_proj.weight": (q, H)}
    out = {
        p + "input_layernorm.weight": (H,),
        p + "post_attention_layernorm.weight": (H,),
        p + "self_attn.q_proj.weight": (q, H),
        p + "self_attn.k_proj.weight": (kv, H),
        p + "self_attn.v_proj.weight": (kv, H),
        p + "self_attn.o_proj.weight": (H, q),
        p + "mlp.gate_proj.weight": (F, H),
        p + "mlp.up_proj.weight": (F, H),
        p + "mlp.down_proj.weight": (H, F),
    }
    if b.qk_norm:
        out[p + "self_attn.q_norm.weight"] = (b.head_dim,)
        out[p + "self_attn.k_norm.weight"] = (b.head_dim,)
    if b.attention_bias:
        out[p + "self_attn.q_proj.bias"] = (q,)
        out[p + "self_attn.k_proj.bias"] = (kv,)
        out[p + "self_attn.v_proj.bias"] = (kv,)
        out[p + "self_attn.o_proj.bias"] = (H,)
    return out
