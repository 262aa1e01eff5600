"""What the engine needs from a target: the interface both runtimes implement.

`HFTarget` (target/hf.py) runs any Hugging Face causal LM through its own forward; it is the
reference. `NativeTarget` (target/native.py) runs the same weights on dspark's CPU kernels.
The engine, the decode step and the benchmarks see only this protocol.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

import torch

from dspark.errors import NonFiniteError

# What a runtime's one forward computes after the layers, and so what it returns beside the taps
# (each public forward names one): "all" [B, S, V] fp32 logits; "last" [B, 1, V] each row's last
# valid position; "argmax" [B, S] int64 greedy tokens (no fp32 logits made); "final" [B, S, H]
# post-norm final hidden states (the native runtime's `forward_final`)
Result = Literal["all", "last", "argmax", "final"]


def check_finite(x: torch.Tensor, what: str) -> None:
    """x [B, ...] (every step's final states): raise NonFiniteError naming the rows that hold a NaN
    or inf. One reduction when all is finite; the rows are found only when something is not."""
    if bool(torch.isfinite(x).all()):
        return
    ok = torch.isfinite(x).flatten(1).all(dim=1)
    raise non_finite(what, (~ok).nonzero().flatten().tolist())


def non_finite(what: str, rows: list[int]) -> NonFiniteError:
    """The error for batch rows whose `what` (a forward's final states, logits) hold NaN or inf."""
    return NonFiniteError(f"the target computed non-finite values (NaN/inf) in its {what}", rows)


class Forwards:
    """The Target protocol's forwards, each one result, over a runtime's one `_forward(state, tokens,
    counts, result)` (both runtimes inherit them; the native one adds `forward_final`)."""

    def _forward(
        self, state: Any, tokens: torch.Tensor, counts: torch.Tensor | None, logits: Result
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def forward(
        self, state: Any, tokens: torch.Tensor, counts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fp32 logits [B, S, V] and the taps (Target.forward)."""
        return self._forward(state, tokens, counts, "all")

    def forward_last(
        self, state: Any, tokens: torch.Tensor, counts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's last valid position's logits [B, 1, V] (Target.forward_last: a prompt's forward)."""
        return self._forward(state, tokens, counts, "last")

    def forward_argmax(
        self, state: Any, tokens: torch.Tensor, counts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each position's greedy token [B, S] int64 (Target.forward_argmax)."""
        return self._forward(state, tokens, counts, "argmax")


@runtime_checkable
class TargetState(Protocol):
    """The KV cache of B requests: lengths[b] committed positions; `pending` positions of the
    last forward wait for `commit`."""

    lengths: torch.Tensor
    pending: int


# The state type a target makes and takes back: each runtime reads only its own states
# (`Target` unparameterised, as the engine names it, is any runtime's).
StateT = TypeVar("StateT", bound=TargetState)


@runtime_checkable
class Target(Protocol[StateT]):
    @property
    def model(self) -> Any:
        """The Hugging Face model whose weights it runs (the reference path; built where asked)."""

    checkpoint: Any  # its config and tensors (dspark.target.checkpoint.Checkpoint): what the draft borrows
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    max_length: int  # positions a sequence may hold (prompt, output and the draft block)
    tap_indices: tuple[int, ...]  # HF hidden_states indices the forward returns as taps

    def set_taps(self, tap_indices: tuple[int, ...]) -> None:
        """Tap index i = input of decoder layer i (0 = the embeddings; the layer count = the last
        layer's output before the final norm)."""

    def view(self, tap_indices: tuple[int, ...] = ()) -> Target[StateT]:
        """The same weights with taps of its own."""

    def new_state(self, batch: int = 1) -> StateT: ...

    def forward(
        self, state: StateT, tokens: torch.Tensor, counts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens [B, S] (row b valid for its first counts[b]) at positions continuing each row ->
        (fp32 logits [B, S, V], taps [B, S, n_taps * H] or None), written past the committed
        lengths, pending until `commit`. Raises RequestError past max_length and NonFiniteError
        (naming the rows) where the states are NaN/inf. A new taps tensor every call (the engine
        keeps the taps of steps that did not draft until the next drafting step)."""

    def forward_last(
        self, state: StateT, tokens: torch.Tensor, counts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward` with the logits of each row's last valid position only, [B, 1, V]: a prompt's
        forward (prefill), which needs no more and may run prefill's own numerics."""

    def forward_argmax(
        self, state: StateT, tokens: torch.Tensor, counts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward` with each position's greedy token [B, S] int64 instead of logits (`ops.argmax`
        of the logits, the choice greedy verification makes; a runtime may skip making them)."""

    def commit(self, state: StateT, keep: torch.Tensor) -> None:
        """Keep the first keep[b] pending positions of each row, drop the rest."""

    def select(self, state: StateT, rows: torch.Tensor) -> StateT: ...

    def merge(self, states: list[StateT]) -> StateT: ...


def replay(target: Target, prompt: list[int], output: list[int], chunk: int) -> tuple[TargetState, torch.Tensor | None]:
    """A new one-row state holding prompt + output as the engine computed them, and their taps
    [1, len, n * H] (None without taps): the prompt in prefill chunks of `chunk` tokens (a prompt's
    numbers: `forward_last`), the output in one forward on the decode path (a verify's numbers:
    each position's result is what the step that committed it computed)."""
    dev, state = target.device, target.new_state(1)
    taps: list[torch.Tensor | None] = []
    pieces = [(prompt[s : s + chunk], target.forward_last) for s in range(0, len(prompt), chunk)]
    for ids, run in [*pieces, (output, target.forward_argmax)]:
        if ids:
            taps.append(run(state, torch.tensor([ids], device=dev))[1])
            target.commit(state, torch.tensor([len(ids)], device=dev))
    have = [t for t in taps if t is not None]
    return state, torch.cat(have, 1) if have else None
