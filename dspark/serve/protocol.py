"""OpenAI wire format: validate request bodies, build response bodies and stream chunks.

Validation is done by hand rather than with pydantic models so that every rejection is an
OpenAI-style error object whose `param` names the offending field, and so that JSON's loose
corners (booleans passing as integers, NaN, 1.0 as a token count) are refused explicitly.
Fields this server does not implement are refused when set to anything but their default:
silently ignoring `logprobs` or a penalty would return something the client did not ask for.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from dspark.engine.sampling import MIN_TEMPERATURE, MIN_TOP_P

EXTENSION = "speculative"  # response field next to `usage`: per-request speculative-decoding statistics
MARKS = "dspark"  # opt-in request field {"marks": true}; the same field on chunks / bodies carries the marks
MARK_OPTIONS = ("marks",)
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
MAX_STOP_STRINGS = 4
CHAT_ROLES = ("system", "user", "assistant")
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed accepts
QUOTE_CHARS = 64  # the most of a user-supplied value an error message repeats

# field -> values that mean "not used"; anything else is refused (see module docstring)
_UNSUPPORTED_COMMON = {
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "best_of": (None, 1),
}
_UNSUPPORTED_COMPLETION = {
    "logprobs": (None, False),
    "echo": (None, False),
    "suffix": (None, ""),
    # not part of OpenAI's completions API, but a client asking for JSON output must learn it gets none
    "response_format": (None, {"type": "text"}),
}
_UNSUPPORTED_CHAT = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
}


class APIError(Exception):
    """An HTTP error in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(
        self, status: int, message: str, param: str | None = None, type_: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")
        self.counted = False  # set once the outcome is in /metrics, so it is never counted twice

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str) -> APIError:
    return APIError(400, message, param)


def quote(v, limit: int = QUOTE_CHARS) -> str:
    """A user-supplied value as JSON for an error message, cut after `limit` characters: an
    error must not echo a megabyte back (nor a control character or a lone surrogate raw)."""
    if isinstance(v, str):
        return json.dumps(v[:limit]) + (f"... ({len(v)} characters)" if len(v) > limit else "")
    try:
        s = json.dumps(v)
    except (ValueError, RecursionError):  # parsed within the recursion limit, dumped just past it
        return "a value nested too deeply to show"
    return s if len(s) <= limit else f"{s[:limit]}... ({len(s)} characters)"


def _text(param: str, s: str) -> str:
    """s, refused with 400 if it holds a lone surrogate: JSON's "\\ud800" escape decodes to one,
    and neither UTF-8 nor a tokenizer can encode it."""
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise bad(param, f"{param} is not valid Unicode text (lone surrogate)") from None
    return s


Messages = tuple[dict[str, str], ...]  # a chat request's {"role", "content"} messages


@dataclass(frozen=True)
class GenRequest:
    """One validated generation request, independent of the endpoint it came from."""

    kind: str  # "completion" | "chat"
    prompt: str | tuple[int, ...] | Messages  # text or token ids (completion), messages (chat)
    max_tokens: int | None  # None: the endpoint's default (see default_max_tokens)
    temperature: float = 1.0  # OpenAI's default
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk carrying usage
    max_tokens_param: str = "max_tokens"  # chat may spell it max_completion_tokens; errors name what was sent
    marks: bool = False  # "dspark": {"marks": true}: each token's origin in the stream (docs/SERVER.md)

    @property
    def prompt_param(self) -> str:
        return "messages" if self.kind == "chat" else "prompt"


def parse_json(raw: bytes) -> dict:
    def no_constants(name):
        raise ValueError(f"{name} is not valid JSON")

    try:
        body = json.loads(raw, parse_constant=no_constants, object_pairs_hook=_no_duplicate_keys)
    except ValueError as exc:  # includes UnicodeDecodeError
        raise bad(None, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad(None, "the request body nests too deeply") from None
    if not isinstance(body, dict):
        raise bad(None, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object, refused when a key repeats: parsers disagree on which value counts (Python's
    the last, others the first), so a proxy that checked one value may pass the other here."""
    obj: dict = {}
    for key, value in pairs:
        if key in obj:
            param = key if len(key) <= QUOTE_CHARS and key.isprintable() and _encodable(key) else None
            raise bad(param, f"the request body has the key {quote(key)} twice in one object: send it once")
        obj[key] = value
    return obj


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: an error body could not carry it
        return False
    return True


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    # an int is finite however long (math.isfinite would overflow converting 10**400 to a float)
    return _is_int(v) or (isinstance(v, float) and math.isfinite(v))


def _int(body: dict, name: str, lo: int, hi: int | None = None, default=None):
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise bad(name, f"{name} must be an integer, got {quote(v)}")
    if v < lo or (hi is not None and v > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise bad(name, f"{name} must be {bound}, got {quote(v)}")
    return v


def _number(body: dict, name: str, lo: float, hi: float, default: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_number(v):
        raise bad(name, f"{name} must be a finite number, got {quote(v)}")
    if v > hi or v < lo or (lo_open and v == lo):
        raise bad(name, f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {quote(v)}")
    return float(v)


def _temperature(body: dict) -> float:
    t = _number(body, "temperature", 0.0, 2.0, 1.0)
    if 0 < t < MIN_TEMPERATURE:  # engine.sampling.MIN_TEMPERATURE: a 400 naming the field, before the engine
        raise bad("temperature", f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {quote(t)}")
    return t


def _top_p(body: dict) -> float:
    # engine.sampling.MIN_TOP_P: a smaller top_p keeps the same tokens
    return max(_number(body, "top_p", 0.0, 1.0, 1.0, lo_open=True), MIN_TOP_P)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"{name} must be true or false, got {quote(v)}")
    return v


def _marks(body: dict) -> bool:
    """The opt-in extension: "dspark": {"marks": true}. Anything else under "dspark" is refused
    rather than ignored (a misspelt option would otherwise look like a server without marks)."""
    v = body.get(MARKS)
    if v is None:
        return False
    if not isinstance(v, dict):
        raise bad(MARKS, f'{MARKS} must be an object such as {{"marks": true}}, got {quote(v)}')
    for key in v:
        if key not in MARK_OPTIONS:
            raise bad(MARKS, f"{quote(key)} is not a {MARKS} option (known: {', '.join(MARK_OPTIONS)})")
    m = v.get("marks")
    if m is not None and not isinstance(m, bool):
        raise bad(f"{MARKS}.marks", f"{MARKS}.marks must be true or false, got {quote(m)}")
    return bool(m)


def _refuse_unsupported(body: dict, table: dict) -> None:
    for name, allowed in table.items():
        v = body.get(name)
        # False == 0 in Python: a bool only matches a bool (so "logprobs": 0 is refused)
        if v is None or any(v == a and isinstance(v, bool) == isinstance(a, bool) for a in allowed):
            continue
        raise bad(name, f"{name} is not supported by this server (got {quote(v)})")


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad("stop", "stop must be a string or a list of strings")
    if len(items) > MAX_STOP_STRINGS:
        raise bad("stop", f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(items)}")
    if any(s == "" for s in items):
        raise bad("stop", "stop strings must not be empty")
    return tuple(_text("stop" if isinstance(v, str) else f"stop[{k}]", s) for k, s in enumerate(items))


def _common(body: dict, kind: str, prompt, model_name: str, max_context: int, max_tokens_key: str = "max_tokens"):
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "model must be a string")
    if model is not None and _text("model", model) != model_name:
        raise APIError(
            404,
            f"the model {quote(model)} does not exist; this server serves {quote(model_name)}",
            "model",
            code="model_not_found",
        )
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise bad("n", f"only n = 1 is supported, got {quote(n)}")
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad("stream_options", "stream_options must be an object")
    include_usage = _bool(opts or {}, "include_usage")
    # the context bound here is only the cheap early check; the exact one (prompt + max_tokens
    # + the draft's block) needs the tokenized prompt and is made by the worker
    max_tokens = _int(body, max_tokens_key, 1, max_context)
    return GenRequest(
        kind=kind,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=_temperature(body),
        top_p=_top_p(body),
        # -1 is vLLM's spelling of "off"
        top_k=max(0, _int(body, "top_k", -1, default=0)),
        seed=_int(body, "seed", SEED_RANGE[0], SEED_RANGE[1]),
        stop=_stop(body),
        stream=stream,
        include_usage=include_usage,
        max_tokens_param=max_tokens_key,
        marks=_marks(body),
    )


def _completion_prompt(body: dict):
    if "prompt" not in body or body["prompt"] is None:
        raise bad("prompt", "prompt is required")
    p = body["prompt"]
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        if len(p) != 1:
            raise bad("prompt", f"batched prompts are not supported: send one prompt per request (got {len(p)})")
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise bad("prompt", "prompt must not be empty")
        return _text("prompt", p)
    if isinstance(p, list) and all(_is_int(x) for x in p):
        if not p:
            raise bad("prompt", "prompt must not be empty")
        if min(p) < 0:
            raise bad("prompt", "prompt token ids must be >= 0")
        return tuple(p)
    raise bad("prompt", "prompt must be a string or a list of token ids")


def _content(i: int, content) -> str:
    if isinstance(content, str):
        return _text(f"messages[{i}].content", content)
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(
                    f"messages[{i}].content[{j}]",
                    'only text content parts ({"type": "text", "text": ...}) are supported',
                )
            parts.append(_text(f"messages[{i}].content[{j}].text", part["text"]))
        return "".join(parts)
    raise bad(f"messages[{i}].content", "content must be a string or a list of text parts")


def _messages(body: dict) -> tuple[dict, ...]:
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        raise bad("messages", "messages must be a list of {role, content} objects")
    if not msgs:
        raise bad("messages", "messages must not be empty")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", "each message must be an object with role and content")
        if m.get("role") not in CHAT_ROLES:
            raise bad(f"messages[{i}].role", f"role must be one of {', '.join(CHAT_ROLES)}, got {quote(m.get('role'))}")
        out.append({"role": m["role"], "content": _content(i, m.get("content"))})
    return tuple(out)


def parse_completion(body: dict, *, model_name: str, max_context: int) -> GenRequest:
    _refuse_unsupported(body, {**_UNSUPPORTED_COMMON, **_UNSUPPORTED_COMPLETION})
    return _common(body, "completion", _completion_prompt(body), model_name, max_context)


def parse_chat(body: dict, *, model_name: str, max_context: int) -> GenRequest:
    _refuse_unsupported(body, {**_UNSUPPORTED_COMMON, **_UNSUPPORTED_CHAT})
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return _common(body, "chat", _messages(body), model_name, max_context, key)


def default_max_tokens(req: GenRequest, room: int) -> int:
    """Completions default to 16 tokens (OpenAI); chat runs to the end of the context (OpenAI)."""
    return min(COMPLETION_DEFAULT_MAX_TOKENS, room) if req.kind == "completion" else room


# ---- responses ---------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def response_body(
    req: GenRequest,
    rid: str,
    created: int,
    model: str,
    text: str,
    finish: str,
    use: dict,
    spec: dict | None,
    marks: list[dict] | None = None,
) -> dict:
    if req.kind == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    body = {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": use,
        EXTENSION: spec,
    }
    if marks is not None:
        body[MARKS] = {"tokens": marks}
    return body


def chunk(
    req: GenRequest,
    rid: str,
    created: int,
    model: str,
    *,
    text: str | None = None,
    role: bool = False,
    finish: str | None = None,
    marks: list[dict] | None = None,
) -> dict:
    if req.kind == "chat":
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
    if marks is not None:  # only on requests that asked: other clients see OpenAI's chunk unchanged
        out[MARKS] = {"tokens": marks}
    return out


def usage_chunk(req: GenRequest, rid: str, created: int, model: str, use: dict, spec: dict | None) -> dict:
    """OpenAI's stream_options.include_usage chunk: no choices, usage set (plus our extension)."""
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use, EXTENSION: spec}


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
