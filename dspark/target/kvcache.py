"""The native runtime's KV cache: one preallocated tensor for a batch, a length per row.

`commit` is a length update; rejected drafts are overwritten by the next forward; a ragged batch
is never repacked (each row writes at its own offset and attention reads up to its own length).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from dspark import hugepages

CACHE_CHUNK = 256  # KV capacity grows in multiples of this (doubling), so growth copies are rare


@dataclass
class NativeState:
    """KV cache of B requests: kv [L, 2, B, Hkv, C, D]; row b holds lengths[b] committed entries.

    Entries at >= lengths[b] are garbage (rejected drafts, padding) that the next forward
    overwrites; `pending` counts the entries the last forward appended, awaiting commit.
    """

    kv: torch.Tensor | None
    lengths: torch.Tensor  # [B] long
    pending: int = 0
    # (kv, [(K, V) of each layer]): made once per kv tensor, not 2 selects a layer every forward
    _views: tuple = field(default=(), repr=False, compare=False)

    def layer_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """[(keys, values) [B, Hkv, C, D] of each layer], views of kv."""
        if not self._views or self._views[0] is not self.kv:
            if self.kv is None:
                raise RuntimeError("layer_kv() before reserve(): the state holds no kv tensor yet")
            self._views = (self.kv, [(layer[0], layer[1]) for layer in self.kv])
        return self._views[1]

    @property
    def batch(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def capacity(self) -> int:
        return 0 if self.kv is None else int(self.kv.shape[4])

    def reserve(self, need: int, alloc) -> None:
        """Make room for `need` entries per row (rare: capacity doubles, in CACHE_CHUNK steps);
        alloc(batch, capacity) makes a zeroed kv tensor."""
        if need <= self.capacity:
            return
        cap = max(need, 2 * self.capacity)
        cap = -(-cap // CACHE_CHUNK) * CACHE_CHUNK
        kv = alloc(self.batch, cap)
        if self.kv is not None:
            kv[..., : self.capacity, :] = self.kv
        self.kv = kv

    def commit(self, keep: torch.Tensor) -> None:
        """Keep the first keep[b] pending entries of each row: a length update, nothing moves."""
        self.lengths = self.lengths + keep.to(self.lengths.device)
        self.pending = 0

    def select(self, rows: torch.Tensor) -> NativeState:
        """The sub-batch of `rows` (requests leaving drop out of the batch)."""
        kv = None if self.kv is None else self.kv[:, :, rows.to(self.kv.device)]
        return NativeState(kv, self.lengths[rows])

    @staticmethod
    def merge(states: list[NativeState], alloc) -> NativeState:
        """One batch from several states (a request joins after its own prefill)."""
        cap = max(s.capacity for s in states)
        kvs = [s.kv if s.kv is not None else alloc(s.batch, cap) for s in states]
        kvs = [F.pad(kv, (0, 0, 0, cap - kv.shape[4])) if kv.shape[4] < cap else kv for kv in kvs]
        return NativeState(torch.cat(kvs, 2), torch.cat([s.lengths for s in states]))


def alloc_kv(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed kv tensor; on a CPU in 2 MB pages where the OS gives them (attention reads it
    every step)."""
    if device.type == "cpu":
        return hugepages.huge_zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)
