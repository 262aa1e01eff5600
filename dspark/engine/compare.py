"""Where a speculative and a plain greedy output part, and whether that is a near-tie (docs/DESIGN.md §10)."""

from __future__ import annotations

import torch


def first_difference(model, prompt: list[int], spec: list[int], plain: list[int]) -> dict:
    """Where two greedy outputs part, and by how much the target's own logits separate the two
    choices there (one fresh forward of the shared prefix). A gap of a few hundredths in bf16 is
    a near-tie that the verify block and the one-token step rounded differently; a large gap
    would be a bug."""
    n = min(len(spec), len(plain))
    k = next((i for i in range(n) if spec[i] != plain[i]), n)
    if k == n:  # one output is a prefix of the other (a stop token near a tie)
        return {"token": k, "logit_gap": None}
    ids = torch.tensor([prompt + plain[:k]], device=model.device)
    with torch.inference_mode():
        logits = model(ids).logits[0, -1].float()
    return {"token": k, "logit_gap": round(abs(float(logits[spec[k]] - logits[plain[k]])), 4)}
