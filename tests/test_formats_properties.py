"""Property tests: over generated configs the resolver returns a consistent description or a
FormatError naming a key; it never falls back to a default without saying so."""

import copy

from dspark.errors import FormatError
from dspark.formats import deepspec, speculators
from dspark.formats.load import pick_reader
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.formats_fixtures import tiny_deepspec, tiny_speculators

ABSENT = object()
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HEAD_KEYS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")

junk = st.one_of(
    st.none(), st.booleans(), st.text(max_size=3), st.floats(allow_nan=False), st.lists(st.integers(), max_size=2)
)
maybe_int = st.one_of(st.integers(-2, 12), junk)


def _put(d: dict, key: str, value) -> None:
    if value is ABSENT:
        d.pop(key, None)
    else:
        d[key] = value


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@st.composite
def speculators_configs(draw):
    cfg = tiny_speculators(flag=True)
    block = draw(st.one_of(st.integers(-1, 12), junk))
    flag = draw(st.sampled_from([True, False, ABSENT, None, "true", 1]))
    tokens = draw(st.one_of(st.just(ABSENT), maybe_int))
    default = draw(st.sampled_from([ABSENT, "greedy", "sampling", None, 3]))
    _put(cfg, "block_size", block)
    _put(cfg, "sample_from_anchor", flag)
    _put(cfg["speculators_config"]["proposal_methods"][0], "speculative_tokens", tokens)
    _put(cfg["speculators_config"], "default_proposal_method", default)
    for key in HEAD_KEYS:
        if draw(st.booleans()):
            del cfg[key]
    if draw(st.booleans()):
        cfg["markov_head_type"] = draw(st.sampled_from(["vanilla", " Gated ", "RNN", "lstm", 3]))
    return cfg, block, flag, tokens, default


@SETTINGS
@given(speculators_configs())
def test_speculators_resolver_is_consistent_or_refuses(case):
    cfg, block, flag, tokens, default = case
    try:
        spec = speculators.read(copy.deepcopy(cfg), None)
    except FormatError as exc:
        message = str(exc)
        assert message and "\n" not in message
        return
    # Nothing invalid got through.
    assert _is_int(block) and block >= 1
    assert default in (ABSENT, None, "greedy")
    assert flag in (True, False, ABSENT, None)
    # The description is self-consistent.
    assert spec.block_size == block == spec.query_slots
    assert spec.gamma == (block if spec.layout == "anchor_first" else block - 1) >= 1
    if _is_int(tokens):
        assert spec.gamma == tokens
    if isinstance(flag, bool):
        assert spec.layout_source == "flag" and (spec.layout == "anchor_first") is flag
    else:
        # Without the flag the layout is a rule, and the rule is always reported.
        assert spec.layout_source in ("legacy_default", "speculative_tokens")
        assert any("sample_from_anchor" in w for w in spec.warnings)
        if tokens is ABSENT or tokens is None:
            assert spec.layout == "bonus_anchor"
    # A defaulted head setting is never silent.
    for key in HEAD_KEYS:
        used = key != "confidence_head_with_markov" or spec.confidence_head
        used = used and (key != "markov_head_type" or spec.markov_rank > 0)
        if key not in cfg and used:
            assert any(w.startswith(f"{key} absent") for w in spec.warnings), key


@SETTINGS
@given(
    st.text(alphabet=" \t\n", max_size=2),
    st.sampled_from(["dspark", "DSpark", "DSPARK", "dSpArK"]),
    st.text(alphabet=" \t\n", max_size=2),
)
def test_model_type_case_and_whitespace_variants(left, word, right):
    cfg = tiny_speculators(flag=True, speculators_model_type=left + word + right)
    assert pick_reader(cfg) is speculators
    assert speculators.read(cfg, None).layout == "anchor_first"


@SETTINGS
@given(st.one_of(st.integers(), st.none(), st.booleans(), st.lists(st.just("dspark"), max_size=1), st.text(max_size=6)))
def test_model_type_other_values_are_refused(value):
    if isinstance(value, str) and value.strip().lower() == "dspark":
        return
    cfg = tiny_speculators(flag=True, speculators_model_type=value)
    try:
        speculators.read(cfg, None)
    except FormatError as exc:
        assert "speculators_model_type" in str(exc)
    else:
        raise AssertionError(f"accepted speculators_model_type={value!r}")


@st.composite
def deepspec_configs(draw):
    cfg = tiny_deepspec()
    ids = draw(st.one_of(st.lists(st.integers(-2, 7), min_size=0, max_size=4), junk))
    _put(cfg, "target_layer_ids", ids)
    _put(cfg, "block_size", draw(st.one_of(st.just(ABSENT), maybe_int)))
    _put(cfg, "mask_token_id", draw(st.one_of(st.just(ABSENT), st.integers(-2, 70), junk)))
    _put(cfg, "markov_rank", draw(st.one_of(st.just(ABSENT), st.integers(-1, 8), junk)))
    _put(cfg, "confidence_head_with_markov", draw(st.sampled_from([True, False, ABSENT, "yes"])))
    return cfg, ids


@SETTINGS
@given(deepspec_configs())
def test_deepspec_reader_is_consistent_or_refuses(case):
    cfg, ids = case
    try:
        spec = deepspec.read(copy.deepcopy(cfg), None)
    except FormatError as exc:
        assert str(exc) and "\n" not in str(exc)
        return
    assert (spec.layout, spec.layout_source) == ("anchor_first", "format")
    assert spec.gamma == spec.query_slots == spec.block_size == cfg["block_size"] >= 1
    assert list(spec.hidden_state_indices) == [t + 1 for t in ids]
    assert all(b > a for a, b in zip(ids, ids[1:])) and ids[0] >= -1 and ids[-1] < cfg["num_target_layers"]
    assert 0 <= spec.mask_token_id < spec.vocab_size
    assert spec.markov_rank == cfg["markov_rank"] >= 0
    assert not (spec.confidence_head_with_markov and spec.markov_rank == 0)
    assert spec.warnings == () or all(isinstance(w, str) for w in spec.warnings)
