"""Per-token marks: where each committed token of a request came from (docs/SERVER.md "Draft marks").

A drafting step commits the drafts the target accepted, then one token of the target's own: the
correction of the first rejected draft, or, when every verified draft was accepted, the bonus
token after them. A step that did not draft commits one plain target token (so does the prefill,
step 0). A token the lookup proposer proposed (copied from the prompt or the output so far,
engine/lookup.py) and the target accepted is marked "lookup"; its corrected or bonus token names
the source too. Recording is opt-in per request (Engine.add_request(marks=True)): the server's stream
extension, `dspark generate --show-drafts` and the page read it.

Texts: a mark's `text` is what its token added to the streamed text, so the texts of a request's
marks join to exactly its completion. A token whose bytes do not end a character yet adds "" and
the one that completes it carries the character; characters held back while a stop string may be
forming go to the token that released them; tokens past a stop string's cut add "".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from dspark.engine.detok import Detokenizer

KINDS = ("accepted", "lookup", "corrected", "bonus", "plain")


@dataclass(frozen=True)
class TokenMark:
    token: int
    kind: str  # one of KINDS
    step: int  # the request's decode step that committed it (0: the prefill's token)
    slot: int  # 1-based block slot the token fills (0: a plain step's token)
    confidence: float | None = None  # the draft's confidence for that slot (accepted / corrected)
    draft: int | None = None  # corrected: the draft's rejected token
    text: str = ""  # filled in by TextPieces
    source: str | None = None  # what proposed the step's tokens when it was not the draft: "lookup"

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def step_marks(
    step: int,
    committed: list[int],
    drafted: int,
    verified: int,
    accepted: int,
    drafts: list[int] | None,
    confidences: list[float] | None,
    source: str = "draft",
) -> list[TokenMark]:
    """The marks of one request's tokens committed by one decode step (StepResult's row); source:
    what proposed them ("draft", "lookup", "plain")."""
    if drafted == 0 or source == "plain":
        return [TokenMark(committed[0], "plain", step, 0)]

    def conf(k):
        return round(confidences[k], 4) if confidences is not None and k < len(confidences) else None

    kind, src = ("lookup", "lookup") if source == "lookup" else ("accepted", None)
    out = [TokenMark(t, kind, step, k + 1, conf(k), source=src) for k, t in enumerate(committed[:accepted])]
    last = committed[accepted]
    if verified > accepted:  # the target rejected the draft at slot accepted+1 and wrote its own token
        if drafts is None:
            raise ValueError("step_marks: a step that drafted and rejected a draft names its drafts")
        out.append(TokenMark(last, "corrected", step, accepted + 1, conf(accepted), drafts[accepted], source=src))
    else:
        out.append(TokenMark(last, "bonus", step, accepted + 1, source=src))
    return out


class TextPieces:
    """Assigns each marked token the text it adds to a request's stream (see the module docstring).

    Runs a detokenizer of its own (the request's tokenizer and stop strings) one token at a time,
    so the pieces are the streamed text cut per token whoever else reads the request."""

    def __init__(self) -> None:
        self.done = 0  # marks given their text
        self.chars = 0  # characters of the stream handed out with them
        self.detok: Detokenizer | None = None

    def take(self, req) -> list[TokenMark]:
        """The marks of tokens committed since the last call, each with its text."""
        marks, ids = req.marks, req.output_ids
        if req.detok is None:  # a target without a tokenizer: token ids only
            new, self.done = marks[self.done :], len(marks)
            return new
        if self.detok is None:
            self.detok = Detokenizer(req.detok.tokenizer, req.detok.stop)
        final = req.text if req.finished else None
        new = []
        for i in range(self.done, len(marks)):
            self.detok.update(ids[: i + 1])
            if final is None:  # while decoding: what the stream may show (a stop string's start held back)
                text, upto = self.detok.text, len(self.detok.streamable())
            else:  # the final text, cut at a stop string; its last token takes whatever is left
                text = final
                upto = len(final) if i == len(marks) - 1 else min(len(self.detok.text), len(final))
            piece = text[self.chars : upto]
            self.chars += len(piece)
            new.append(replace(marks[i], text=piece))
        self.done = len(marks)
        return new


def counts(marks: list[TokenMark]) -> dict[str, int]:
    """Tokens per kind."""
    out = dict.fromkeys(KINDS, 0)
    for m in marks:
        out[m.kind] += 1
    return out
