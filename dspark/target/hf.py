"""A Hugging Face causal LM as a DSpark target.

One `forward` serves prefill and block verification: it appends tokens to each request's
KV cache, returns logits and the hidden states tapped at the draft's `hidden_state_indices`,
and leaves the new entries *pending*; `commit` keeps only the accepted ones (cropping what
was rejected) and packs rows left so a batch of ragged requests stays one tensor per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import CacheLayerMixin, DynamicLayer, LinearAttentionCacheLayerMixin

from dspark.errors import RequestError
from dspark.ops import argmax
from dspark.ragged import merge_rows, pack
from dspark.target.base import Forwards, Result, check_finite
from dspark.target.checkpoint import Checkpoint


def decoder_layers(model) -> torch.nn.ModuleList:
    base = model.get_decoder() if hasattr(model, "get_decoder") else model
    for attr in ("layers", "h", "blocks"):
        layers = getattr(base, attr, None)
        if isinstance(layers, torch.nn.ModuleList):
            return layers
    raise RequestError(f"cannot find the decoder layers of {type(model).__name__}")


def _kv(layer: CacheLayerMixin | LinearAttentionCacheLayerMixin) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache layer's (keys, values), as a forward wrote them."""
    if not isinstance(layer, CacheLayerMixin) or layer.keys is None or layer.values is None:
        raise RequestError(
            f"target cache layer {type(layer).__name__} holds no keys and values (full-attention layers only)"
        )
    return layer.keys, layer.values


@dataclass
class TargetState:
    """KV cache of B requests. lengths[b] committed tokens; `pending` entries await commit."""

    cache: DynamicCache
    lengths: torch.Tensor  # [B] long
    pending: int = 0

    @property
    def batch(self) -> int:
        return int(self.lengths.shape[0])


class HFTarget(Forwards):
    def __init__(self, model, tap_indices: tuple[int, ...] = ()):
        self.model = model.eval()
        self.checkpoint = Checkpoint.from_model(model)
        self.config = model.config
        self.layers = decoder_layers(model)
        self.num_layers = len(self.layers)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.hidden_size = model.get_input_embeddings().weight.shape[1]
        self.max_length = int(
            getattr(self.config, "max_position_embeddings", 0) or getattr(self.config, "n_positions", 0) or 1 << 30
        )
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self.set_taps(tap_indices)

    def view(self, tap_indices: tuple[int, ...] = ()) -> HFTarget:
        """Another target over the same model with its own taps (a plain-decoding twin taps nothing)."""
        return HFTarget(self.model, tap_indices)

    # ---- hidden-state taps -------------------------------------------------------------
    def set_taps(self, tap_indices: tuple[int, ...]) -> None:
        """Tap index i = input of decoder layer i = HF hidden_states[i] (0 = embeddings).

        Hooks read layer outputs directly: HF's hidden_states[-1] comes after the final
        norm, so tapping the last layer through it would silently feed the wrong features.
        """
        for h in self._hooks:
            h.remove()
        self._hooks, self.tap_indices = [], tuple(tap_indices)
        for i in self.tap_indices:
            if not 0 <= i <= self.num_layers:
                raise RequestError(f"hidden_state_index {i} is outside 0..{self.num_layers} for this target")
            module = self.model.get_input_embeddings() if i == 0 else self.layers[i - 1]
            self._hooks.append(module.register_forward_hook(self._capture(i)))

    def _capture(self, i: int):
        def hook(_module, _inputs, output):
            self._captured[i] = output[0] if isinstance(output, tuple) else output

        return hook

    # ---- cache ---------------------------------------------------------------------------
    def new_state(self, batch: int = 1) -> TargetState:
        return TargetState(DynamicCache(config=self.config), torch.zeros(batch, dtype=torch.long, device=self.device))

    def _cache_len(self, state: TargetState) -> int:
        return state.cache.get_seq_length() if state.cache.is_initialized else 0

    @torch.inference_mode()
    def _forward(
        self, state: TargetState, tokens: torch.Tensor, counts: torch.Tensor | None, logits: Result
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The three forwards (base.Forwards): tokens [B, S] (row b valid for counts[b] <= S) ->
        logits [B, S, V] fp32 ("last": [B, 1, V], the model's `logits_to_keep=1` where every row is
        full; "argmax": `ops.argmax` of them, [B, S] int64), taps [B, S, n*Hidden]. Positions
        continue each row's committed length; padding rows/keys are masked out. taps is a new tensor
        on every call, never a reused buffer: the engine keeps the taps of steps that did not draft
        until the next drafting step."""
        if state.pending:
            raise RuntimeError("commit() the previous forward before running another")
        B, S = tokens.shape
        counts = torch.full((B,), S, dtype=torch.long, device=self.device) if counts is None else counts
        if int((state.lengths + counts).max()) > self.max_length:
            raise RequestError(f"sequence would exceed the target's context of {self.max_length} tokens")
        T = self._cache_len(state)
        positions = state.lengths[:, None] + torch.arange(S, device=self.device)[None, :]
        j = torch.arange(T, device=self.device)
        past = (j[None, :] < state.lengths[:, None])[:, None, None, :].expand(B, 1, S, T)
        i = torch.arange(S, device=self.device)
        new = (i[None, :] <= i[:, None])[None] & (i[None, None, :] < counts[:, None, None])
        mask = torch.cat([past, new[:, None]], dim=-1)  # [B, 1, S, T+S]
        self._captured.clear()
        last_only = logits == "last" and bool((counts == S).all())
        out = self.model(
            input_ids=tokens.to(self.device),
            attention_mask=mask,
            position_ids=positions,
            past_key_values=state.cache,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
        )
        state.pending = S
        check_finite(out.logits, "logits")  # a NaN / inf row ends its own request (engine.Engine._recover)
        taps = torch.cat([self._captured[k] for k in self.tap_indices], dim=-1) if self.tap_indices else None
        if logits == "argmax":
            return argmax(out.logits), taps
        out_logits = out.logits.float()
        if logits == "last" and not last_only:
            out_logits = out_logits[torch.arange(B, device=self.device), counts - 1][:, None]
        return out_logits, taps

    def commit(self, state: TargetState, keep: torch.Tensor) -> None:
        """Keep the first keep[b] pending entries of each row; drop the rest (rejected drafts, padding)."""
        old = self._cache_len(state) - state.pending
        keep = keep.to(state.lengths.device)
        for layer in state.cache.layers:
            if type(layer) is not DynamicLayer:
                raise RequestError(
                    f"target cache layer {type(layer).__name__} is not supported (full-attention layers only)"
                )
            keys, values = _kv(layer)
            layer.keys = pack(keys, state.lengths, old, keep)
            layer.values = pack(values, state.lengths, old, keep)
        state.lengths = state.lengths + keep
        state.pending = 0

    def select(self, state: TargetState, rows: torch.Tensor) -> TargetState:
        """The sub-batch of `rows` (requests leaving drop out of the batch)."""
        cache = DynamicCache(config=self.config)
        out = TargetState(cache, state.lengths[rows])
        if state.cache.is_initialized:
            T = int(out.lengths.max()) if len(rows) else 0
            for li, layer in enumerate(state.cache.layers):
                keys, values = _kv(layer)
                cache.update(keys[rows][:, :, :T], values[rows][:, :, :T], li)
        return out

    def merge(self, states: list[TargetState]) -> TargetState:
        """One batch from several states (a request joins the batch after its own prefill)."""
        cache = DynamicCache(config=self.config)
        for li in range(len(states[0].cache.layers)):
            kvs = [_kv(s.cache.layers[li]) for s in states]
            keys = merge_rows([k for k, _ in kvs])
            values = merge_rows([v for _, v in kvs])
            cache.update(keys, values, li)
        return TargetState(cache, torch.cat([s.lengths for s in states]))
