"""Issue 36, item 1: `dspark bench-serve`, the soak of `dspark serve`, and its short form.

The short soak is the command itself on a tiny saved target and draft (SmolLM2's tokenizer and
chat template, as tests/test_serve_cli.py saves them): `dspark serve` as a process, 40
requests of the mix at concurrency 8, and the report must say 0 unexpected errors, every
malformed request refused with its own 4xx, 0 greedy outputs changed by batching, nothing left
in flight, no traceback in the server's log, exit 0 after SIGTERM. The pieces it relies on (the
mix, the client's answers to each malformed case, the flags handed to the server) are tested
on their own, in this process.
"""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest
from dspark.bench import soak_client, soak_mix, soak_report
from dspark.bench.soak_client import send
from dspark.bench.soak_mix import Call, MixSettings, make_call
from dspark.bench.soak_report import percentile
from dspark.cli import build_parser, main
from dspark.cli.bench_serve import serve_args
from dspark.cli.engine_flags import engine_config
from dspark.serve.app import create_app

from tests.test_serve import CONTEXT, LiveServer, tiny_engine
from tests.test_serve_cli import saved  # noqa: F401  (fixture: a tiny target and draft on disk)

MIX = MixSettings(model="tiny", context=CONTEXT, max_tokens=16, seed=3)


@pytest.fixture(scope="module")
def live():
    s = LiveServer(create_app(tiny_engine(max_batch=4), model_name=MIX.model))
    yield s
    s.close()


def _port(s: LiveServer) -> int:
    return int(s.url.rsplit(":", 1)[1])


# ---- the mix -----------------------------------------------------------------------------------
def test_the_mix_is_a_function_of_seed_and_index():
    assert make_call(MIX, 17) == make_call(MIX, 17)
    assert [make_call(MIX, i).body for i in range(20)] != [
        make_call(MixSettings(**{**MIX.__dict__, "seed": 4}), i).body for i in range(20)
    ]


def test_the_mix_has_every_kind_in_its_shares():
    calls = [make_call(MIX, i) for i in range(1000)]
    words = Counter(w for c in calls for w in c.label.split())
    for w in ("chat", "completion", "stream", "greedy", "sampled", "long", "short", "disconnect", "huge"):
        assert words[w] > 0, w
    assert 10 < words["huge"] < 60  # the long-prompt client: ~3 % of the well-formed requests
    malformed = sum(c.malformed for c in calls)
    leaving = [c for c in calls if c.expect is None]
    assert 60 < malformed < 140 and 60 < len(leaving) < 140  # ~10 % each
    assert {c.label for c in calls if c.malformed} == {
        f"malformed:{n}" for n, *_ in soak_mix.malformed_cases("tiny", CONTEXT)
    }
    # a client that leaves does so mid-stream, and is never compared (it has no whole output)
    assert all(c.stream and c.greedy_key is None for c in leaving)
    # greedy requests repeat: the solo comparison decodes each distinct one once
    keys = [c.greedy_key for c in calls if c.greedy_key]
    assert len(set(keys)) < len(keys)
    for c in calls:
        if c.greedy_key:
            solo = json.loads(c.solo_body)
            assert solo["temperature"] == 0 and "stream" not in solo
            assert {k: v for k, v in json.loads(c.body).items() if not k.startswith("stream")} == solo
        elif c.expect == 200:
            body = json.loads(c.body)
            assert body["temperature"] > 0 and isinstance(body["seed"], int)


def test_long_prompts_fit_the_context():
    for context, max_tokens in ((256, 32), (CONTEXT, 16), (8192, 32)):
        words = soak_mix.long_words(context, max_tokens)
        assert 16 <= words <= 400
        assert len(soak_mix.long_prompt(0, words).split()) >= words
    assert soak_mix.long_prompt(1, 50) == soak_mix.long_prompt(1, 50) != soak_mix.long_prompt(2, 50)


def test_huge_prompts_fill_most_of_the_context_and_fit():
    for context, max_tokens in ((256, 32), (CONTEXT, 16), (8192, 32)):
        words = soak_mix.huge_words(context, max_tokens)
        assert words >= soak_mix.long_words(context, max_tokens) or context < 512
        assert 1.3 * words + 64 + max_tokens < context  # with a chat template's tokens, it fits
    assert soak_mix.huge_words(8192, 32) > 3000


def test_short_requests_beside_a_huge_prefill_are_found_by_overlap():
    from dspark.bench.soak_client import Outcome
    from dspark.bench.soak_report import beside_huge

    huge = Outcome("completion greedy huge", 200, latency=10.0, start=100.0, ttft=None)
    huge_stream = Outcome("chat stream greedy huge", 200, latency=10.0, start=200.0, ttft=2.0)
    during = Outcome("chat greedy short", 200, latency=1.5, start=101.0)
    after_first_token = Outcome("chat greedy short", 200, latency=1.0, start=203.0)  # its prefill was over
    before = Outcome("chat greedy short", 200, latency=0.5, start=99.0)  # answered before the huge one came
    long = Outcome("chat greedy long", 200, latency=3.0, start=101.0)  # not a short request
    assert beside_huge([huge, huge_stream, during, after_first_token, before, long]) == [1.5]


def test_percentile():
    assert percentile([], 0.5) is None
    assert percentile([3.0], 0.99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile(list(map(float, range(101))), 0.99) == pytest.approx(99.0)


# ---- the client against a server in this process -------------------------------------------------
@pytest.mark.parametrize("case", soak_mix.malformed_cases(MIX.model, CONTEXT), ids=lambda c: c[0])
def test_each_malformed_case_gets_its_own_4xx(live, case):
    name, path, body, status, extra = case
    out = send(_port(live), Call(0, path, body, status, f"malformed:{name}", **extra), timeout=30)
    assert out.status == status and out.problem is None, (out.status, out.problem)


def test_a_client_that_leaves_mid_stream_frees_its_slot(live):
    calls = [c for c in (make_call(MIX, i) for i in range(200)) if c.expect is None][:3]
    port = _port(live)
    for call in calls:
        out = send(port, call, timeout=30)
        assert out.status == 200 and out.problem is None and out.ttft is not None and out.text
    deadline = time.monotonic() + 10
    while any(soak_client.gauges(port).values()):
        assert time.monotonic() < deadline, soak_client.gauges(port)
        time.sleep(0.05)


def test_a_well_formed_request_is_served_and_a_greedy_one_compared(live):
    port = _port(live)
    call = next(c for c in (make_call(MIX, i) for i in range(200)) if c.greedy_key and c.stream)
    streamed = send(port, call, timeout=30)
    alone = send(port, Call(-1, call.path, call.solo_body, 200, "solo"), timeout=30)
    assert streamed.problem is None and alone.problem is None
    assert streamed.text == alone.text and streamed.finish == alone.finish and streamed.tokens == alone.tokens > 0


def test_an_unexpected_answer_is_counted_with_its_status():
    report = soak_report.SoakReport({}, "m", 1, wall_s=2.0)
    outs = [
        soak_client.Outcome("a", 200, 200, tokens=5, latency=1.0),
        soak_client.Outcome("b", 200, 500, problem="HTTP 500"),
        soak_client.Outcome("malformed:x", 400, 400),
        soak_client.Outcome("c", None, 200),
        soak_client.Outcome("d", 200, None, problem="TimeoutError: timed out"),
    ]
    soak_report.summarize(report, outs)
    assert (report.served, report.disconnected, report.refused_as_expected) == (1, 1, {"400": 1})
    assert report.unexpected == {"HTTP 500": 1, "TimeoutError": 1} and report.tokens_per_s == 2.5
    assert not report.passed


# ---- the command ---------------------------------------------------------------------------------
def test_the_engine_flags_reach_the_server_unchanged():
    flags = [
        "--target",
        "T",
        "--draft",
        "D",
        "--dtype",
        "fp32",
        "--device",
        "cpu",
        "--threads",
        "1",
        "--verify",
        "threshold",
        "--threshold",
        "0.3",
        "--max-batch",
        "3",
        "--no-check",
        "--always-draft",
    ]
    args = build_parser("bench-serve").parse_args(["bench-serve", *flags, "--concurrency", "2", "--max-queue", "5"])
    forwarded = serve_args(args)
    served = build_parser("serve").parse_args(["serve", *forwarded])
    assert engine_config(served) == engine_config(args)
    assert served.max_queue == 5 and served.log_level == "warning"
    assert "--concurrency" not in forwarded
    # nothing given, nothing forwarded: the server keeps its own defaults
    assert serve_args(build_parser("bench-serve").parse_args(["bench-serve"])) == ["--log-level", "warning"]


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--concurrency", "0"], "--concurrency"),
        (["--requests", "0"], "--requests"),
        (["--max-tokens", "2"], "--max-tokens"),
        (["--malformed", "0.7", "--disconnect", "0.5"], "shares"),
    ],
)
def test_bad_soak_settings_are_refused_before_the_server_starts(flags, message, capsys):
    assert main(["bench-serve", "--target", "/nonexistent", *flags]) == 2
    assert message in capsys.readouterr().err


def _short_soak(saved, capsys, requests: int, concurrency: int, *extra: str) -> dict:  # noqa: F811
    target, draft = saved
    rc = main(
        [
            "bench-serve",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--dtype",
            "fp32",
            "--device",
            "cpu",
            "--threads",
            "1",
            "--requests",
            str(requests),
            "--concurrency",
            str(concurrency),
            "--max-tokens",
            "16",
            "--json",
            *extra,
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert rc == (0 if report["passed"] else 1)
    return report


def _check(report: dict, requests: int, mix_seed: int = 0) -> None:
    mix = MixSettings(model=report["model"], context=report["context"], max_tokens=16, seed=mix_seed)
    calls = [make_call(mix, i) for i in range(requests)]
    assert report["unexpected_total"] == 0, report["unexpected_examples"]
    assert report["sent"] == requests
    # every malformed request was refused with the 4xx it expects (another status is unexpected)
    want = Counter(str(c.expect) for c in calls if c.malformed)
    assert report["refused_as_expected"] == dict(want) and all(400 <= int(s) < 500 for s in want)
    assert report["disconnected"] == sum(c.expect is None for c in calls)
    assert report["served"] == sum(c.expect == 200 for c in calls)
    assert report["greedy_checked"] == sum(c.greedy_key is not None for c in calls) > 0
    assert report["greedy_differed"] == 0, report["greedy_examples"]
    assert report["gauges_after"] == {"dspark_queue_depth": 0.0, "dspark_running_requests": 0.0}
    assert report["server_tracebacks"] == 0 and report["server_exit_code"] == 0
    assert report["rss_start_bytes"] > 0 and report["rss_end_bytes"] > 0
    assert report["completion_tokens"] > 0 and report["latency_p50_s"] is not None and report["ttft_p50_s"] is not None
    assert report["passed"]


def test_short_soak(saved, capsys):  # noqa: F811
    """40 requests at concurrency 8 through `dspark bench-serve` (about 35 s on 2 cores)."""
    _check(_short_soak(saved, capsys, 40, 8), 40)


@pytest.mark.slow
def test_long_soak(saved, capsys):  # noqa: F811
    """400 requests at concurrency 16, another seed: every kind of request many times over."""
    _check(_short_soak(saved, capsys, 400, 16, "--seed", "7"), 400, mix_seed=7)
