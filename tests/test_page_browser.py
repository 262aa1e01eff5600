"""Issue 35's proof: the page `dspark serve` shows at `/`, driven in headless Chromium (tests/browser.py).

The server runs in this process on 127.0.0.1 (tests/test_serve.py's tiny target with SmolLM2's
tokenizer and a tiny draft). A prompt typed into the page streams an answer whose marked tokens
must join to exactly the completion the API returns for the same request, in the numbers the
response's own speculative statistics give; model output with HTML in it must show as text."""

from __future__ import annotations

import pytest
from dspark.serve.app import create_app

from tests.browser import CHROMIUM, MISSING, Browser
from tests.test_serve import LiveServer, tiny_engine

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason=MISSING)
KEY = "page-key"
AUTH = {"Authorization": f"Bearer {KEY}"}

ANSWER = """(() => {
  const b = [...document.querySelectorAll('.msg.assistant')].pop();
  if (!b || !b.dataset.done) return null;
  const body = b.querySelector('.body');
  return {text: b.dataset.text === undefined ? null : b.dataset.text,
          spec: b.dataset.spec ? JSON.parse(b.dataset.spec) : null,
          error: b.classList.contains('error') ? b.textContent : null,
          elements: [...body.querySelectorAll('*')].map(e => e.tagName + '.' + e.className),
          tokens: [...body.querySelectorAll('.tok')].map(t => ({text: t.textContent, kind: t.dataset.kind,
                   step: +t.dataset.step, slot: +t.dataset.slot, title: t.title}))};
})()"""


def ask(page, prompt: str, max_tokens: int) -> None:
    page.eval(f"""(() => {{
      document.getElementById('max_tokens').value = '{max_tokens}';
      document.getElementById('prompt').value = {prompt!r};
      document.getElementById('send').click();
    }})()""")


def reference(server, prompt: str, max_tokens: int) -> dict:
    """The same request the page sends, through the API without streaming."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "dspark": {"marks": True},
    }
    return server.http.post("/v1/chat/completions", json=body, headers=AUTH).raise_for_status().json()


@pytest.fixture(scope="module")
def server():
    s = LiveServer(create_app(tiny_engine(), model_name="tiny", api_key=KEY))
    yield s
    s.close()


@pytest.fixture
def browser(tmp_path):
    b = Browser(str(tmp_path / "profile"))
    yield b
    b.close()


def test_the_page_streams_marked_tokens_that_join_to_the_completion(server, browser, tmp_path):
    page = browser.page(server.url + "/")
    # the server has a key: the page asks for it before anything else works
    page.wait("!document.getElementById('keyform').hidden")
    page.eval(f"document.getElementById('key').value = {KEY!r}; document.getElementById('keyform').requestSubmit()")
    page.wait("document.getElementById('model').textContent.startsWith('tiny')")
    prompt, n = "Tell me about rivers.", 40
    ask(page, prompt, n)
    got = page.wait(ANSWER)
    assert got["error"] is None, got["error"]
    ref = reference(server, prompt, n)
    text = ref["choices"][0]["message"]["content"]
    assert got["text"] == text  # what the page received is the API's completion
    assert "".join(t["text"] for t in got["tokens"]) == text  # and its marked tokens are exactly that text
    assert len(got["tokens"]) == ref["usage"]["completion_tokens"]
    spec, kinds = got["spec"], [t["kind"] for t in got["tokens"]]
    assert kinds.count("accepted") == spec["accepted_tokens"]
    assert kinds.count("plain") == spec["plain_steps"] + 1
    assert len({t["step"] for t in got["tokens"] if t["kind"] != "plain"}) == spec["verify_steps"]
    assert [t["kind"] for t in ref["dspark"]["tokens"]] == kinds
    # hovering a token names its step and slot (and, drafted, the draft's confidence)
    drafted = [t for t in got["tokens"] if t["kind"] in ("accepted", "corrected")]
    assert drafted and all(
        f"step {t['step']}" in t["title"] and f"slot {t['slot']}" in t["title"] and "draft confidence" in t["title"]
        for t in drafted
    )
    # the live panel reads the server's own counters
    page.wait("Number(document.getElementById('s_tokens').textContent) >= " + str(2 * n))
    assert page.eval("document.querySelectorAll('#s_positions .bar').length") == 4  # gamma
    assert page.eval("document.getElementById('s_policy').textContent") != ""
    page.screenshot(tmp_path / "page.png")
    assert (tmp_path / "page.png").stat().st_size > 10_000
    assert browser.console == []


def test_several_tabs_at_once(server, browser):
    pages = [browser.page(server.url + "/") for _ in range(3)]
    for page in pages:  # a key typed in one tab is this tab's (sessionStorage): each types it
        page.eval(f"document.getElementById('key').value = {KEY!r}; document.getElementById('keyform').requestSubmit()")
    prompts = ["Name a colour.", "Count to five.", "Say hello."]
    for page, prompt in zip(pages, prompts):
        ask(page, prompt, 24)  # all three in flight together
    for page, prompt in zip(pages, prompts):
        got = page.wait(ANSWER)
        assert got["error"] is None, got["error"]
        assert got["text"] == reference(server, prompt, 24)["choices"][0]["message"]["content"]
        assert "".join(t["text"] for t in got["tokens"]) == got["text"]


class HTMLTokenizer:
    """SmolLM2's tokenizer for prompts, but every output token decodes to a piece of HTML: what a
    model may write, and the page must show as text."""

    PIECES = (
        "<script>window.pwned = 1</script>",
        '<img src=x onerror="window.pwned = 2">',
        "<b>bold</b>",
        " &amp; &lt;i&gt;",
        "\"'`",
        "<style>body{display:none}</style>",
        " plain",
    )

    def __init__(self, tok):
        self._tok = tok

    def __getattr__(self, name):
        if name.startswith("__"):  # copy's protocol probes: this class's own (below)
            raise AttributeError(name)
        return getattr(self._tok, name)

    def __deepcopy__(self, memo):  # the server's prompt thread works on a copy of the tokenizer
        import copy

        return HTMLTokenizer(copy.deepcopy(self._tok, memo))

    def __len__(self):
        return len(self._tok)

    def __call__(self, *args, **kwargs):
        return self._tok(*args, **kwargs)

    def decode(self, ids, skip_special_tokens: bool = True, **_):
        special = set(self._tok.all_special_ids) if skip_special_tokens else set()
        return "".join(self.PIECES[i % len(self.PIECES)] for i in ids if i not in special)


def test_html_in_a_completion_renders_as_text(browser):
    engine = tiny_engine()
    engine.tokenizer = HTMLTokenizer(engine.tokenizer)
    s = LiveServer(create_app(engine, model_name="tiny"))
    try:
        page = browser.page(s.url + "/")
        ask(page, "Write some HTML.", 30)
        got = page.wait(ANSWER)
        assert got["error"] is None, got["error"]
        assert "<script>" in got["text"] and "<img" in got["text"]
        assert "".join(t["text"] for t in got["tokens"]) == got["text"]
        assert all(e.startswith("SPAN.tok ") for e in got["elements"])  # no element the model wrote
        assert page.eval("window.pwned === undefined")
        assert page.eval("getComputedStyle(document.body).display") != "none"
    finally:
        s.close()
