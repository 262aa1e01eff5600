"""Prompt -> token ids and the context check, before a request reaches the engine thread.

The engine thread decodes every request in the batch: a prompt tokenized there stalls all of
them for as long as tokenizing takes. So handlers tokenize here, on a small pool of threads
(off the event loop too), each with its own copy of the tokenizer: a tokenizer is not safe to
share between threads, and the engine thread keeps the original for detokenizing. Only a
request whose prompt fits the context is submitted to the worker.

Before tokenizing, a bound that costs nothing: no token covers more characters than the
vocabulary's longest entry, so a prompt longer than context * that many characters cannot fit
and is refused without being tokenized (so is a chat of more messages than context tokens).
"""

from __future__ import annotations

import asyncio
import copy
import queue
from concurrent.futures import ThreadPoolExecutor
from typing import cast

from dspark.errors import DSparkError
from dspark.serve.protocol import GenRequest, Messages, bad, default_max_tokens, quote
from dspark.target.text import encode_prompt

try:
    from jinja2 import TemplateError as _JinjaTemplateError

    TEMPLATE_ERRORS: tuple[type[Exception], ...] = (_JinjaTemplateError,)
except ImportError:  # no jinja2: transformers cannot render chat templates either
    TEMPLATE_ERRORS = ()

TOKENIZER_THREADS = 2  # a long prompt being tokenized leaves a thread for the next short one
NORMALIZER_SLACK = 4  # a normalizer (NFC, NFKC) can compose several characters into one


def max_chars_per_token(tokenizer) -> int:
    """An upper bound on the characters one token covers: the longest vocabulary entry
    (byte-level entries count bytes, which is at least the characters), special tokens included."""
    longest = max(1, max(map(len, tokenizer.get_vocab()), default=1))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return longest * NORMALIZER_SLACK if getattr(backend, "normalizer", None) is not None else longest


def prompt_chars(req: GenRequest) -> int:
    if req.kind == "chat":
        return sum(len(m["content"]) for m in cast(Messages, req.prompt))  # a chat request holds messages
    return len(req.prompt)


class PromptEncoder:
    def __init__(self, engine, threads: int = TOKENIZER_THREADS):
        # Only the engine's admission arithmetic (room) is used here, never its mutable state.
        self.engine = engine
        self.context, self.vocab_size = engine.target.max_length, engine.target.vocab_size
        self.chars_per_token = max_chars_per_token(engine.tokenizer)
        self.max_chars = self.context * self.chars_per_token
        # Copied now, before the engine thread starts using the original.
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(threads):
            self._free.put(copy.deepcopy(engine.tokenizer))
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None

    def start(self) -> None:
        """With the app's lifespan, like the worker: an app can be served more than once."""
        self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="dspark-tokenize")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    async def encode(self, req: GenRequest) -> tuple[list[int], int]:
        """The prompt's token ids and max_tokens (the endpoint's default resolved), or a 400."""
        ids: list[int]
        if req.kind == "completion" and isinstance(req.prompt, tuple):
            ids = list(cast(tuple[int, ...], req.prompt))  # a completion's tuple is token ids
        else:
            self._check_chars(req)
            ids = await asyncio.get_running_loop().run_in_executor(self._pool, self._tokenize, req)
        return ids, self._fit(req, ids)

    def _check_chars(self, req: GenRequest) -> None:
        # a chat template adds at least a role header per message: empty contents still cost tokens
        if req.kind == "chat" and len(req.prompt) > self.context:
            raise bad(
                "messages",
                f"messages holds {len(req.prompt)} messages: more than the model's context of "
                f"{self.context} tokens can hold (each message adds at least one token)",
            )
        n = prompt_chars(req)
        if n > self.max_chars:
            raise bad(
                req.prompt_param,
                f"the prompt is {n} characters: more than the model's context of "
                f"{self.context} tokens can hold (at most {self.chars_per_token} characters a token, "
                f"{self.max_chars} in all)",
            )

    def _tokenize(self, req: GenRequest) -> list[int]:
        """On a pool thread; one tokenizer copy per call in flight (there are as many as threads)."""
        tok = self._free.get()
        chat = req.kind == "chat"
        try:
            return list(encode_prompt(tok, list(req.prompt) if chat else req.prompt, chat))
        except DSparkError as err:  # a target without a chat template
            raise bad(req.prompt_param, str(err)) from None
        except TEMPLATE_ERRORS as err:  # the template's own refusal, e.g. roles that do not alternate
            raise bad("messages", f"the chat template refused these messages: {quote(str(err), 200)}") from None
        finally:
            self._free.put(tok)

    def _fit(self, req: GenRequest, ids: list[int]) -> int:
        """The context check, by the engine's own admission rule; returns max_tokens."""
        if not ids:
            raise bad(req.prompt_param, "the prompt is empty after tokenization")
        top = max(ids)
        if top >= self.vocab_size:
            raise bad("prompt", f"prompt token id {quote(top)} is outside the vocabulary [0, {self.vocab_size})")
        ctx, reserve = self.context, self.engine.gamma + 1
        room = self.engine.room(len(ids))
        if room < 1:
            raise bad(
                req.prompt_param,
                f"the prompt is {len(ids)} tokens but the model's context is {ctx} "
                f"tokens, {reserve} of which are reserved for the draft block: no room for any output",
            )
        max_tokens = req.max_tokens if req.max_tokens is not None else default_max_tokens(req, room)
        if max_tokens > room:
            raise bad(
                req.max_tokens_param,
                f"{req.max_tokens_param} is {max_tokens}, but with a {len(ids)}-token "
                f"prompt and {reserve} tokens reserved for the draft block only {room} fit in the "
                f"model's context of {ctx}",
            )
        return max_tokens
