"""Issue 36, item 4: fuzzed checkpoint files. Mutated and truncated config.json, truncated or
lying safetensors headers (offsets past the end, wrong dtypes, shapes), NaN/inf weights, and
targets the draft does not fit: every case ends in a DSparkError whose message says what is
wrong, or in a draft that loads and decodes. Never another exception.

Each example is a real directory: a tiny checkpoint of one family (tests/formats_fixtures.py),
edited, then read the way a user's command reads it: `load_spec` (what `dspark inspect` does,
values checked) and `load_draft` against a tiny target (what every decoding command does), and
a draft that loads decodes a few tokens, greedy and sampled. The default suite runs a small
budget per property; the slow suite runs 2 000 examples per reader (`-m slow`).

The examples fuzzing found are kept below as explicit regression tests (`test_found_*`).
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from dspark.engine.sampling import SamplingParams
from dspark.errors import DSparkError, RequestError
from dspark.formats import common
from dspark.formats.load import load_spec
from dspark.model.load import load_draft
from hypothesis import HealthCheck, currently_in_test_context, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from tests.formats_fixtures import tiny_deepspec, tiny_specforge, tiny_speculators, write_checkpoint
from tests.fuzzing import budgets, holds
from tests.tiny import engine_for

FAST = settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
BUDGETS = budgets(FAST)
FAMILIES = {"deepspec": tiny_deepspec, "speculators": tiny_speculators, "specforge": tiny_specforge}


# ---- the files and the target --------------------------------------------------------------------
def tiny_llama(vocab: int = 64, hidden: int = 16, layers: int = 6, seed: int = 0):
    """A target every tiny draft of formats_fixtures fits (vocab 64, hidden 16, taps up to layer 4)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=hidden // 2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return LlamaForCausalLM(cfg).eval()


TARGET = tiny_llama()
_BASES: dict[str, Path] = {}


def base(family: str) -> Path:
    """One valid checkpoint per family, written once per test process."""
    if family not in _BASES:
        root = Path(tempfile.mkdtemp(prefix=f"fuzz-{family}-"))
        _BASES[family] = write_checkpoint(root / family, FAMILIES[family]())
    return _BASES[family]


def copy_of(family: str, into: Path) -> Path:
    d = into / family
    shutil.copytree(base(family), d)
    return d


def outcome(path: Path, target=TARGET) -> str:
    """'loaded' (and decoded), or the DSparkError's message. Any other exception fails the test."""
    try:
        load_spec(path)
        draft = load_draft(str(path), target)
    except DSparkError as exc:
        message = str(exc)
        assert message.strip(), f"a {type(exc).__name__} without a message"
        if currently_in_test_context():  # --hypothesis-show-statistics: how often each end was reached
            event("refused")
        return message
    engine = engine_for(target, draft)
    for params in (SamplingParams(max_new_tokens=5), SamplingParams(max_new_tokens=5, temperature=1.0, seed=3)):
        try:
            out = engine.generate([5, 6, 7, 8], params)
        except RequestError as exc:  # a block too long for the target's context: refused, saying so
            assert "one draft block" in str(exc), exc
            return str(exc)
        assert 1 <= len(out.output_ids) <= 5 and all(0 <= t < target.config.vocab_size for t in out.output_ids)
    if currently_in_test_context():
        event("loaded and decoded")
    return "loaded"


def test_every_base_checkpoint_loads_and_decodes():
    for family in FAMILIES:
        assert outcome(base(family)) == "loaded", family


# ---- config.json -----------------------------------------------------------------------------------
# Values a config key could be given by mistake: JSON of every type (NaN and Infinity included,
# which Python's json reads), and the strings and objects that mean something somewhere in a config.
PLAUSIBLE = st.sampled_from(
    [
        "full_attention",
        "sliding_attention",
        "yarn",
        "linear",
        "dynamic",
        "llama3",
        "longrope",
        "default",
        "proportional",
        "gated",
        "rnn",
        "vanilla",
        "llama",
        "qwen3",
        "gelu",
        "relu2",
        "nope",
        "dspark",
        "greedy",
        {"rope_type": "yarn"},
        {"rope_type": "yarn", "factor": "2"},
        {"rope_type": "linear", "factor": 0.5},
        {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]},
        {"type": "dynamic", "factor": 2},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
        {"full_attention": {"rope_theta": 10000.0}},
        {"projector_type": "dspark"},
        ["full_attention"],
        [{"proposal_type": "greedy", "speculative_tokens": 3}],
        [1, 3],
        [-1, 0],
        [3, 1],
    ]
)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 70), st.integers(), st.floats(), st.text(max_size=8))
# copied: a later edit may write into a drawn object, and sampled_from hands out the same one each time
JSON_VALUES = st.one_of(
    PLAUSIBLE,
    st.recursive(
        SCALARS,
        lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
        max_leaves=8,
    ),
).map(copy.deepcopy)
# Keys a reader looks up that the tiny configs do not all carry
OPTIONAL_KEYS = (
    "rope_scaling",
    "rope_parameters",
    "rope_theta",
    "head_dim",
    "layer_types",
    "use_sliding_window",
    "sliding_window",
    "max_window_layers",
    "draft_vocab_size",
    "target_hidden_size",
    "num_target_layers",
    "hidden_activation",
    "attention_bias",
    "model_type",
    "sample_from_anchor",
    "speculators_config",
    "dflash_config",
    "architectures",
    "speculators_model_type",
    "dspark_block_size",
    "rms_norm_eps",
)


def key_paths(obj, prefix=()):
    """Every key / index path of a JSON value, depth first."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield prefix + (k,)
        yield from key_paths(v, prefix + (k,))


def edit(cfg, path, value) -> None:
    """Set (or, for value is DELETE, remove) the entry at `path`."""
    node = cfg
    for k in path[:-1]:
        node = node[k]
    if value is DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value


DELETE = object()


@st.composite
def mutated_configs(draw, family: str):
    cfg = copy.deepcopy(FAMILIES[family]())
    for _ in range(draw(st.integers(1, 3))):
        paths = list(key_paths(cfg))
        op = draw(st.sampled_from(["set", "set", "delete", "add"]))
        if op == "add" or not paths:
            containers = [()] + [p for p in paths if isinstance(_at(cfg, p), dict)]
            path = draw(st.sampled_from(containers)) + (draw(st.sampled_from(OPTIONAL_KEYS)),)
            edit(cfg, path, draw(JSON_VALUES))
        else:
            path = draw(st.sampled_from(paths))
            edit(cfg, path, DELETE if op == "delete" else draw(JSON_VALUES))
    return cfg


def _at(cfg, path):
    for k in path:
        cfg = cfg[k]
    return cfg


def check_config(family: str, cfg) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        d = copy_of(family, Path(tmp))
        (d / "config.json").write_text(json.dumps(cfg))
        outcome(d)


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("family", FAMILIES)
def test_mutated_config(family, budget):
    holds(budget, mutated_configs(family), lambda example: check_config(family, example))


@st.composite
def broken_config_text(draw, family: str):
    """config.json cut short, or with bytes overwritten (not UTF-8, not JSON, or JSON of another meaning)."""
    raw = json.dumps(FAMILIES[family]()).encode()
    if draw(st.booleans()):
        return raw[: draw(st.integers(0, len(raw) - 1))]
    out = bytearray(raw)
    for _ in range(draw(st.integers(1, 4))):
        out[draw(st.integers(0, len(out) - 1))] = draw(st.integers(0, 255))
    return bytes(out)


def check_config_bytes(family: str, raw: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        d = copy_of(family, Path(tmp))
        (d / "config.json").write_bytes(raw)
        result = outcome(d)
        if result != "loaded" and len(raw) < len(json.dumps(FAMILIES[family]())):
            assert "config.json" in result or "JSON" in result or "missing" in result, result


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("family", FAMILIES)
def test_truncated_or_corrupted_config(family, budget):
    holds(budget, broken_config_text(family), lambda example: check_config_bytes(family, example))


# ---- model.safetensors -------------------------------------------------------------------------------
def split(raw: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def join(header: dict, data: bytes) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


DTYPES = (
    "F64",
    "F32",
    "F16",
    "BF16",
    "F8_E4M3",
    "F8_E5M2",
    "I64",
    "I32",
    "I16",
    "I8",
    "U8",
    "U16",
    "U32",
    "U64",
    "BOOL",
    "C64",
    "f32",
    "",
    "F31",
)
# Same byte count as F32: a header whose only lie is the dtype still reads
SAME_SIZE = ("I32", "U32")


@st.composite
def lying_files(draw, family: str):
    """(bytes of a mutated model.safetensors, the lie told, the tensor lied about or None)."""
    raw = (base(family) / "model.safetensors").read_bytes()
    header, data = split(raw)
    names = sorted(k for k in header if k != "__metadata__")
    name = draw(st.sampled_from(names))
    info = header[name]
    lie = draw(
        st.sampled_from(
            [
                "truncate",
                "header_length",
                "offsets",
                "dtype",
                "same_size_dtype",
                "shape",
                "header_byte",
                "drop",
                "duplicate",
                "metadata",
                "trailing",
            ]
        )
    )
    if lie == "truncate":
        return raw[: draw(st.integers(0, len(raw) - 1))], lie, None
    if lie == "header_length":
        n = draw(st.one_of(st.integers(0, len(raw) + 64), st.integers(0, 2**64 - 1)))
        return struct.pack("<Q", n) + raw[8:], lie, None
    if lie == "offsets":
        end = len(data) + 64
        info["data_offsets"] = draw(
            st.one_of(
                st.lists(st.integers(-2, end), min_size=2, max_size=2),
                st.lists(st.integers(), min_size=0, max_size=3),
                JSON_VALUES,
            )
        )
    elif lie == "dtype":
        info["dtype"] = draw(st.one_of(st.sampled_from(DTYPES), st.text(max_size=5), JSON_VALUES))
    elif lie == "same_size_dtype":
        if info["dtype"] != "F32":
            return raw, "none", None
        info["dtype"] = draw(st.sampled_from(SAME_SIZE))
    elif lie == "shape":
        info["shape"] = draw(
            st.one_of(st.lists(st.integers(0, 80), max_size=3), st.lists(st.integers(), max_size=2), JSON_VALUES)
        )
    elif lie == "header_byte":
        n = struct.unpack("<Q", raw[:8])[0]
        out = bytearray(raw)
        out[8 + draw(st.integers(0, n - 1))] = draw(st.integers(0, 255))
        return bytes(out), lie, None
    elif lie == "drop":
        del header[name]
    elif lie == "duplicate":
        header[draw(st.sampled_from(["model." + name, name + ".x", "layers.9.mlp.up_proj.weight"]))] = dict(info)
    elif lie == "metadata":
        header["__metadata__"] = draw(JSON_VALUES)
    elif lie == "trailing":
        data = data + draw(st.binary(min_size=1, max_size=16))
    return join(header, data), lie, name


def check_weights(family: str, case) -> None:
    raw, lie, name = case
    with tempfile.TemporaryDirectory() as tmp:
        d = copy_of(family, Path(tmp))
        (d / "model.safetensors").write_bytes(raw)
        result = outcome(d)
        if lie == "same_size_dtype":
            # the one lie a reader cannot see from sizes: integer storage where weights belong
            assert result != "loaded" and name in result and "stored as" in result, result


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("family", FAMILIES)
def test_lying_safetensors(family, budget):
    holds(budget, lying_files(family), lambda example: check_weights(family, example))


@st.composite
def poisoned_weights(draw, family: str):
    """(tensor name, positions, values): NaN / inf written into a float tensor's stored values."""
    names = sorted(n for n, t in load_file(base(family) / "model.safetensors").items() if t.is_floating_point())
    name = draw(st.sampled_from(names))
    numel = load_file(base(family) / "model.safetensors")[name].numel()
    spots = draw(st.lists(st.integers(0, numel - 1), min_size=1, max_size=4, unique=True))
    values = draw(st.lists(st.sampled_from([math.nan, math.inf, -math.inf]), min_size=len(spots), max_size=len(spots)))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    return name, spots, values, dtype


def check_poisoned(family: str, case) -> None:
    name, spots, values, dtype = case
    with tempfile.TemporaryDirectory() as tmp:
        d = copy_of(family, Path(tmp))
        tensors = load_file(d / "model.safetensors")
        t = tensors[name].to(dtype).flatten()
        t[spots] = torch.tensor(values, dtype=dtype)
        tensors[name] = t.reshape(tensors[name].shape)
        save_file(tensors, str(d / "model.safetensors"))
        result = outcome(d)
        assert result == f"tensor {name} holds {len(spots)} NaN/inf value(s)", result


@pytest.mark.parametrize("family", FAMILIES)
def test_nan_and_inf_weights_are_refused(family):
    holds(FAST, poisoned_weights(family), lambda example: check_poisoned(family, example))


# ---- targets the draft does not fit ---------------------------------------------------------------
@st.composite
def misfit_targets(draw):
    """(vocab, hidden, layers) of a target, at least one of them wrong for the tiny drafts."""
    vocab = draw(st.sampled_from([64, 63, 65, 96, 8]))
    hidden = draw(st.sampled_from([16, 8, 32]))
    layers = draw(st.sampled_from([6, 4, 1, 3]))
    if (vocab, hidden) == (64, 16) and layers >= 4:
        vocab = 96
    return vocab, hidden, layers


@pytest.mark.parametrize("family", FAMILIES)
@settings(FAST, max_examples=20)
@given(shape=misfit_targets())
def test_a_target_the_draft_does_not_fit_is_named(family, shape):
    vocab, hidden, layers = shape
    result = outcome(base(family), tiny_llama(vocab, hidden, layers))
    assert result != "loaded"
    # the message says which property of the target does not fit
    if vocab != 64:
        assert "vocab" in result, result
    elif hidden != 16:
        assert "hidden" in result, result
    else:
        assert "hidden_state_indices" in result and f"{layers}-layer target" in result, result


# ---- the tables the readers hold against transformers --------------------------------------------
def test_the_readers_tables_are_transformers_own():
    from transformers.activations import ACT2CLS
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    assert common.ACTIVATIONS == set(ACT2CLS)
    assert set(common.ROPE_REQUIRED) == set(ROPE_INIT_FUNCTIONS) | {"default"}


# ---- what fuzzing found: each kept as the exact example ---------------------------------------------
def _with_config(tmp_path, family: str, change) -> str:
    d = copy_of(family, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    change(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    return outcome(d)


@pytest.mark.parametrize("rope_type", [False, 7, 0, "gated"])
def test_found_an_unknown_rope_type_is_named(tmp_path, rope_type):
    """Was a KeyError from transformers' ROPE_INIT_FUNCTIONS when the draft was built."""

    def change(cfg):
        cfg["transformer_layer_config"]["rope_parameters"]["rope_type"] = rope_type

    result = _with_config(tmp_path, "speculators", change)
    assert result.startswith("transformer_layer_config.rope_parameters.rope_type is "), result


def test_found_yarn_without_its_factor_is_named(tmp_path):
    """Was transformers' KeyError "Missing required keys in `rope_parameters` for 'rope_type'='yarn'"."""
    result = _with_config(tmp_path, "specforge", lambda cfg: cfg.update(rope_scaling={"rope_type": "yarn"}))
    assert result == "rope_scaling.factor is missing (rope_type 'yarn' needs it)", result


@pytest.mark.parametrize(
    "rope,message",
    [
        ({"rope_type": "yarn", "factor": 2.0, "beta_fast": "x"}, "rope_scaling.beta_fast must be a finite number"),
        (
            {"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 4},
            "rope_scaling.short_factor has 3 entries, expected head_dim / 2 = 4",
        ),
        (
            {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5},
            "partial_rotary_factor 0.5 is not supported",
        ),
    ],
)
def test_found_rope_parameters_transformers_cannot_build(tmp_path, rope, message):
    """Were a TypeError inside transformers' validation, a RuntimeError building longrope's
    frequencies, and a partly rotated head the draft's layers do not implement."""
    result = _with_config(tmp_path, "specforge", lambda cfg: cfg.update(rope_scaling=rope))
    assert message in result, result


def test_found_an_unknown_activation_is_named(tmp_path):
    """Was a KeyError from transformers' ACT2FN when the draft's MLP was built."""
    result = _with_config(tmp_path, "deepspec", lambda cfg: cfg.update(hidden_act="yarn"))
    assert result.startswith("hidden_act is 'yarn': not an activation transformers knows"), result


def test_found_a_tiny_rope_theta_is_named(tmp_path):
    """Was a draft that loaded and then failed every sampled request: RoPE's frequencies
    1 / theta^(2i/d) overflow to inf, and torch.multinomial refuses the NaN probabilities."""

    def change(cfg):
        cfg["transformer_layer_config"]["rope_parameters"]["rope_theta"] = 5.2681720838978515e-235

    result = _with_config(tmp_path, "speculators", change)
    assert result == "transformer_layer_config.rope_parameters.rope_theta must be >= 1, got 5.2681720838978515e-235"
    assert (
        _with_config(tmp_path / "zero", "deepspec", lambda cfg: cfg.update(rope_theta=0))
        == "rope_theta must be >= 1, got 0.0"
    )


@pytest.mark.parametrize("eps", [0, -1e-6])
def test_found_a_norm_epsilon_that_is_not_positive_is_named(tmp_path, eps):
    """Found beside rope_theta: a zero row through RMSNorm with eps 0 is 0 * inf = NaN."""
    result = _with_config(tmp_path, "deepspec", lambda cfg: cfg.update(rms_norm_eps=eps))
    assert result == f"rms_norm_eps must be > 0, got {float(eps)}", result


def _with_tensor(tmp_path, family: str, name: str, make) -> Path:
    d = copy_of(family, tmp_path)
    tensors = load_file(d / "model.safetensors")
    tensors[name] = make(tensors[name])
    save_file(tensors, str(d / "model.safetensors"))
    return d


def test_found_float8_weights_are_refused_not_a_crash(tmp_path):
    """Was NotImplementedError: "isfinite" not implemented for 'Float8_e4m3fn' (load_spec and load_draft)."""
    d = _with_tensor(tmp_path, "speculators", "fc.weight", lambda t: t.to(torch.float8_e4m3fn))
    assert outcome(d) == (
        f"tensor fc.weight in {d} is stored as F8_E4M3: it must be F32, F16, BF16 or F64 "
        "(integers and float8 are quantised storage, without its scales)"
    )
    # loading it for decoding refuses the storage too, before any value is cast (a NaN in it or not)
    d2 = _with_tensor(
        tmp_path / "nan",
        "speculators",
        "fc.weight",
        lambda t: t.index_fill(0, torch.tensor([0]), math.nan).to(torch.float8_e4m3fn),
    )
    for path in (d, d2):
        with pytest.raises(DSparkError, match=r"tensor fc.weight in .* is stored as F8_E4M3: it must be F32"):
            load_draft(str(path), TARGET)


@pytest.mark.parametrize("dtype,name", [(torch.int32, "I32"), (torch.int8, "I8"), (torch.bool, "BOOL")])
def test_found_integer_weights_are_refused_by_the_reader(tmp_path, dtype, name):
    """Were read as weights (integers cast to float) by load_spec / `dspark inspect`. The same
    lie in the header alone (F32 bytes declared I32) is in the property above."""
    d = _with_tensor(tmp_path, "deepspec", "norm.weight", lambda t: t.to(dtype))
    with pytest.raises(DSparkError, match=f"tensor norm.weight in .* is stored as {name}: it must be F32, F16, BF16"):
        load_spec(d)
    with pytest.raises(DSparkError, match=f"tensor norm.weight in .* is stored as {name}: it must be F32, F16, BF16"):
        load_draft(str(d), TARGET)  # the engine's path too: integers are never cast to weights
