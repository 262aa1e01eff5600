"""DSparkDraft: the draft network of any DraftSpec (docs/DESIGN.md §1 and §4).

Shapes: B requests, S = spec.query_slots block rows, T context positions, H draft hidden,
V target vocabulary, Vd draft vocabulary. Context entry j of a row sits at absolute position
j, so a row's anchor position equals its context length.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from dspark.errors import FormatError
from dspark.formats.spec import DraftSpec, backbone_of
from dspark.model import fast
from dspark.model.heads import ConfidenceHead, MarkovHead
from dspark.model.layers import DraftLayer, LayerKV, RMSNorm, Rope
from dspark.ragged import merge_rows

BORROWABLE = ("embed_tokens.weight", "lm_head.weight")


# blocks of one context row attended together: past this the masked-out cross-block scores cost more than a context copy
GROUP_BLOCKS = 32
CONTEXT_CHUNK = 256  # context capacity grows in multiples of this (doubling): growth copies are rare


@dataclass
class ContextCache:
    """Per-layer context keys/values of committed positions, preallocated: row b holds its
    lengths[b] committed entries at [0, lengths[b]); what lies past them is scratch that every
    attention hides and the next append overwrites (a decoding block's own keys land there too,
    model/fast.py). Committing is a length update; nothing is copied away."""

    layers: list[LayerKV]  # k, v [B, kv, C, D], C = capacity >= lengths.max()
    lengths: torch.Tensor  # [B] valid context positions per row (= anchor position)
    # one text's context read by many anchors (`dspark doctor`): past a row's length lie entries
    # other rows read, not scratch, so nothing may be written there
    shared: bool = False
    # made for dspark's compiled drafting phase (bf16, one row per block row, contiguous): decided
    # once where the context is made (`DSparkDraft.new_context_cache`), never again per call
    kernels: bool = False

    @property
    def capacity(self) -> int:
        return int(self.layers[0].k.shape[2]) if self.layers else 0

    def reserve(self, need: int) -> None:
        """Room for `need` entries in every row (capacity doubles, in CONTEXT_CHUNK steps)."""
        if need <= self.capacity:
            return
        cap = -(-max(need, 2 * self.capacity) // CONTEXT_CHUNK) * CONTEXT_CHUNK
        grown = []
        for kv in self.layers:
            k = kv.k.new_zeros(*kv.k.shape[:2], cap, kv.k.shape[3])
            v = torch.zeros_like(k)
            k[:, :, : kv.k.shape[2]], v[:, :, : kv.v.shape[2]] = kv.k, kv.v
            grown.append(LayerKV(k, v))
        self.layers = grown

    def valid(self) -> list[LayerKV]:
        """The layers cut to the longest row: what an attention over the context reads."""
        T = int(self.lengths.max()) if self.lengths.numel() else 0
        return [LayerKV(kv.k[:, :, :T], kv.v[:, :, :T]) for kv in self.layers]

    def write(self, new: list[LayerKV]) -> None:
        """Put new[l] [B, kv, n, D] at positions lengths[b] .. lengths[b] + n - 1 of each row,
        without committing them (lengths stay)."""
        n = new[0].k.shape[2]
        L = self.lengths
        self.reserve(int(L.max()) + n)
        uniform = L.shape[0] == 1 or bool((L == L[0]).all())
        if uniform:
            L0 = int(L[0])
            for kv, x in zip(self.layers, new):
                kv.k[:, :, L0 : L0 + n], kv.v[:, :, L0 : L0 + n] = x.k, x.v
            return
        pos = L[:, None] + torch.arange(n, device=L.device)[None, :]  # [B, n] each row at its own offset
        rows = torch.arange(L.shape[0], device=L.device)[:, None]
        for kv, x in zip(self.layers, new):
            kv.k[rows, :, pos], kv.v[rows, :, pos] = x.k.transpose(1, 2), x.v.transpose(1, 2)

    def append(self, new: list[LayerKV], counts: torch.Tensor) -> None:
        # new[l].k [B, kv, n, D], counts [B] <= n: only the first counts[b] entries are committed
        self.write(new)
        self.lengths = self.lengths + counts

    def select(self, rows: torch.Tensor) -> ContextCache:
        return ContextCache(
            [LayerKV(kv.k[rows], kv.v[rows]) for kv in self.layers], self.lengths[rows], kernels=self.kernels
        )

    def fork(self) -> ContextCache:
        """The same entries under lengths of its own: what a drafting phase writes past them is
        scratch, so a fork can be drafted from again and again (`draft_phase_seconds`)."""
        return ContextCache(list(self.layers), self.lengths.clone(), self.shared, self.kernels)

    @staticmethod
    def merge(caches: list[ContextCache]) -> ContextCache:
        if len({c.kernels for c in caches}) > 1:
            raise ValueError("merging draft contexts made for the kernels with ones made for the modules")
        layers = [
            LayerKV(merge_rows([c.layers[i].k for c in caches]), merge_rows([c.layers[i].v for c in caches]))
            for i in range(len(caches[0].layers))
        ]
        return ContextCache(layers, torch.cat([c.lengths for c in caches]), kernels=caches[0].kernels)


class DSparkDraft(nn.Module):
    def __init__(self, spec: DraftSpec):
        super().__init__()
        b = spec.backbone
        if b is None:
            raise FormatError("draft spec has no backbone description (hidden size, heads, ...)")
        if b.family not in ("qwen3", "llama"):
            raise FormatError(f"draft layers of family {b.family!r} are not supported (qwen3, llama are)")
        self.spec = spec
        H, V, Vd = b.hidden_size, spec.vocab_size, spec.draft_vocab_size
        n_taps = len(spec.hidden_state_indices)
        self.embed_tokens = nn.Embedding(V, H)
        self.layers = nn.ModuleList(DraftLayer(b) for _ in range(b.num_layers))
        self.norm = RMSNorm(H, eps=b.rms_norm_eps)
        self.fc = nn.Linear(n_taps * (spec.target_hidden_size or H), H, bias=False)
        self.hidden_norm = RMSNorm(H, eps=b.rms_norm_eps)
        self.lm_head = nn.Linear(H, Vd, bias=False)
        self.markov_head = (
            MarkovHead(V, Vd, spec.markov_rank, H, spec.markov_head_type) if spec.markov_rank > 0 else None
        )
        self.confidence_head = None
        if spec.confidence_head:
            self.confidence_head = ConfidenceHead(H + (spec.markov_rank if spec.confidence_head_with_markov else 0))
        self.d2t: torch.Tensor | None  # a buffer with a reduced draft vocabulary
        if spec.has_d2t:
            self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.long))
        else:
            self.d2t = None
        self.rope = Rope(b)
        self.borrowed: set[str] = set()  # weights taken from the target: never saved with the draft
        self._fast: dict = {}  # model/fast.py's packed copy, shared with the views of read_as

    def read_as(self, spec: DraftSpec) -> DSparkDraft:
        """The same weights (shared, not copied) read as another spec: another layout or block
        size, other taps or another mask token. `dspark doctor` runs every reading of a file
        through the one propose path this way. Only the tap count is fixed by the weights (fc)."""
        if len(spec.hidden_state_indices) != len(self.spec.hidden_state_indices):
            raise FormatError(
                f"cannot read a draft of {len(self.spec.hidden_state_indices)} taps with "
                f"{len(spec.hidden_state_indices)} taps"
            )
        view = copy.copy(self)  # shares parameters, buffers and submodules
        view.spec = spec
        return view

    # ---- weights -------------------------------------------------------------------------
    def load_tensors(self, tensors: dict[str, torch.Tensor], target_embed=None, target_lm_head=None) -> None:
        """Load normalized tensors; borrow embed_tokens / lm_head from the target when absent."""
        tensors = dict(tensors)
        if "embed_tokens.weight" not in tensors:
            if target_embed is None:
                raise FormatError("draft has no embed_tokens.weight and no target embedding was given to borrow")
            tensors["embed_tokens.weight"] = target_embed
            self.borrowed.add("embed_tokens.weight")
        if "lm_head.weight" not in tensors:
            if target_lm_head is None or target_lm_head.shape[0] != self.spec.draft_vocab_size:
                raise FormatError(
                    "draft has no lm_head.weight and the target's LM head cannot be borrowed "
                    f"(draft vocab {self.spec.draft_vocab_size})"
                )
            tensors["lm_head.weight"] = target_lm_head
            self.borrowed.add("lm_head.weight")
        tensors.pop("t2d", None)  # derivable from d2t; the engine never needs it
        own = self.state_dict()
        missing = sorted(set(own) - set(tensors) - {"rope.rotary.inv_freq", "rope.rotary.original_inv_freq"})
        unexpected = sorted(set(tensors) - set(own))
        if missing or unexpected:
            raise FormatError(
                f"draft weights do not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        for name, t in tensors.items():
            if tuple(t.shape) != tuple(own[name].shape):
                raise FormatError(
                    f"tensor {name}: shape {tuple(t.shape)} but the config implies {tuple(own[name].shape)}"
                )
        self.load_state_dict(tensors, strict=False)

    def own_state_dict(self) -> dict[str, torch.Tensor]:
        """What a checkpoint of this draft holds (borrowed target weights and RoPE buffers excluded)."""
        return {k: v for k, v in self.state_dict().items() if k not in self.borrowed and not k.startswith("rope.")}

    # ---- forward pieces ------------------------------------------------------------------
    def context_kv(self, taps: torch.Tensor, positions: torch.Tensor) -> list[LayerKV]:
        """taps [N, T, n_taps*Ht] (tapped target states of committed positions) -> per-layer K/V."""
        ctx = self.hidden_norm(self.fc(taps))  # [N, T, H]
        cos, sin = self.rope(positions, ctx.dtype)
        # a ModuleList's items are typed Module: these are the DraftLayers __init__ made
        return [cast(DraftLayer, layer).self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def _masks(self, anchors: torch.Tensor, T: int, S: int) -> list[torch.Tensor]:
        """One [G, 1, n*S, T + n*S] bool mask per layer (spec.layer_attention) for groups of n
        blocks of S rows laid end to end, anchors [G, n]: a row sees its own block's context prefix
        (positions < its anchor, within a sliding window if the layer has one) and its own block's
        rows (causally if the layer is causal), never another block."""
        G, n = anchors.shape
        dev = anchors.device
        j = torch.arange(T, device=dev)
        a = anchors.repeat_interleave(S, dim=1)[..., None]  # [G, nS, 1]: each row's anchor
        blk = torch.arange(n, device=dev).repeat_interleave(S)
        slot = torch.arange(S, device=dev).repeat(n)
        same = blk[:, None] == blk[None, :]  # [nS, nS]
        cache: dict[tuple, torch.Tensor] = {}
        out = []
        for att in self.spec.layer_attention:
            key = (att.sliding_window, att.causal)
            if key not in cache:
                ctx_ok = j[None, None, :] < a  # [G, nS, T]
                if att.sliding_window is not None:
                    ctx_ok = ctx_ok & (j[None, None, :] >= a - att.sliding_window)
                own = same & (slot[None, :] <= slot[:, None]) if att.causal else same
                cache[key] = torch.cat([ctx_ok, own[None].expand(G, -1, -1)], dim=-1)[:, None]
            out.append(cache[key])
        return out

    def forward(
        self, block_ids: torch.Tensor, ctx: list[LayerKV], ctx_len: torch.Tensor, seq: torch.Tensor | None = None
    ) -> torch.Tensor:
        """block_ids [N, S] (row 0 = anchor, then MASK), ctx K/V [B, kv, T, D], ctx_len [N] (each
        block's anchor position), seq [N]: the row of ctx each block reads (default: its own when
        B == N, else row 0).

        Returns the post-norm block states h [N, S, H]: what lm_head, the Markov head and the
        confidence head read. Blocks that read the same context row run as one attention of up to
        GROUP_BLOCKS blocks, each masked to its own rows and context prefix, so training's hundreds
        of blocks per sequence read that sequence's K/V once instead of each a copy of it.
        """
        N, S = block_ids.shape
        B = ctx[0].k.shape[0]
        dev = block_ids.device
        if seq is None and B == N:  # decoding: each block reads its own row, nothing to group
            group = place = None
            n_groups, n, ids, anchors = N, 1, block_ids[:, None], ctx_len[:, None].to(dev)
        else:
            seq = (torch.zeros(N, dtype=torch.long, device=dev) if seq is None else seq).to(dev)
            group, place, n_groups, n, ids, anchors, ctx = self._groups(block_ids, ctx, ctx_len, seq)
        x = self.embed_tokens(ids.view(n_groups, n * S)).to(self.fc.weight.dtype)
        positions = (anchors[..., None] + torch.arange(S, device=dev)).view(n_groups, n * S)
        cos, sin = self.rope(positions, x.dtype)
        masks = self._masks(anchors, ctx[0].k.shape[2], S)
        for layer, kv, mask in zip(self.layers, ctx, masks):
            x = layer(x, kv, mask, cos, sin)
        h = self.norm(x).view(n_groups, n, S, -1)
        return h[:, 0] if group is None else h[group, place]

    def _groups(self, block_ids, ctx, ctx_len, seq):
        """Blocks [N, S] by the context row they read (seq [N]), each row's in order, cut into
        groups of at most GROUP_BLOCKS: (group and place of each block, the group count, the
        blocks per group, ids [G, n, S] and anchors [G, n] with padding blocks (anchor 0: no
        context, only themselves), ctx with one row per group)."""
        N, S = block_ids.shape
        B, dev = ctx[0].k.shape[0], block_ids.device
        order = torch.argsort(seq, stable=True)
        counts = torch.bincount(seq, minlength=B)
        first = torch.cumsum(counts, 0) - counts
        rank = torch.empty_like(seq)
        rank[order] = torch.arange(N, device=dev) - first[seq[order]]
        per_row = (counts + GROUP_BLOCKS - 1) // GROUP_BLOCKS  # groups of each context row
        group_base = torch.cumsum(per_row, 0) - per_row
        group = group_base[seq] + rank // GROUP_BLOCKS
        place = rank % GROUP_BLOCKS
        n_groups = int(per_row.sum())
        n = int(min(GROUP_BLOCKS, int(counts.max())))
        group_row = torch.repeat_interleave(torch.arange(B, device=dev), per_row)  # [G] context row of each group
        ids = block_ids.new_full((n_groups, n, S), self.spec.mask_token_id)
        ids[group, place] = block_ids
        anchors = ctx_len.new_zeros(n_groups, n)
        anchors[group, place] = ctx_len.to(dev)
        if B > 1 and (n_groups != B or not bool((group_row == torch.arange(B, device=dev)).all())):
            ctx = [LayerKV(kv.k[group_row], kv.v[group_row]) for kv in ctx]
        return group, place, n_groups, n, ids, anchors, ctx

    def block_states(self, anchors: torch.Tensor, ctx: ContextCache, rows: int | None = None) -> torch.Tensor:
        """Decoding's forward of the block [anchor, MASK, ...] (anchors [N]) over a context cache ->
        h [N, rows, H], the states of the first `rows` block rows (all by default; every row still
        shapes them: the block attends to itself), on the modules (`forward`): the modules' drafting
        path (engine/drafting.py; where dspark's kernels run, the phase is their one call)."""
        block = anchors.new_full((anchors.shape[0], self.spec.query_slots), self.spec.mask_token_id)
        block[:, 0] = anchors
        dtype = self.fc.weight.dtype
        valid = [LayerKV(kv.k.to(dtype), kv.v.to(dtype)) for kv in ctx.valid()]  # a cache made for the kernels
        return self(block, valid, ctx.lengths)[:, :rows]

    def head_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Decoding's draft head: h [..., H] -> logits [..., Vd]; Q8_0 on dspark's kernel where it
        runs (model/fast.py), else lm_head."""
        if fast.head_applies(self):
            return fast.for_draft(self).logits(h)
        return self.lm_head(h)

    def to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., Vd] -> target-vocabulary logits [..., V] (-inf outside the draft vocab)."""
        if self.d2t is None:
            return logits
        out = logits.new_full((*logits.shape[:-1], self.spec.vocab_size), float("-inf"))
        return out.index_copy(-1, self.to_target_ids(torch.arange(logits.shape[-1], device=logits.device)), logits)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary indices -> target token ids."""
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    def confidence_logits(self, h: torch.Tensor, prev_emb: torch.Tensor | None) -> torch.Tensor | None:
        if self.confidence_head is None:
            return None
        if self.spec.confidence_head_with_markov:
            if prev_emb is None:
                raise ValueError("a confidence head with markov reads the embeddings of the tokens before each slot")
            h = torch.cat([h, prev_emb.to(h.dtype)], dim=-1)
        return self.confidence_head(h)

    def new_context_cache(self, batch: int, device, dtype=None, kernels: bool | None = None) -> ContextCache:
        """An empty context cache for `batch` requests. kernels: whether dspark's compiled drafting
        phase runs on it (default: wherever it can run this draft, `fast.why_not`, unless another
        dtype than its bf16 is asked for; True where it cannot is refused with the reason); the
        choice is the context's for its whole life, so the drafting calls read it instead of
        deciding again. Its dtype: bf16 for the kernels, else `dtype` (default: the draft's weights')."""
        b = backbone_of(self.spec)
        reason = fast.why_not(self)
        if kernels is None:
            kernels = reason is None and dtype in (None, torch.bfloat16)
        if kernels:
            if reason is not None:
                raise ValueError(
                    f"a draft context for dspark's drafting kernels, which do not run this draft ({reason})"
                )
            if dtype not in (None, torch.bfloat16):
                raise ValueError(f"the drafting kernels' context is bf16, not {dtype}")
            dtype = torch.bfloat16
        elif dtype is None:
            dtype = self.fc.weight.dtype
        empty = torch.zeros(batch, b.num_key_value_heads, 0, b.head_dim, device=device, dtype=dtype)
        return ContextCache(
            [LayerKV(empty, empty) for _ in self.layers],
            torch.zeros(batch, dtype=torch.long, device=device),
            kernels=kernels,
        )

    @torch.inference_mode()
    def extend_context(self, cache: ContextCache, taps: torch.Tensor, counts: torch.Tensor) -> None:
        """Commit the first counts[b] rows of taps [B, n, n_taps*Ht] to each request's context."""
        if cache.kernels:
            return fast.for_draft(self).extend(cache, taps, counts)
        self.module_extend_context(cache, taps, counts)

    @torch.inference_mode()
    def module_extend_context(self, cache: ContextCache, taps: torch.Tensor, counts: torch.Tensor) -> None:
        """`extend_context` on the modules, whatever runs elsewhere (the modules' drafting path)."""
        positions = cache.lengths[:, None] + torch.arange(taps.shape[1], device=taps.device)[None, :]
        cache.append(self.context_kv(taps.to(self.fc.weight.dtype), positions), counts)
