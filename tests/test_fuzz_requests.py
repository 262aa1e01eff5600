"""Issue 36, item 4: fuzzed requests. Random bytes and random JSON bodies, to the parse functions
and to a live server's routes: every body ends in a request the server decodes or a 4xx in
OpenAI's error shape. Never a 500, an error event in a stream, a hang (every call has a
timeout), or a traceback in the log.

Bodies are drawn two ways: any JSON value at all, and objects built from the fields the
server knows, each given either a plausible value or any JSON value, so that most examples
get past the first check and some all the way to the engine. The server is in this process
(uvicorn on 127.0.0.1, as tests/test_serve.py runs it) over a tiny random Llama with
SmolLM2's tokenizer and a context of 128 tokens, so that a valid request decodes quickly.
The default suite runs a small budget; the slow suite 2 000 examples per reader.
"""

from __future__ import annotations

import json
import logging

import httpx
import pytest
import torch
from dspark.engine.engine import Engine
from dspark.engine.sampling import SamplingParams
from dspark.serve import protocol
from dspark.serve.app import create_app
from dspark.serve.protocol import APIError
from dspark.target.hf import HFTarget
from dspark.target.load import smollm2_dir
from dspark.target.text import eos_ids
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from tests.fuzzing import budgets, holds
from tests.test_serve import LiveServer
from tests.test_serve_limits import Records
from tests.tiny import tiny_draft

MODEL, CONTEXT = "tiny", 128
FAST = settings(
    max_examples=80,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
BUDGETS = budgets(FAST)
ROUTES = ("/v1/completions", "/v1/chat/completions")


# ---- bodies ---------------------------------------------------------------------------------------
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-3, 40), st.floats(), st.text(max_size=12))
ANY_JSON = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
TEXT = st.one_of(st.text(max_size=40), st.sampled_from(["Hello", "Once upon a time", "\ud800", "a\x00b", "😀", ""]))
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]), ANY_JSON),
        "content": st.one_of(
            TEXT,
            st.lists(st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), ANY_JSON), max_size=3),
            ANY_JSON,
        ),
    }
)
# each field the server reads: a value of the right kind (edges included), or anything
FIELDS = {
    "model": st.one_of(st.just(MODEL), TEXT),
    "prompt": st.one_of(
        TEXT,
        st.lists(TEXT, max_size=2),
        st.lists(st.integers(-2, 50000), max_size=6),
        st.lists(st.lists(st.integers(0, 100), max_size=3), max_size=2),
    ),
    "messages": st.lists(MESSAGE, max_size=3),
    "max_tokens": st.one_of(st.integers(-1, 6), st.integers(), st.floats(0, 8)),
    "max_completion_tokens": st.one_of(st.integers(-1, 6), st.integers()),
    "temperature": st.one_of(st.floats(0, 2.5), st.sampled_from([0, 1, 1e-300, 5e-324, 2, 2.0000001])),
    "top_p": st.one_of(st.floats(0, 1.5), st.sampled_from([5e-324, 1e-300, 1])),
    "top_k": st.one_of(st.integers(-2, 5), st.integers()),
    "seed": st.one_of(st.integers(), st.sampled_from([-(1 << 63), (1 << 64) - 1, 1 << 64])),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=5)),
    "n": st.integers(-1, 3),
    "stream": st.booleans(),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), ANY_JSON),
    "logprobs": st.one_of(st.booleans(), st.integers(0, 3)),
    "echo": st.booleans(),
    "suffix": TEXT,
    "best_of": st.integers(0, 3),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "logit_bias": st.dictionaries(st.text(max_size=4), st.integers(-100, 100), max_size=2),
    "tools": st.lists(ANY_JSON, max_size=2),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto"]), ANY_JSON),
    "response_format": st.one_of(st.just({"type": "text"}), ANY_JSON),
    "top_logprobs": st.integers(0, 3),
    "user": TEXT,
    "dspark": st.one_of(st.fixed_dictionaries({"marks": st.booleans()}), ANY_JSON),
}


@st.composite
def requests(draw):
    """(route, body): a request of the route's usual shape with up to four fields changed, each
    to a plausible value, to any JSON value, or removed; now and then a field nobody knows.
    About a third of them are well formed, so that the engine side is fuzzed too."""
    route = draw(st.sampled_from(ROUTES))
    body = {"model": MODEL, "max_tokens": draw(st.integers(1, 6)), "stream": draw(st.booleans())}
    if route.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": draw(TEXT)}]
    else:
        body["prompt"] = draw(FIELDS["prompt"])
    for _ in range(draw(st.integers(0, 4))):
        name = draw(st.sampled_from(sorted(FIELDS)))
        how = draw(st.sampled_from(["plausible", "plausible", "plausible", "anything", "remove"]))
        if how == "remove":
            body.pop(name, None)
        else:
            body[name] = draw(FIELDS[name] if how == "plausible" else ANY_JSON)
    if draw(st.integers(0, 5)) == 0:
        body[draw(st.text(max_size=10))] = draw(ANY_JSON)
    return route, body


def encoded(body) -> bytes:
    # allow_nan: Python writes NaN and Infinity, which are not JSON; the server must refuse them
    return json.dumps(body).encode()


RAW_BYTES = st.one_of(
    st.binary(max_size=64), st.builds(lambda b, n: b * n, st.sampled_from([b"[", b'{"a":', b"-"]), st.integers(1, 5000))
)


# ---- the parse functions alone ----------------------------------------------------------------------
def parse_outcome(raw: bytes, route: str) -> str:
    """'parsed', or the APIError's status; any other exception fails the test."""
    parse = protocol.parse_chat if route.endswith("chat/completions") else protocol.parse_completion
    try:
        req = parse(protocol.parse_json(raw), model_name=MODEL, max_context=CONTEXT)
    except APIError as err:
        assert 400 <= err.status < 500 and err.message, (err.status, err.message)
        assert err.body()["error"]["message"] == err.message
        json.dumps(err.body())  # the body goes out as JSON: it must encode
        event(f"refused {err.status}")
        return str(err.status)
    assert req.kind in ("chat", "completion") and (req.max_tokens is None or 1 <= req.max_tokens <= CONTEXT)
    assert 0 <= req.temperature <= 2 and 0 < req.top_p <= 1 and req.top_k >= 0
    event("parsed")
    return "parsed"


@pytest.mark.parametrize("budget", BUDGETS)
def test_parse_any_body(budget):
    holds(
        budget,
        st.one_of(requests(), st.tuples(st.sampled_from(ROUTES), ANY_JSON)),
        lambda case: parse_outcome(encoded(case[1]), case[0]),
    )


@pytest.mark.parametrize("budget", BUDGETS)
def test_parse_any_bytes(budget):
    holds(budget, st.tuples(RAW_BYTES, st.sampled_from(ROUTES)), lambda case: parse_outcome(*case))


# ---- a live server -------------------------------------------------------------------------------------
def small_engine() -> Engine:
    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=tok.eos_token_id,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(cfg).eval()
    return Engine(HFTarget(model), tiny_draft(model, gamma=3), tok, eos_ids(model, tok), max_batch=4)


@pytest.fixture(scope="module")
def live():
    s = LiveServer(create_app(small_engine(), model_name=MODEL, max_queue=8))
    yield s
    s.close()


@pytest.fixture(scope="module")
def ref_engine() -> Engine:
    """The same weights, decoded in this process."""
    return small_engine()


@pytest.fixture(scope="module")
def records():
    """Every log record while this module runs, dspark's and uvicorn's."""
    h = Records()
    loggers = [logging.getLogger(), logging.getLogger("uvicorn"), logging.getLogger("uvicorn.error")]
    for lg in loggers:
        lg.addHandler(h)
    yield h
    for lg in loggers:
        lg.removeHandler(h)


def check_error_body(r: httpx.Response) -> None:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text
    assert len(r.content) < 2000, "an error body repeats a value the client sent at length"


def served_outcome(s: LiveServer, raw: bytes, route: str, content_type: str | None = "application/json") -> int:
    """POST raw to route; the status, after checking the answer is whole and well formed."""
    headers = {} if content_type is None else {"content-type": content_type}
    with s.http.stream("POST", route, content=raw, headers=headers, timeout=60) as r:
        assert r.status_code < 500, r.read()
        if r.status_code != 200:
            r.read()
            check_error_body(r)
            event(f"HTTP {r.status_code}")
            return r.status_code
        if r.headers["content-type"].startswith("text/event-stream"):
            events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
            assert events and events[-1] == "[DONE]", events[-3:]
            for e in events[:-1]:
                assert "error" not in json.loads(e), e  # an engine failure after the headers
            event("HTTP 200 stream")
        else:
            body = json.loads(r.read())
            assert body["choices"][0]["finish_reason"] in ("stop", "length") and body["usage"]["completion_tokens"] >= 1
            event("HTTP 200")
    return 200


def no_tracebacks(records: Records) -> None:
    """No error logged since the last call (cleared, so that a failure names its own example)."""
    bad = [r for r in records.records if r.exc_info or r.levelno >= logging.ERROR]
    records.records.clear()
    assert not bad, [r.getMessage() for r in bad]


@pytest.mark.parametrize("budget", BUDGETS)
def test_the_server_answers_any_body(live, records, budget):
    def check(case):
        route, body = case
        served_outcome(live, encoded(body), route)
        no_tracebacks(records)

    holds(budget, st.one_of(requests(), requests(), st.tuples(st.sampled_from(ROUTES), ANY_JSON)), check)


@FAST
@given(
    raw=RAW_BYTES,
    route=st.sampled_from(ROUTES + ("/v1/models", "/v1/nothing", "/health")),
    content_type=st.one_of(
        st.none(),
        st.sampled_from(
            [
                "application/json",
                "application/json; charset=utf-8",
                "text/plain",
                "APPLICATION/JSON",
                "multipart/form-data",
            ]
        ),
        # a header value has no space at either end (HTTP trims it; httpx refuses it)
        st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=20).map(str.strip),
    ),
)
def test_the_server_answers_any_bytes(live, records, raw, route, content_type):
    status = served_outcome(live, raw, route, content_type)
    if route in ("/v1/models", "/health"):
        assert status == 405  # GET routes
    no_tracebacks(records)


def test_the_server_is_healthy_after_the_fuzzing(live, records):
    assert live.http.get("/health").json() == {"status": "ok"}
    r = live.http.post("/v1/completions", json={"model": MODEL, "prompt": "still there?", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    no_tracebacks(records)


# ---- what fuzzing found: each kept as the exact request ---------------------------------------------
@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-40])
def test_found_a_temperature_too_small_to_divide_by_is_a_400(live, records, temperature):
    """Was a 500 for every request in the batch: logits / 1e-300 overflow to inf, softmax gives
    NaN, and torch.multinomial fails the whole engine step."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "temperature": temperature, "seed": 1}
    r = live.http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "temperature" and err["message"].startswith("temperature must be 0 (greedy) or at least")
    no_tracebacks(records)


@pytest.mark.parametrize("top_p", [5e-324, 1e-300])
@pytest.mark.parametrize("route", ROUTES)
def test_found_a_top_p_below_float32s_range_keeps_the_top_token(live, records, ref_engine, top_p, route):
    """Was a 500 for every request in the batch: top_p 1e-300 reads as 0 in the engine's float32
    comparison, no token is kept, the probabilities are NaN and torch.multinomial fails the step.
    Any top_p below 1 / vocabulary keeps the top token alone: the answer is the greedy one."""
    body = {"model": MODEL, "max_tokens": 3, "top_p": top_p, "seed": 5, "temperature": 1.3}
    prompt = "Once upon a time"
    body.update(
        {"messages": [{"role": "user", "content": prompt}]}
        if route.endswith("chat/completions")
        else {"prompt": prompt}
    )
    r = live.http.post(route, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    want = ref_engine.generate(ref_engine.encode(prompt, chat="messages" in body), SamplingParams(max_new_tokens=3))
    assert text == want.text
    no_tracebacks(records)
