"""Issue 55: the Host allowlist (DNS rebinding), and a server that listens before its model is
loaded (issue 52: liveness before readiness). Servers run in this process as in tests/test_serve.py."""

from __future__ import annotations

import socket
import threading
import time
from urllib.parse import urlparse

import openai
import pytest
from dspark import progress
from dspark.cli import build_parser
from dspark.cli import serve as serve_cli
from dspark.errors import DSparkError
from dspark.serve.app import create_app
from dspark.serve.hosts import LOOPBACK_NAMES, HostGuard, parse_allowed
from dspark.serve.startup import RETRY_AFTER_S, Starting

from tests.test_serve import MODEL, LiveServer, tiny_engine


# ---- the Host allowlist ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def guarded():
    """A server as `dspark serve` makes one on 127.0.0.1 without --allowed-hosts."""
    s = LiveServer(
        create_app(tiny_engine(max_batch=1), model_name=MODEL, allowed_hosts=parse_allowed(None, "127.0.0.1"))
    )
    yield s
    s.close()


def _port(s: LiveServer) -> int:
    return urlparse(s.url).port


def test_a_loopback_server_answers_loopback_host_names_with_or_without_the_port(guarded):
    port = _port(guarded)
    for host in ("localhost", "127.0.0.1", "[::1]", "LocalHost"):
        for header in (host, f"{host}:{port}"):
            r = guarded.http.get("/health", headers={"Host": header})
            assert r.status_code == 200, (header, r.text)


@pytest.mark.parametrize(
    "header", ["evil.example", "evil.example:{port}", "localhost.evil.example", "127.0.0.1.nip.io:{port}", "[::2]"]
)
def test_a_loopback_server_refuses_other_host_names_naming_the_setting(guarded, header):
    header = header.format(port=_port(guarded))
    before = guarded.app.state.worker.submitted
    for method, path in [("GET", "/health"), ("GET", "/v1/models"), ("POST", "/v1/completions")]:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        r = guarded.http.request(method, path, json=body, headers={"Host": header})
        assert r.status_code == 403, r.text
        err = r.json()["error"]
        assert err["code"] == "host_not_allowed" and "--allowed-hosts" in err["message"]
        assert "DNS rebinding" in err["message"]
    assert guarded.app.state.worker.submitted == before  # refused before it reached the engine


def test_a_request_without_a_host_header_is_refused(guarded):
    with socket.create_connection(("127.0.0.1", _port(guarded)), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        head = sock.recv(4096).decode("latin-1")
    assert head.startswith("HTTP/1.1 403"), head


def test_allowed_hosts_widens_or_lifts_the_list():
    assert parse_allowed(None, "127.0.0.1") == parse_allowed(None, "::1") == parse_allowed(None, "localhost")
    assert parse_allowed(None, "127.0.0.1") == LOOPBACK_NAMES
    assert parse_allowed(None, "0.0.0.0") is None  # bound elsewhere: as before, any name
    assert parse_allowed("*", "127.0.0.1") is None
    guard = HostGuard(None, parse_allowed("My.Box, other:8000", "127.0.0.1"))
    assert guard.admits("my.box") and guard.admits("my.box:1234")
    assert guard.admits("other:8000") and not guard.admits("other:9000")
    assert not guard.admits("localhost")  # the list replaces the default, it does not add to it
    assert not guard.admits(None)
    # bound to a non-loopback address with the flag: the flag applies there too
    assert not HostGuard(None, parse_allowed("my.box", "0.0.0.0")).admits("evil.example")


# ---- listening while the model loads -------------------------------------------------------------
class SlowLoad:
    """A load that waits for the test: the phases it reports, the app it returns."""

    def __init__(self, fail: Exception | None = None):
        self.release, self.fail, self.failures = threading.Event(), fail, []

    def __call__(self, set_phase, **_):
        set_phase("loading the model")
        assert self.release.wait(60)
        if self.fail is not None:
            raise self.fail
        set_phase("starting the engine")
        return create_app(tiny_engine(max_batch=1), model_name=MODEL)


def _wait_for_status(s: LiveServer, status: int, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while (r := s.http.get("/health")).status_code != status:
        assert time.monotonic() < deadline, f"/health still answers {r.status_code}: {r.text}"
        time.sleep(0.05)
    return r


def _starting_503(r, reason: str) -> dict:
    assert r.status_code == 503 and r.headers["retry-after"] == str(RETRY_AFTER_S), r.text
    body = r.json()
    assert body["status"] == "starting" and body["reason"] == reason
    assert body["error"]["code"] == "starting" and reason in body["error"]["message"]
    return body


def test_the_server_listens_and_says_why_it_is_not_ready_until_the_model_is_loaded():
    load = SlowLoad()
    s = LiveServer(Starting(load, load.failures.append))
    try:
        _starting_503(s.http.get("/health"), "loading the model")
        # any API request gets the same answer at once, never a hang (the openai client raises it)
        _starting_503(s.http.post("/v1/completions", json={"model": MODEL, "prompt": "hi"}), "loading the model")
        _starting_503(s.http.get("/v1/models"), "loading the model")
        with pytest.raises(openai.InternalServerError, match="loading the model"):
            s.client().completions.create(model=MODEL, prompt="hi", max_tokens=2)
        load.release.set()
        assert _wait_for_status(s, 200).json() == {"status": "ok"}
        r = s.client().completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0)
        assert r.usage.completion_tokens == 3
        assert load.failures == []
    finally:
        s.close()


def test_a_load_that_fails_is_reported_and_stops_the_server():
    load = SlowLoad(fail=DSparkError("no config.json in /drafts/x"))
    s = LiveServer(Starting(load, load.failures.append))
    try:
        load.release.set()
        deadline = time.monotonic() + 30
        while not load.failures:
            assert time.monotonic() < deadline, "on_failure was not called"
            time.sleep(0.02)
        assert str(load.failures[0]) == "no config.json in /drafts/x"
        r = s.http.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "failed"
        assert "failed to start" in r.json()["error"]["message"]
    finally:
        s.close()


def test_the_reason_follows_the_loads_own_steps(monkeypatch):
    """`dspark serve`'s load: the phases it reports are its own, then each slow step's (dspark.progress)."""

    def build_engine(_config):
        with progress.step("checking the draft", "checked the draft"):
            return tiny_engine(max_batch=1)

    monkeypatch.setattr(serve_cli, "build_engine", build_engine)
    args = build_parser("serve").parse_args(["serve", "--target", "tiny", "--draft", "d", "--no-check"])
    phases: list[str] = []
    app = serve_cli._loader(args)(lambda phase, say=True: phases.append(phase))
    assert phases == ["loading the model", "checking the draft", "starting the engine"]
    assert app.state.engine is not None
    with progress.step("after the load", "done"):  # the listener is gone with the load
        pass
    assert len(phases) == 3
