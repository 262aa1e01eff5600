"""A native runtime for Llama-family targets (Llama/SmolLM2, Qwen2, Qwen3, Mistral), gpt-fast style.

The weights are a Hugging Face causal LM's, by transformers' names (target/checkpoint.py: read
from the model directory's safetensors, or taken from a loaded transformers model); this runtime
re-runs its forward pass with less machinery, because at batch 1 on a CPU a decode
step is bound by reading the weights and by per-op overhead, not by FLOPs:
- q/k/v and gate/up are fused into one matmul each (fewer, larger weight reads);
- RoPE cos/sin come from a table precomputed once from the model's inverse frequencies (its own
  rotary module's, so every static rope variant it implements is honoured; unscaled RoPE computed
  as that module computes it; length-dependent variants are refused);
- the KV cache (target/kvcache.py) is one preallocated tensor with a length per row;
- the hidden-state taps are written in-line into the buffer the draft reads (tap i = the input
  of decoder layer i = HF hidden_states[i]; tap num_layers = the last layer's output BEFORE the
  final norm);
- with dspark's CPU extension (dspark/kernels.py) the whole layer loop is one call
  (csrc/layers.cpp); elsewhere (float32 activations, GPUs, no compiler, weights off the matmul
  tile) target/torch_layers.py runs it on torch's ops: one implementation or the other, never a mix;
- the LM head runs only on the positions whose logits are used;
- weights in the format that is fastest on the machine (target/quant.py): fp32, bf16, or
  weight-only int8 / int4 (the layout of the GGUF Q4_0/Q4_1 files, held exactly as shipped).

This file is the model: which architectures it reproduces, the weights laid out per layer, and
the forward with its logits modes. It implements `dspark.target.base.Target`, as
`dspark.target.hf.HFTarget` does, so `Engine(NativeTarget(model), draft)` runs unchanged.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dspark import hugepages, kernels, ops, packing
from dspark.errors import DSparkError, RequestError
from dspark.ops import NO_TENSOR
from dspark.target import dense, torch_layers
from dspark.target.base import Forwards, Result, check_finite, non_finite
from dspark.target.checkpoint import EMBED, FAMILIES, NORM, Checkpoint, checkpoint_of, rope_type
from dspark.target.kvcache import CACHE_CHUNK, NativeState, alloc_kv
from dspark.target.quant import FLOATS, Linear, is_int4_exact, is_q8_exact, on_tile, resolve_weights

# rope variants whose inv_freq does not depend on the sequence length: a table computed once
# from the model's rotary module is exact for them
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def supports(model) -> tuple[bool, str]:
    """(True, "") when this runtime reproduces `model` (a transformers model or a Checkpoint); else
    (False, why)."""
    ck = checkpoint_of(model)
    cfg = ck.config
    name = type(model).__name__ if not isinstance(model, Checkpoint) else str(getattr(cfg, "model_type", "model"))
    mt = getattr(cfg, "model_type", None)
    if mt not in FAMILIES:
        return False, f"architecture {name} (model_type {mt!r}) is not one of {', '.join(FAMILIES)}"
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        return False, f"{name}: activation {act!r} (only silu is implemented)"
    rope = rope_type(cfg)
    if rope not in STATIC_ROPE:
        return (
            False,
            f"{name}: rope type {rope!r} depends on the sequence length (static variants: {', '.join(STATIC_ROPE)})",
        )
    layer_types = getattr(cfg, "layer_types", None) or []
    window = getattr(cfg, "sliding_window", None)
    sliding = any(t != "full_attention" for t in layer_types) or (
        mt == "mistral" and window is not None and window < getattr(cfg, "max_position_embeddings", 1 << 30)
    )
    if sliding:
        return False, f"{name}: sliding-window attention layers are not implemented"
    if not ck.has(EMBED) or not ck.has(NORM):
        return False, f"{name}: no model.embed_tokens / model.norm (not a standard causal-LM layout)"
    if not all(ck.has(f"model.layers.0.self_attn.{p}.weight") for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return False, f"{name}: attention without q/k/v/o projections"
    return True, ""


@dataclass
class Layer:
    ln1: torch.Tensor  # [H]
    wqkv: Linear  # H -> (Hq + 2 Hkv) * D
    qk_norm: torch.Tensor | None  # [Hq + Hkv, D]: Qwen3's q_norm per query head, k_norm per key head
    wo: Linear  # Hq*D -> H
    ln2: torch.Tensor
    w13: Linear  # H -> 2 I (gate | up)
    w2: Linear  # I -> H


class _LayerStack:
    """The layers handed to the extension's `layers_forward` (csrc/layers.cpp: the decoder's layer
    loop in one call, the Python loop's kernels in its order); released with the last target
    view that holds it."""

    def __init__(self, ext, layers: list[Layer], head: Linear | None = None):
        def weight(lin):
            packed = lin.q4 or lin.q8 or lin.packed
            return [
                packed[0],
                packed[1],
                packed[2] if len(packed) > 2 else NO_TENSOR,
                NO_TENSOR if lin.b is None else lin.b,
            ]

        flat = []
        for ly in layers:
            flat += [ly.ln1, NO_TENSOR if ly.qk_norm is None else ly.qk_norm, ly.ln2]
            for lin in (ly.wqkv, ly.wo, ly.w13, ly.w2):
                flat += weight(lin)
        # the head too where the tile holds it: a greedy plain step then takes its argmax in the same call
        self.head = head is not None and on_tile(head)
        flat += weight(head) if self.head else [NO_TENSOR] * 4
        self.ext, self.id = ext, ext.layers_register(flat)

    def __del__(self):
        try:
            self.ext.layers_release(self.id)
        except Exception:  # at interpreter exit the extension may be gone first; nothing to free then
            pass

    @staticmethod
    def of(target: NativeTarget) -> _LayerStack | None:
        """Where every piece of the forward runs on the extension's kernels (bf16 with the matmul
        tile, heads of a multiple of 16, a gate/up width of a multiple of 32), else None."""
        if target._ext is None or target.head_dim % 16:
            return None
        for ly in target.layers:
            if not all(on_tile(lin) for lin in (ly.wqkv, ly.wo, ly.w13, ly.w2)) or ly.w13.out_features % 32:
                return None
        return _LayerStack(target._ext, target.layers, target.head)  # a head on the tile runs in bf16, as the layers


class NativeTarget(Forwards):
    """A Llama-family causal LM run natively; see the module docstring.

    model: the target's Checkpoint (dspark.target.checkpoint: its config and tensors), or a loaded
      transformers model (its Checkpoint taken); the weights are copied into the chosen format, and
      transformers' model is `.model`, built from the checkpoint's files where code wants the
      reference path.
    weights: 'auto' | 'fp32' | 'bf16' | 'fp16' | 'int8' | 'int4' (see `resolve_weights`).
    head: format of the LM head; None = the decoder's format, except under 'auto' int4, where
      a head that is not itself 4-bit (SmolLM2's is Q8_0 in the GGUF) stays in float (the
      activation dtype) rather than being quantised further.
    act_dtype: activation/KV dtype; default fp32 for fp32 weights, else bf16 (torch's CPU
      int8/int4 kernels are vectorised for bf16 activations only). fp32 activations with
      int4/int8 weights are exact but slow: for tests.
    ops: 'auto' (dspark's compiled CPU kernels where they run: the layer stack in one call, the
      int4 and Q8_0 matmuls; dspark.kernels) | 'torch' (torch's ops throughout, to compare).
    """

    def __init__(
        self,
        model,
        tap_indices: tuple[int, ...] = (),
        weights: str = "auto",
        head: str | None = None,
        act_dtype: torch.dtype | None = None,
        ops: str = "auto",
        packs=None,
    ):
        """packs: a dspark.target.packcache.PackStore (open_target's), which answers the screens and
        the packed matrices from the cache where it holds them; None: everything computed here."""
        if ops not in ("auto", "torch"):
            raise DSparkError(f"unknown ops {ops!r} (choose auto or torch)")
        self.ops = ops
        ck = checkpoint_of(model)
        ok, why = supports(ck)
        if not ok:
            raise DSparkError(f"the native runtime does not support this model: {why}")
        if not isinstance(model, Checkpoint):
            model.eval()
        self.checkpoint = ck
        self.config = cfg = ck.config
        self.device = ck.device
        requested = weights
        self._packs = packs
        self.weights = self._fact(f"weights {weights}", lambda: resolve_weights(ck, weights, self.device))
        self.dtype = act_dtype or FLOATS.get(self.weights, torch.bfloat16)
        if self.weights in FLOATS and self.dtype != FLOATS[self.weights]:
            raise DSparkError(f"weights {self.weights!r} run with {self.weights} activations, not {self.dtype}")
        act = self.dtype
        self.num_layers = cfg.num_hidden_layers
        self.hidden_size = cfg.hidden_size
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.eps = cfg.rms_norm_eps
        self.max_length = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 30)
        head_w = ck.head()
        self.vocab_size = head_w.shape[0]
        with torch.no_grad():
            self.embed = ck.embedding().to(act)  # [V, H]: a gather, any format is cheap
            self.layers = self._build(ck, self.weights, act)
            if requested == "auto" and not all(
                lin.exact for ly in self.layers for lin in (ly.wqkv, ly.wo, ly.w13, ly.w2)
            ):
                # the 64-row screen passed but a later row is not 4-bit: keep the model's own numbers
                self.weights, self.dtype = "fp32", torch.float32
                act = self.dtype
                self.embed = ck.embedding().to(act)
                self.layers = self._build(ck, self.weights, act)
            self.norm = ck.tensor(NORM).to(act)
            # dspark's extension runs the layer stack (bf16 only; torch's ops otherwise: _LayerStack.of)
            self._ext = (
                kernels.extension() if ops == "auto" and act == torch.bfloat16 and self.device.type == "cpu" else None
            )
            auto_int4_head = head is None and requested == "auto" and self.weights == "int4"
            if auto_int4_head and not self._fact("head int4", lambda: is_int4_exact(head_w, rows=64)):
                # not 4-bit: an exact Q8_0 head (the GGUF's, for SmolLM2) runs on dspark's int8
                # kernel where it can, else the head stays in float; it is never re-quantised
                q8 = (
                    ops == "auto"
                    and act == torch.bfloat16
                    and packing.tile_applies(*head_w.shape)
                    and self._fact("head q8_0", lambda: is_q8_exact(head_w, rows=64))
                )
                head = "q8_0" if q8 else "fp32" if act == torch.float32 else "bf16"
            head = head or self.weights
            if (
                head == "int4" and head_w.shape[0] % 16
            ):  # no int4 kernel holds it: the head stays float (describe() says so)
                head = "fp32" if act == torch.float32 else "bf16"
            self.head = self._linear("head", lambda: head_w, ck.head_bias, head, FLOATS.get(head, act))
            if auto_int4_head and not self.head.exact:
                head = "fp32" if act == torch.float32 else "bf16"
                self.head = self._linear("head", lambda: head_w, ck.head_bias, head, FLOATS[head], "auto")
            self.head_format = head
            self._head_act = FLOATS.get(head, act)  # a float head runs in its own dtype
            # RoPE table [P, D] from the model's inv_freq and attention scaling (as its rotary module
            # holds them: Checkpoint.rope), computed in fp32 as HF does, then cast to the activation
            # dtype as HF does
            inv, scale = ck.rope()
            inv = inv.float().to(self.device)
            t = torch.arange(self.max_length + CACHE_CHUNK, device=self.device, dtype=torch.float32)
            freqs = torch.outer(t, inv)
            emb = torch.cat([freqs, freqs], -1)
            self.cos = (emb.cos() * scale).to(act)
            self.sin = (emb.sin() * scale).to(act)
            # every weight a step streams in 2 MB pages, where the OS gives them (before the
            # extension's layer stack takes its references)
            lins = [lin for ly in self.layers for lin in (ly.wqkv, ly.wo, ly.w13, ly.w2)] + [self.head]
            self.huge_pages = (
                hugepages.into_huge_pages([(lin, f) for lin in lins for f in ("q4", "q8", "packed", "w")]) > 0
            )
        self._packs = None  # the store is its loader's (which saves it), not the target's
        self._stack = _LayerStack.of(self)
        # each layer's matrices as dense bf16 for long prefills (dspark.target.dense), made at the first
        # one; a list shared by this target's views (copy.copy), as the layer stack is
        self._dense_box: list[list[tuple[torch.Tensor, ...]] | None] = [None]
        self.set_taps(tap_indices)

    def dense_layers(self) -> list[tuple[torch.Tensor, ...]]:
        """The layers' dense bf16 copies a long prefill runs on (dspark.target.dense), made once and
        shared by this target's views; empty where refused for memory."""
        out = self._dense_box[0]
        if out is None:
            out = self._dense_box[0] = dense.make(self.checkpoint, self.num_layers, self._stack)
        return out

    def _fact(self, key: str, compute):
        """A screen of the model's weights (compute()), read from the pack store where it has it."""
        return compute() if self._packs is None else self._packs.fact(key, compute)

    def _linear(self, name: str, w, b, fmt: str, act: torch.dtype, ops: str | None = None) -> Linear:
        """Linear(w(), b(), fmt, act, ops): the matrix `name` packed, or read from the pack store."""
        ops = self.ops if ops is None else ops

        def compute() -> Linear:
            return Linear(w(), b(), fmt, act, ops)

        return compute() if self._packs is None else self._packs.linear(name, fmt, act, ops, compute)

    @property
    def model(self):
        """transformers' model of this target, for reference paths (built from its files at the
        first use where the target was read from them: dspark.target.checkpoint)."""
        return self.checkpoint.model()

    def _build(self, ck: Checkpoint, fmt: str, act: torch.dtype) -> list[Layer]:
        layers = []
        for i in range(self.num_layers):
            pre = f"model.layers.{i}."
            # the FUSED matrices (q|k|v, o, gate|up, down), each packed or read from the pack store
            linears = {
                name: self._linear(
                    f"layers.{i}.{name}",
                    lambda i=i, name=name: dense.fused_weight(ck, i, name),
                    lambda i=i, name=name: dense.fused_bias(ck, i, name),
                    fmt,
                    act,
                )
                for name in dense.FUSED
            }
            qk = ck.has(pre + "self_attn.q_norm.weight")
            layers.append(
                Layer(
                    ln1=ck.tensor(pre + "input_layernorm.weight").to(act),
                    qk_norm=torch.cat(
                        [
                            ck.tensor(pre + "self_attn.q_norm.weight").expand(self.n_heads, -1),
                            ck.tensor(pre + "self_attn.k_norm.weight").expand(self.n_kv, -1),
                        ]
                    ).to(act)
                    if qk
                    else None,
                    ln2=ck.tensor(pre + "post_attention_layernorm.weight").to(act),
                    **linears,
                )
            )
        return layers

    def _int4_linears(self) -> list[Linear]:
        lins = [lin for ly in self.layers for lin in (ly.wqkv, ly.wo, ly.w13, ly.w2)] + [self.head]
        return [lin for lin in lins if lin.fmt == "int4"]

    def int4_kernels(self) -> str | None:
        """Which int4 kernel the matmuls run on ('dspark', 'torch', 'dspark+torch'), None without int4."""
        return "+".join(sorted({"dspark" if lin.q4 is not None else "torch" for lin in self._int4_linears()})) or None

    def extension(self) -> str | None:
        """The build of dspark's extension this target's layer stack runs on (its ISA and source
        hash), or None."""
        return kernels.build_tag() if self._ext is not None else None

    def describe(self) -> str:
        kernel = ""
        int4 = self._int4_linears()
        if int4:
            ours = sum(lin.q4 is not None for lin in int4)
            kernel = (
                f", int4 kernel: {kernels.tile_name()} ({ours} of {len(int4)} matrices{kernels.q4_note()})"
                if ours
                else f", int4 kernel: {int4[0].kernel}"
            )
        layers = ", layers on torch's ops"
        if self._stack is not None:
            # what a prompt runs on: its attention (csrc/attn_prefill.cpp) and, where dense_prefill, its matmuls
            prefill = f"prefill attention {self._stack.ext.attn_prefill_kind()}"
            if dense.dense_prefill():
                prefill += f", matmuls of {dense.PREFILL_MM_ROWS}+ rows in bf16 on torch's (oneDNN) kernels"
            layers = f", layers in one call: dspark {kernels.extension_isa()} ({prefill})"
        return (
            f"native runtime, weights {self.weights} (head {self.head_format}), "
            f"activations {str(self.dtype).removeprefix('torch.')}{kernel}{layers}"
        )

    # ---- hidden-state taps -------------------------------------------------------------
    def view(self, tap_indices: tuple[int, ...] = ()) -> NativeTarget:
        """Another target over the same packed weights with its own taps (nothing is copied)."""
        other = copy.copy(self)
        other.set_taps(tap_indices)
        return other

    def set_taps(self, tap_indices: tuple[int, ...]) -> None:
        """Tap i = input of decoder layer i = HF hidden_states[i]; i = num_layers is the last
        layer's output before the final norm (HF's hidden_states[-1] is after it)."""
        for i in tap_indices:
            if not 0 <= i <= self.num_layers:
                raise RequestError(f"hidden_state_index {i} is outside 0..{self.num_layers} for this target")
        self.tap_indices = tuple(tap_indices)
        # the forward writes tap i (i >= 1) into its columns of the taps as layer i - 1 adds its
        # MLP output: _tap_cols[li] = those columns' offset for layer li's output, else -1
        H = self.embed.shape[1]
        self._tap_width = len(self.tap_indices) * H  # the taps' columns, n * H
        self._tap_cols = [-1] * self.num_layers
        for k, i in enumerate(self.tap_indices):
            if i >= 1 and self._tap_cols[i - 1] < 0:
                self._tap_cols[i - 1] = k * H
        # the rest, copied after the layers: tap 0 (the embeddings: source None) and repeats of an index
        self._tap_fill = [
            (k * H, None if i == 0 else self._tap_cols[i - 1])
            for k, i in enumerate(self.tap_indices)
            if i == 0 or self._tap_cols[i - 1] != k * H
        ]

    # ---- cache ---------------------------------------------------------------------------
    def new_state(self, batch: int = 1) -> NativeState:
        return NativeState(None, torch.zeros(batch, dtype=torch.long, device=self.device))

    def _alloc(self, batch: int, capacity: int) -> torch.Tensor:
        return alloc_kv((self.num_layers, 2, batch, self.n_kv, capacity, self.head_dim), self.dtype, self.device)

    def forward_final(
        self, state: NativeState, tokens: torch.Tensor, counts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """No LM head: the post-norm final hidden states [B, S, H] (what training's features store;
        padding positions hold whatever padding computes), on prefill's paths as `forward_last`."""
        return self._forward(state, tokens, counts, "final")

    @torch.inference_mode()
    def _forward(
        self, state: NativeState, tokens: torch.Tensor, counts: torch.Tensor | None, logits: Result
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The four forwards (base.Forwards, and forward_final): tokens [B, S] (row b valid for
        counts[b] <= S) -> logits [B, S, V] fp32, padding positions (>= counts[b]) zero: nothing
        reads them; "last" (a prompt's positions) on prefill's paths, the dense AMX copies of the
        matmuls where they apply; "argmax": torch's argmax of the logits, padding included, which on
        the extension's layer stack comes out of the same call with no fp32 logits made. taps
        [B, S, n*H] is a new tensor on every call, as HFTarget's (the engine keeps it)."""
        if state.pending:
            raise RuntimeError("commit() the previous forward before running another")
        B, S = tokens.shape
        dev = self.device
        tokens = tokens.to(dev, torch.long)  # the layer stack reads int64 ids (F.embedding took int32 too)
        lengths = state.lengths
        L0 = int(lengths.max())
        if (L0 + S if counts is None else int((lengths + counts.to(dev)).max())) > self.max_length:
            raise RequestError(f"sequence would exceed the target's context of {self.max_length} tokens")
        state.reserve(L0 + S, self._alloc)
        H, width = self.embed.shape[1], self._tap_width
        ids = None
        stack = self._stack
        prefill = logits in ("last", "final")  # a prompt's positions: no decode step's bits to match
        # the dense copies serve the layer stack only (torch's ops path runs its own matmuls)
        if prefill and stack is not None and self._dense_box[0] is None and B * S >= dense.PREFILL_MM_ROWS:
            if dense.dense_prefill():
                self.dense_layers()
        if stack is not None:  # the embedding, the layers (and the head's argmax) in one call (csrc/layers.cpp)
            argmax = logits == "argmax" and stack.head
            # the call makes the taps [B, S, n*H] and writes each tap as its layer runs (stack.ext is self._ext)
            out = stack.ext.layers_forward(
                stack.id,
                tokens,
                self.embed,
                state.kv,
                self.cos,
                self.sin,
                lengths,
                self.norm,
                self.eps,
                self.n_heads,
                self.n_kv,
                width,
                self._tap_cols,
                argmax,
                prefill,
            )
            embedded, x, h = out[:3]
            tapped = out[3] if width else None
            ids = out[4] if argmax else None
            bad = out[5]  # the rows holding NaN / inf in their final states (the kernel's own scan)
        else:
            # taps [B, S, n*H]: each tap written in place as its layer runs (a new buffer each call)
            tapped = torch.empty(B, S, width, dtype=self.embed.dtype, device=dev) if width else None
            pos = lengths[:, None] + torch.arange(S, device=dev)[None, :]  # [B, S]
            x = embedded = F.embedding(tokens, self.embed)  # [B, S, H]
            x, h = torch_layers.layers(self, x, state, pos, L0, tapped, prefill)
        for col, src in self._tap_fill:
            assert tapped is not None  # _tap_fill lists taps: the width is not 0, so the taps were made
            tapped[..., col : col + H] = embedded if src is None else tapped[..., src : src + H]
        state.pending = S
        # a NaN / inf row must end its own request, not become tokens (engine.Engine._recover); on the
        # final states, which every logits mode derives from: [B, S, H], far cheaper than the logits
        if stack is None:
            check_finite(h, "final hidden states")
        elif bad.numel():
            raise non_finite("final hidden states", bad.tolist())
        # h: the final norm of every position (a per-row op: selecting rows first changes nothing)
        if logits == "final":
            return h, tapped
        if logits == "argmax":
            return (ids if ids is not None else ops.argmax(self._logits(h))), tapped
        if logits == "last":
            if counts is None:  # full
                return self._logits(h[:, -1:]), tapped  # [B, 1, V]
            h = h[torch.arange(B, device=dev), counts.to(dev) - 1][:, None]  # [B, 1, H]
            return self._logits(h), tapped
        if counts is None or bool((counts == S).all()):
            return self._logits(h), tapped
        valid = torch.arange(S, device=dev)[None, :] < counts.to(dev)[:, None]  # [B, S]
        out = torch.zeros(B, S, self.vocab_size, device=dev)
        out[valid] = self._logits(h[valid])
        return out, tapped

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """h: final-normed hidden states -> fp32 logits."""
        return self.head(h.to(self._head_act)).float()

    def commit(self, state: NativeState, keep: torch.Tensor) -> None:
        state.commit(keep)

    def select(self, state: NativeState, rows: torch.Tensor) -> NativeState:
        return state.select(rows)

    def merge(self, states: list[NativeState]) -> NativeState:
        return NativeState.merge(states, self._alloc)
