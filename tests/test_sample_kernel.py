"""Sampling in one call (csrc/sample.cpp via ops.sample_accept) against torch's rule
(sampling.probs, rejection_accept, draw): the same shaped distribution, the same tokens for the
same uniforms, and the target's law exactly."""

from __future__ import annotations

import pytest
import torch
from dspark import kernels, ops
from dspark.engine.sampling import SamplingParams, draw, probs, rejection_accept, speculative_sample


@pytest.fixture(scope="module", autouse=True)
def ext():
    if kernels.extension() is None:
        pytest.skip(f"dspark's CPU kernels do not run here: {kernels.why_unavailable()}")


SHAPES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.3, top_k=7),
    SamplingParams(temperature=0.5, top_k=40, top_p=0.5),
]


def _case(seed: int, n: int, V: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n + 1, V, generator=g) * 3).to(dtype)
    q = torch.softmax(torch.randn(n, V, generator=g) * 3, -1)
    drafts = torch.multinomial(q, 1, generator=g)[:, 0] if n else torch.zeros(0, dtype=torch.long)
    return logits, q, drafts, g


@pytest.mark.parametrize("params", SHAPES, ids=["t1", "top_p", "top_k", "both"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_call_accepts_and_draws_what_torch_does(params, dtype):
    """Over random logits, proposals and uniforms: the call's (accepted, token) is torch's for the
    same uniforms, at every proposal length (0: plain sampling), ties in the logits included."""
    same = total = 0
    for seed in range(60):
        n = seed % 4
        logits, q, drafts, g = _case(seed, n, 300, dtype)
        if seed % 5 == 0:
            logits = logits.round()  # ties at the top-k / top-p edges
        u = torch.rand(n + 1, generator=g)
        if seed % 3 == 0 and n:  # make rejections and acceptances both common
            u[:n] = u[:n] * 0.2
        got = ops.sample_accept(logits, params.temperature, params.top_k, params.top_p, q if n else None, drafts, u)
        want = rejection_accept(probs(logits, params), q if n else logits[:0].float(), drafts, u)
        total += 1
        same += got == want
    assert same == total


def test_draws_follow_the_shaped_distribution():
    """Plain sampling through the call: each token's frequency over 20 000 draws is its shaped
    probability (top-k and top-p drop what probs drops, and nothing else)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 50, generator=g) * 2
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.8)
    p = probs(logits, params)[0]
    counts = torch.zeros(50)
    for _ in range(20_000):
        _, t = speculative_sample(logits, params, None, torch.zeros(0, dtype=torch.long), g)
        counts[t] += 1
    freq = counts / counts.sum()
    assert ((freq > 0) <= (p > 0)).all()  # nothing outside the kept set
    assert (freq - p).abs().max() < 0.015


def test_draw_is_the_inverse_cdf():
    p = torch.tensor([0.0, 0.25, 0.0, 0.5, 0.25])
    assert [draw(p, u) for u in (0.0, 0.24, 0.25, 0.74, 0.75, 0.9999)] == [1, 1, 3, 3, 4, 4]
    assert draw(p, 1.0) == 4  # past the sum's rounding: the last entry with mass


def test_broken_logits_and_bad_arguments():
    """NaN logits draw the first NaN's entry (the token torch.argmax gives); bad arguments name
    what is wrong."""
    logits = torch.zeros(1, 8)
    logits[0, 5] = float("nan")
    u = torch.tensor([0.3])
    assert ops.sample_accept(logits, 1.0, 0, 1.0, None, torch.zeros(0, dtype=torch.long), u) == (0, 5)
    ext = kernels.extension()
    with pytest.raises(RuntimeError, match="u must be"):
        ext.sample_accept(torch.zeros(2, 8), 1.0, 0, 1.0, torch.zeros(1, 8), torch.zeros(1, dtype=torch.long), u)
    with pytest.raises(RuntimeError, match="draft 9 outside the vocabulary of 8"):
        ext.sample_accept(
            torch.zeros(2, 8), 1.0, 0, 1.0, torch.zeros(1, 8), torch.tensor([9]), torch.tensor([0.1, 0.2])
        )
    with pytest.raises(RuntimeError, match="temperature > 0"):
        ext.sample_accept(torch.zeros(1, 8), 0.0, 0, 1.0, torch.zeros(0), torch.zeros(0, dtype=torch.long), u)
