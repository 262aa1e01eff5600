"""Issue 35: each committed token's origin (dspark/engine/marks.py), as the engine records it, the
server streams it (the opt-in `dspark` extension) and `dspark generate --show-drafts` prints it."""

from __future__ import annotations

import json
import re

import openai
import pytest
from dspark.cli import main
from dspark.engine.marks import KINDS, TextPieces, counts
from dspark.engine.sampling import SamplingParams
from dspark.model.load import build_draft
from dspark.serve.app import create_app

from tests.test_serve import LiveServer, tiny_engine
from tests.test_serve_cli import saved  # noqa: F401  (fixture: a tiny target with SmolLM2's tokenizer + a draft)
from tests.tiny import engine_for, hf_greedy

PROMPTS = [[7, 12, 40, 9, 33, 21, 5, 18], [50, 4, 4, 61, 30, 11, 27, 8], [13, 22, 35, 46, 57, 13, 22, 35]]


def check_marks(req, model=None, prompt=None):
    """The invariants a reader of marks relies on, against the request's own statistics."""
    marks, m = req.marks, req.metrics
    assert [k.token for k in marks] == req.output_ids
    assert marks[0].kind == "plain" and marks[0].step == 0  # the prefill's token
    c = counts(marks)
    assert c["accepted"] == m.accepted
    assert c["plain"] == m.plain_steps + 1
    drafting_steps = {k.step for k in marks if k.kind != "plain"}
    assert len(drafting_steps) == m.steps
    by_step: dict[int, list] = {}
    for k in marks:
        by_step.setdefault(k.step, []).append(k)
    for _step, ks in by_step.items():
        if ks[0].kind == "plain":
            assert len(ks) == 1 and ks[0].slot == 0 and ks[0].confidence is None
            continue
        # a drafting step: slots 1..a accepted, then (unless cut by a stop) the target's own token
        assert [k.slot for k in ks] == list(range(1, len(ks) + 1))
        assert all(k.kind == "accepted" for k in ks[:-1])
        for k in ks:
            if k.kind in ("accepted", "corrected"):
                assert k.confidence is None or 0.0 < k.confidence < 1.0
            if k.kind == "corrected":
                assert k.draft is not None and k.draft != k.token  # the target wrote another token
    return c


def test_marks_follow_every_step_and_sum_to_the_statistics(trained):
    model = trained["model"]
    engine = engine_for(model, build_draft(trained["spec"], model, trained["tensors"]))
    seen = dict.fromkeys(KINDS, 0)
    for p in PROMPTS:
        req = engine.generate(p, SamplingParams(max_new_tokens=60), marks=True)
        assert req.output_ids == hf_greedy(model, p, 60)  # recording changes nothing decoded
        for k, n in check_marks(req).items():
            seen[k] += n
    assert seen["accepted"] > 0 and seen["corrected"] + seen["bonus"] > 0
    plain = engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=8))
    assert plain.marks is None  # opt-in: a request that did not ask records nothing


def test_a_stop_inside_the_accepted_drafts_counts_what_the_request_got(trained):
    """A stop token among accepted drafts cuts the step: the request's statistics count only the
    tokens it received, so they agree with its marks (and accepted <= completion tokens)."""
    model = trained["model"]
    engine = engine_for(model, build_draft(trained["spec"], model, trained["tensors"]))
    ref = engine.generate(PROMPTS[2], SamplingParams(max_new_tokens=60), marks=True)
    ids, marks = ref.output_ids, ref.marks
    # an accepted draft followed by another accepted one of its step, at the token's first occurrence
    cut = [
        i
        for i in range(len(marks) - 1)
        if marks[i].kind == marks[i + 1].kind == "accepted"
        and marks[i].step == marks[i + 1].step
        and ids.index(ids[i]) == i
    ]
    assert cut, "the trained draft accepts two slots of a step somewhere"
    i = cut[0]
    req = engine.generate(PROMPTS[2], SamplingParams(max_new_tokens=60, stop_token_ids=(ids[i],)), marks=True)
    assert req.output_ids == ids[: i + 1] and req.finish_reason == "stop"
    assert req.marks[-1].kind == "accepted"  # the step's later drafts and its target token never reached it
    check_marks(req)
    assert req.metrics.accepted <= len(req.output_ids)


def test_sampled_requests_mark_their_tokens_too(trained):
    model = trained["model"]
    engine = engine_for(model, build_draft(trained["spec"], model, trained["tensors"]))
    req = engine.generate(PROMPTS[1], SamplingParams(max_new_tokens=40, temperature=0.8, seed=3), marks=True)
    check_marks(req)
    again = engine.generate(PROMPTS[1], SamplingParams(max_new_tokens=40, temperature=0.8, seed=3))
    assert again.output_ids == req.output_ids  # the same seed decodes the same with or without marks


# ---- texts --------------------------------------------------------------------------------------
def test_token_texts_join_to_the_text_streamed_and_to_the_final_one():
    """Each mark's text is what its token added: joined per step they are the stream, joined at
    the end the completion (a stop string's cut included, multi-byte characters whole)."""
    engine = tiny_engine()
    ids = engine.encode("Once upon a time")
    for stop in ((), (" the",), ("e",)):
        pieces, streamed = TextPieces(), []

        def on_tokens(req, _new, pieces=pieces, streamed=streamed):
            if not req.finished:
                streamed.extend(pieces.take(req))
                assert "".join(k.text for k in streamed) == req.stream_text()

        req = engine.generate(ids, SamplingParams(max_new_tokens=40, stop=stop), on_tokens=on_tokens, marks=True)
        streamed.extend(pieces.take(req))
        assert "".join(k.text for k in streamed) == req.text
        assert [k.token for k in streamed] == req.output_ids
        fresh = TextPieces().take(req)  # read after the fact: the same cut per token at the end
        assert "".join(k.text for k in fresh) == req.text


# ---- the server's stream extension -----------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    s = LiveServer(create_app(tiny_engine(), model_name="tiny", api_key="k"))
    yield s
    s.close()


def _stream(server, body):
    text, marks, spec, chunks = "", [], None, []
    with server.http.stream("POST", "/v1/chat/completions", json=body, headers={"Authorization": "Bearer k"}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            chunks.append(obj)
            if obj["choices"] and obj["choices"][0]["delta"].get("content"):
                text += obj["choices"][0]["delta"]["content"]
            marks += obj.get("dspark", {}).get("tokens", [])
            spec = obj.get("speculative") or spec
    return text, marks, spec, chunks


def test_the_stream_carries_marks_only_when_asked(server):
    base = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "max_tokens": 30,
        "temperature": 0,
        "stream": True,
    }
    text, marks, spec, chunks = _stream(server, {**base, "dspark": {"marks": True}})
    assert "".join(m["text"] for m in marks) == text and len(marks) == 30
    for c in chunks:  # each chunk's marks are exactly its text
        if "dspark" in c:
            assert "".join(m["text"] for m in c["dspark"]["tokens"]) == c["choices"][0]["delta"].get("content", "")
    kinds = {k: sum(m["kind"] == k for m in marks) for k in KINDS}
    assert kinds["accepted"] == spec["accepted_tokens"] and kinds["plain"] == spec["plain_steps"] + 1
    assert len({m["step"] for m in marks if m["kind"] != "plain"}) == spec["verify_steps"]
    assert all(m["draft_text"] is not None for m in marks if m["kind"] == "corrected")
    plain_text, plain_marks, _, plain_chunks = _stream(server, base)
    assert plain_text == text and plain_marks == [] and not any("dspark" in c for c in plain_chunks)
    # the whole body too, without streaming
    r = server.http.post(
        "/v1/chat/completions",
        json={**base, "stream": False, "dspark": {"marks": True}},
        headers={"Authorization": "Bearer k"},
    ).json()
    assert "".join(m["text"] for m in r["dspark"]["tokens"]) == r["choices"][0]["message"]["content"] == text


def test_openai_clients_see_what_they_saw_before(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=12, temperature=0, stream=True
    )
    chunks = list(stream)
    assert all("dspark" not in (c.model_extra or {}) for c in chunks)
    marked = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=12,
        temperature=0,
        extra_body={"dspark": {"marks": True}},
    )
    tokens = marked.model_extra["dspark"]["tokens"]
    assert "".join(t["text"] for t in tokens) == marked.choices[0].message.content
    assert marked.choices[0].message.content == "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    client.close()


@pytest.mark.parametrize(
    "value, says",
    [
        ("yes", "must be an object"),
        ({"marks": 1}, "must be true or false"),
        ({"mark": True}, "not a dspark option"),
    ],
)
def test_a_malformed_marks_option_is_a_400_naming_it(server, value, says):
    r = server.http.post(
        "/v1/completions", json={"model": "tiny", "prompt": "x", "dspark": value}, headers={"Authorization": "Bearer k"}
    )
    assert (
        r.status_code == 400
        and says in r.json()["error"]["message"]
        and r.json()["error"]["param"].startswith("dspark")
    )


def test_the_page_and_its_stats_respect_the_key(server):
    page = server.http.get("/")  # static, holds nothing: served without the key
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "script-src 'self'" in page.headers["content-security-policy"]  # no inline script can run
    assert server.http.get("/static/page.js").status_code == 200
    # nothing outside the static folder: without the key the unknown path is a 401 (the key comes
    # before routing, docs/SERVER.md), with it a 404
    assert server.http.get("/static/../app.py").status_code == 401
    assert server.http.get("/static/../app.py", headers={"Authorization": "Bearer k"}).status_code == 404
    assert server.http.get("/v1/dspark/stats").status_code == 401
    s = server.http.get("/v1/dspark/stats", headers={"Authorization": "Bearer k"}).json()
    assert s["model"] == "tiny" and s["speculative"] and s["gamma"] == 4
    assert len(s["conditional_accept_rates"]) == 4 and s["generated_tokens"] >= 0


# ---- the terminal ---------------------------------------------------------------------------
def test_generate_show_drafts(saved, capsys, monkeypatch):  # noqa: F811
    target, draft = saved
    args = [
        "generate",
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--dtype",
        "fp32",
        "--device",
        "cpu",
        "--prompt",
        "Name three rivers.",
        "--chat",
        "--max-new-tokens",
        "16",
        "--no-check",
        "--verify",
        "full",
    ]
    assert main(args + ["--json"]) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(args + ["--json", "--show-drafts"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["text"] == plain["text"] and "".join(t["text"] for t in out["tokens"]) == out["text"]
    assert sum(out["token_kinds"].values()) == out["generated_tokens"]
    assert out["token_kinds"]["accepted"] == out["metrics"]["accepted_tokens"]
    assert main(args + ["--show-drafts"]) == 0  # not a terminal (captured): the text, no colour codes
    text = capsys.readouterr().out
    assert text.startswith(out["text"]) and "\x1b[" not in text and "tokens by origin" in text
    monkeypatch.setenv("FORCE_COLOR", "1")  # a colour terminal: each kind in its colour, the same text
    assert main(args + ["--show-drafts"]) == 0
    coloured = capsys.readouterr().out
    streamed = coloured.split("dspark generate")[0]  # the answer, before the summary table
    assert re.sub(r"\x1b\[[0-9;]*m", "", streamed).rstrip().startswith(out["text"].rstrip())
    kinds = out["token_kinds"]
    for kind, code in (("accepted", "\x1b[30;42m"), ("corrected", "\x1b[37;41m"), ("bonus", "\x1b[30;46m")):
        assert (code in streamed) == bool(kinds[kind]), kind
