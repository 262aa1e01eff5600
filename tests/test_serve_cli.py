"""Issue 6: `dspark serve` from the command line: a saved target and draft, a real process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
from dspark.api import load_engine
from dspark.cli import main
from dspark.engine.sampling import SamplingParams
from dspark.formats.convert import write_speculators
from dspark.target.load import smollm2_dir
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from tests.tiny import tiny_draft

ROOT = Path(__file__).resolve().parents[1]
KEY = "cli-key"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny target (SmolLM2's tokenizer and chat template) and a speculators-format draft on disk."""
    root = tmp_path_factory.mktemp("serve-cli")
    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,  # long enough that a request can be caught mid-decoding
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=tok.eos_token_id,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(root / "tiny-target")
    tok.save_pretrained(root / "tiny-target")
    draft = tiny_draft(model, gamma=3)
    write_speculators(draft.spec, draft.own_state_dict(), root / "tiny-draft")
    return root / "tiny-target", root / "tiny-draft"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(port: int, *flags: str) -> subprocess.Popen:
    """`dspark serve` as a process, once its /health answers."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [
        sys.executable,
        "-m",
        "dspark",
        "serve",
        "--dtype",
        "fp32",
        "--device",
        "cpu",
        "--threads",
        "1",
        "--port",
        str(port),
        "--log-level",
        "warning",
        *flags,
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 80
    while True:
        if proc.poll() is not None:
            pytest.fail(f"dspark serve exited {proc.returncode}:\n{proc.stdout.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("dspark serve did not come up")
        try:
            # /health answers without the key (liveness probes rarely carry one)
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.25)


def _stop(proc: subprocess.Popen, sig: int) -> None:
    proc.send_signal(sig)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_serve_command_end_to_end(saved):
    target, draft = saved
    port = _free_port()
    proc = _start(
        port,
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--api-key",
        KEY,
        "--max-batch",
        "2",
        "--max-queue",
        "2",
        "--verify",
        "threshold",
        "--threshold",
        "0.5",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        assert [m.id for m in c.models.list().data] == ["tiny-target"]
        msgs = [{"role": "user", "content": "Say something."}]
        r = c.chat.completions.create(model="tiny-target", messages=msgs, max_tokens=12, temperature=0)
        # the same files loaded in-process through the Python API (full verification) decode to
        # the same text: the threshold policy only changes how many drafts are verified
        ref = load_engine(str(target), str(draft), dtype="fp32", device="cpu")
        want = ref.generate(ref.encode(msgs, chat=True), SamplingParams(max_new_tokens=12))
        assert r.choices[0].message.content == want.text
        spec = r.model_extra["speculative"]
        assert spec["gamma"] == 3 and spec["verify_steps"] >= 1
        assert spec["accepted_tokens"] <= spec["verified_tokens"] <= spec["drafted_tokens"] == 3 * spec["verify_steps"]
    finally:
        _stop(proc, signal.SIGINT)  # uvicorn's graceful shutdown
    assert proc.returncode == 0, proc.stdout.read()


def test_sigterm_drains_and_exits_0(saved):
    """SIGTERM (what systemd, docker and kubernetes send): the request in flight runs to its end,
    then the process exits 0, not 143."""
    target, _ = saved
    port = _free_port()
    proc = _start(port, "--target", str(target), "--no-spec", "--max-batch", "1")
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        stream = iter(
            c.completions.create(model="tiny-target", prompt="Once", max_tokens=60, temperature=0, stream=True)
        )
        first = next(stream)
        proc.send_signal(signal.SIGTERM)
        rest = list(stream)
        assert first.choices[0].text is not None and rest[-1].choices[0].finish_reason in ("length", "stop")
        proc.wait(30)
    finally:
        if proc.poll() is None:
            _stop(proc, signal.SIGKILL)
    assert proc.returncode == 0, proc.stdout.read()


def test_sigterm_past_the_drain_timeout_ends_what_is_in_flight_with_a_503_and_exits_0(saved):
    """A drain is bounded: past --drain-timeout (0 here: at once) a request still decoding ends
    with a clean error event naming the shutdown, never a cut connection, and the exit is 0."""
    target, _ = saved
    port = _free_port()
    proc = _start(port, "--target", str(target), "--no-spec", "--max-batch", "2", "--drain-timeout", "0")
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        stream = iter(
            c.completions.create(model="tiny-target", prompt="Once", max_tokens=230, temperature=0, stream=True)
        )
        next(stream)
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(openai.APIError, match=r"shutting down \(its drain timeout passed\)"):
            list(stream)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            _stop(proc, signal.SIGKILL)
    out = proc.stdout.read()
    assert proc.returncode == 0, out
    assert "Traceback" not in out


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--max-batch", "0"),
        ("--max-queue", "-1"),
        ("--port", "70000"),
        ("--max-body-bytes", "0"),
        ("--drain-timeout", "-1"),
    ],
)
def test_serve_refuses_bad_flags_before_loading(flag, value, capsys):
    assert main(["serve", "--target", "/nonexistent", "--no-spec", flag, value]) == 2
    assert flag in capsys.readouterr().err


def test_a_busy_port_fails_at_once_naming_the_address(capsys):
    """The port is taken before the model loads: the error comes in seconds, naming host:port
    (the target here does not even exist, so a load would fail differently)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        assert main(["serve", "--target", "/nonexistent", "--no-spec", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "in use" in err, err
    assert time.monotonic() - t0 < 5


def _running(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith("dspark_running_requests ")))


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_second_signal_ends_what_is_in_flight_cleanly_and_exits_non_zero(saved, sig, code):
    """Ctrl-C twice (0.3 s apart, the drain's 30 s not spent): each request in flight gets an error,
    a stream as its last event before [DONE] and a non-streamed request a 503, never a cut
    connection; no traceback; the exit code says the stop was forced."""
    target, _ = saved
    port = _free_port()
    proc = _start(port, "--target", str(target), "--no-spec", "--max-batch", "2")
    url = f"http://127.0.0.1:{port}"
    try:
        # the Host allowlist is on by default on 127.0.0.1 (tests/test_serve_start.py has the rest)
        refused = httpx.get(url + "/health", headers={"Host": "evil.example"}, timeout=5)
        assert refused.status_code == 403 and "--allowed-hosts" in refused.json()["error"]["message"]
        body = {"model": "tiny-target", "prompt": "Once", "max_tokens": 2000, "temperature": 0}
        with httpx.Client(base_url=url, timeout=60) as http, ThreadPoolExecutor(1) as pool:
            plain = pool.submit(http.post, "/v1/completions", json=body)
            with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
                lines = stream.iter_lines()
                assert next(lines).startswith("data: {")
                deadline = time.monotonic() + 20
                while _running(port) < 2:
                    assert time.monotonic() < deadline, "the non-streamed request did not start"
                proc.send_signal(sig)
                time.sleep(0.3)
                proc.send_signal(sig)
                events = [line for line in lines if line]  # a cut connection raises here
            answer = plain.result(30)
        assert events[-1] == "data: [DONE]", events[-3:]
        assert "stopped by a second signal" in json.loads(events[-2].removeprefix("data: "))["error"]["message"]
        assert answer.status_code == 503 and "stopped by a second signal" in answer.json()["error"]["message"]
        proc.wait(30)
    finally:
        if proc.poll() is None:
            _stop(proc, signal.SIGKILL)
    out = proc.stdout.read()
    assert proc.returncode == code, out
    assert "Traceback" not in out and "CancelledError" not in out, out


def test_a_stop_while_the_model_loads_ends_the_process_cleanly(saved):
    """SIGTERM as soon as the load began: exit 0 at once, not a wait for the load and not an abort
    (an interpreter that finalizes under the loading thread dies with "terminate called ...")."""
    target, draft = saved
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "dspark", "serve", "--target", str(target), "--draft", str(draft), "--dtype", "fp32"]
    cmd += ["--device", "cpu", "--port", str(_free_port()), "--log-level", "info"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "loading the model" in line:
                break
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        proc.wait(30)
    finally:
        if proc.poll() is None:
            _stop(proc, signal.SIGKILL)
    out = "".join(seen) + proc.stdout.read()
    assert proc.returncode == 0, out
    assert time.monotonic() - t0 < 10, out
    assert "terminate called" not in out and "Traceback" not in out, out
