"""Token ids -> text, incrementally, with stop strings: the one detokenizer of the engine, the
CLI's streaming and the server.

Decoding the whole output at every step costs O(length) per step. Instead each update decodes
a small window that starts at the tokens of the previous update (prefix_offset) and subtracts
the decode of its old part: a tokenizer that drops a leading space at the start of a decode does
so in both, so the difference is exactly the new text. A trailing U+FFFD is a multi-byte
character still incomplete: its text waits for the remaining bytes.
"""

from __future__ import annotations


class Detokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.text = ""  # complete characters decoded so far
        self.prefix_offset = self.read_offset = 0
        self._searched = 0  # stop strings cannot start before this character any more
        self._stop_at: int | None = None
        # a stop string may still be completing: streaming never hands out its possible first characters
        self.holdback = max((len(s) for s in self.stop), default=1) - 1

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update(self, ids: list[int]) -> str:
        """Extend `text` with what ids[read_offset:] add; returns the new text ('' while incomplete)."""
        if len(ids) <= self.read_offset:
            return ""
        prefix = self.decode(ids[self.prefix_offset : self.read_offset])
        full = self.decode(ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd") and full.startswith(prefix):
            new = full[len(prefix) :]
            self.text += new
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
            return new
        return ""

    def find_stop(self) -> int | None:
        """Index in `text` of the earliest stop string, or None. Only the new text (plus the
        characters a stop string could straddle) is searched, so a long output costs nothing extra."""
        if self._stop_at is None:
            hits = [i for s in self.stop if (i := self.text.find(s, self._searched)) >= 0]
            self._searched = max(0, len(self.text) - self.holdback)
            self._stop_at = min(hits) if hits else None
        return self._stop_at

    def streamable(self) -> str:
        """The text that can be shown while decoding goes on (a stop string's possible start held back)."""
        return self.text[: max(0, len(self.text) - self.holdback)]
