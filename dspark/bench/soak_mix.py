"""The soak's request mix: a pure function of (seed, index), so a run can be repeated exactly and a
`--seconds` run draws as many requests as it has time for. Every request says what answer it
expects: 200 for a well-formed one, the exact 4xx for a malformed one; a client that disconnects
mid-stream expects nothing. The soak itself: dspark.bench.soak."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from dspark.errors import DSparkError

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
JSON_TYPE = "application/json"

SHORT_PROMPTS = (
    "Explain why the sky is blue in two sentences.",
    "Write a Python function that reverses a list.",
    "What is 17 times 23?",
    "Give three tips for writing clear emails.",
    "List the planets of the solar system in order.",
    "Translate 'good morning' into French.",
    "Write a haiku about autumn rain.",
    "Why do we have seasons on Earth?",
    "Describe how a bicycle works.",
    "What are prime numbers?",
    "Once upon a time",
    "def fibonacci(n):",
)
# Long prompts are built from these sentences, in an order fixed by the prompt's index.
SENTENCES = (
    "The river bends twice before it reaches the old mill at the edge of the village.",
    "Every morning the baker lights the oven an hour before sunrise.",
    "A binary search halves the interval that can still hold the answer at every step.",
    "The committee met on Tuesday to discuss the budget for the coming year.",
    "Light from the sun is scattered by the molecules of the air, blue more than red.",
    "She kept a notebook of every bird she saw along the coast that summer.",
    "The train to the capital leaves at seven and arrives shortly after noon.",
    "A function that calls itself needs a case in which it stops.",
    "The museum's new wing holds paintings from the last two centuries.",
    "Rain fell steadily through the night and the streets were quiet.",
)
LONG_PROMPTS = 4
GREEDY_SHARE, STREAM_SHARE, CHAT_SHARE, LONG_SHARE = 0.5, 0.5, 0.5, 0.25
# the long-prompt client: prompts that fill most of the context, whose prefill the short requests
# beside them must not wait for (chunked prefill); their share of the well-formed requests
HUGE_SHARE = 0.03
SAMPLED = {"temperature": 0.8, "top_p": 0.95}


@dataclass(frozen=True)
class Call:
    """One request of the mix and the answer it expects."""

    index: int
    path: str
    body: bytes
    expect: int | None  # the HTTP status it must get; None: the client leaves mid-stream
    label: str  # what it is: "chat stream greedy long", "malformed:bad_json", ...
    stream: bool = False
    content_type: str | None = JSON_TYPE
    declared_length: int | None = None  # a Content-Length that lies (the 413 case)
    greedy_key: str | None = None  # identifies a greedy request for the solo comparison
    solo_body: bytes | None = None  # that request, not streamed: what is sent alone afterwards

    @property
    def malformed(self) -> bool:
        return self.label.startswith("malformed:")


@dataclass(frozen=True)
class MixSettings:
    model: str
    context: int  # the model's context in tokens: long prompts and the over-long case follow it
    max_tokens: int = 32
    malformed_share: float = 0.1
    disconnect_share: float = 0.1
    seed: int = 0
    huge_share: float = HUGE_SHARE  # prompts that fill most of the context (`huge_words`)

    def __post_init__(self):
        check_mix(self.max_tokens, self.malformed_share, self.disconnect_share)
        if not 0 <= self.huge_share <= 1:
            raise DSparkError(f"the long-prompt share must be in [0, 1], got {self.huge_share}")


def check_mix(max_tokens: int, malformed_share: float, disconnect_share: float) -> None:
    if max_tokens < 4:  # the mix asks for a quarter of it
        raise DSparkError(f"--max-tokens must be >= 4, got {max_tokens}")
    if not (0 <= malformed_share and 0 <= disconnect_share and malformed_share + disconnect_share <= 1):
        raise DSparkError("the malformed and disconnect shares must be >= 0 and add up to at most 1")


def long_prompt(i: int, words: int) -> str:
    """A prompt of about `words` words, the same for the same (i, words)."""
    order = list(SENTENCES)
    random.Random(f"long:{i}").shuffle(order)
    out: list[str] = []
    while sum(len(s.split()) for s in out) < words:
        out.append(order[len(out) % len(order)])
    return " ".join(out)


def long_words(context: int, max_tokens: int) -> int:
    """Long prompts take about a quarter of what the context leaves after the output, and at
    most 400 words: English runs at about 1.3 tokens a word and a chat template adds a few
    dozen, so this always fits and is long next to the short prompts."""
    return max(16, min(400, (context - max_tokens) // 4))


def huge_words(context: int, max_tokens: int) -> int:
    """A prompt that fills most of the context: about 60 % of what the output leaves, at 1.3 tokens a
    word and a chat template's few dozen more (every prompt of the mix fits)."""
    return max(16, int(0.6 * (context - max_tokens - 64) / 1.3))


def malformed_cases(model: str, context: int) -> list[tuple[str, str, bytes, int, dict]]:
    """(name, path, body, expected status, extra Call fields): each a mistake a real client makes."""
    ok_chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    def js(d: dict) -> bytes:
        return json.dumps(d).encode()

    return [
        ("bad_json", CHAT, b'{"model": "' + model.encode() + b'", "messages": [', 400, {}),
        ("not_an_object", COMPLETIONS, b'["a prompt"]', 400, {}),
        ("max_tokens_string", COMPLETIONS, js({"model": model, "prompt": "hi", "max_tokens": "ten"}), 400, {}),
        (
            "max_tokens_past_context",
            COMPLETIONS,
            js({"model": model, "prompt": "hi", "max_tokens": context + 1}),
            400,
            {},
        ),
        ("temperature_too_high", CHAT, js({**ok_chat, "temperature": 7}), 400, {}),
        ("unknown_model", CHAT, js({**ok_chat, "model": model + "-nope"}), 404, {}),
        ("empty_messages", CHAT, js({**ok_chat, "messages": []}), 400, {}),
        ("bad_role", CHAT, js({**ok_chat, "messages": [{"role": "robot", "content": "hi"}]}), 400, {}),
        ("n_is_3", CHAT, js({**ok_chat, "n": 3}), 400, {}),
        ("logprobs", COMPLETIONS, js({"model": model, "prompt": "hi", "logprobs": 5}), 400, {}),
        ("token_id_outside_vocab", COMPLETIONS, js({"model": model, "prompt": [1 << 40], "max_tokens": 4}), 400, {}),
        (
            "lone_surrogate",
            CHAT,
            b'{"model": "' + model.encode() + b'", "messages": [{"role": "user", '
            b'"content": "\\ud800"}], "max_tokens": 4}',
            400,
            {},
        ),
        ("text_plain", COMPLETIONS, js({"model": model, "prompt": "hi"}), 415, {"content_type": "text/plain"}),
        ("content_length_1gib", COMPLETIONS, b"{}", 413, {"declared_length": 1 << 30}),
        ("unknown_route", "/v1/embeddings", js({"model": model, "input": "hi"}), 404, {}),
    ]


def make_call(settings: MixSettings, index: int) -> Call:
    """Request `index` of the mix: a pure function of the settings and the index."""
    rng = random.Random(f"{settings.seed}:{index}")
    roll = rng.random()
    if roll < settings.malformed_share:
        name, path, raw, status, extra = rng.choice(malformed_cases(settings.model, settings.context))
        return Call(index, path, raw, status, f"malformed:{name}", **extra)
    disconnect = roll < settings.malformed_share + settings.disconnect_share
    chat = rng.random() < CHAT_SHARE
    long = rng.random() < LONG_SHARE
    huge = not disconnect and rng.random() < settings.huge_share
    greedy = disconnect or rng.random() < GREEDY_SHARE
    stream = disconnect or rng.random() < STREAM_SHARE
    m = settings.max_tokens
    # a client that leaves mid-stream asks for the most tokens, so that it is still streaming
    max_tokens = m if disconnect else rng.choice((m // 4, m // 2, m))
    if huge:
        text = long_prompt(rng.randrange(LONG_PROMPTS), huge_words(settings.context, m))
    elif long:
        text = long_prompt(rng.randrange(LONG_PROMPTS), long_words(settings.context, m))
    else:
        text = rng.choice(SHORT_PROMPTS)
    body: dict = {"model": settings.model, "max_tokens": max_tokens}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    body.update({"temperature": 0} if greedy else {**SAMPLED, "seed": rng.randrange(1 << 31)})
    solo = json.dumps(body, sort_keys=True)
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    label = " ".join(
        w
        for w in (
            "chat" if chat else "completion",
            "stream" if stream else "",
            "greedy" if greedy else "sampled",
            "huge" if huge else "long" if long else "short",
            "disconnect" if disconnect else "",
        )
        if w
    )
    return Call(
        index,
        CHAT if chat else COMPLETIONS,
        json.dumps(body).encode(),
        None if disconnect else 200,
        label,
        stream=stream,
        greedy_key=solo if greedy and not disconnect else None,
        solo_body=solo.encode() if greedy and not disconnect else None,
    )


def numbered_calls(mix: MixSettings, start: int, count: int | None):
    """Requests start, start+1, ... of the mix: `count` of them, or without end when None."""
    i = start
    while count is None or i < start + count:
        yield make_call(mix, i)
        i += 1
