"""Per-dimension scale of tapped hidden states: what the trainer divides taps by, and what the
doctor reads back from a draft's fc (docs/DESIGN.md §9, "weight fingerprint")."""

from __future__ import annotations

import torch

SINK_OUTLIER = 8.0  # a position whose RMS is this many times a tap's median is a sink: it sets no scale


def per_dim_rms(rows: torch.Tensor, n_taps: int, outlier: float = SINK_OUTLIER) -> torch.Tensor:
    """rows [N, n_taps * H] (positions x concatenated taps) -> [n_taps * H] per-dimension RMS.

    Residual streams carry a few sink positions at RMS ~1000 (SmolLM2) against ~20 elsewhere;
    positions `outlier` times a tap's median RMS are left out, so a handful of them does not set
    the scale of every dimension."""
    rows = rows.float()
    per_tap = rows.view(rows.shape[0], n_taps, -1)
    rms = per_tap.pow(2).mean(dim=2).sqrt()  # [N, n_taps]
    keep = (rms <= outlier * rms.median(dim=0).values).all(dim=1)
    if int(keep.sum()) < 2:
        keep = torch.ones_like(keep)
    return rows[keep].pow(2).mean(dim=0).sqrt().clamp_min(1e-3)
