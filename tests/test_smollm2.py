"""Slow checks on the real target (SmolLM2-135M-Instruct) with the bundled draft."""

import pytest
import torch
from dspark.api import BUNDLED_DRAFT, load_engine
from dspark.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a short poem about the sea.",
    "What are three tips for staying focused while studying?",
]


def _hf_greedy(model, ids, n):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=model.config.eos_token_id)
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def fp32_engine():
    return load_engine("smollm2", dtype="fp32", device="cpu", verify="full")  # every step drafts and verifies


def test_bundled_draft_is_used_and_accepts(fp32_engine):
    assert fp32_engine.draft is not None and fp32_engine.draft.spec.path == str(BUNDLED_DRAFT)
    ids = fp32_engine.encode(PROMPTS[0], chat=True)
    req = fp32_engine.generate(ids, SamplingParams(max_new_tokens=96))
    # a trained draft, not a silently broken one: a random draft of this shape accepts nothing
    assert req.metrics.accepted > 0 and req.metrics.mean_accept_length > 1.1


def test_greedy_equals_plain_decoding_fp32(fp32_engine):
    model = fp32_engine.target.model
    for prompt in PROMPTS:
        ids = fp32_engine.encode(prompt, chat=True)
        req = fp32_engine.generate(ids, SamplingParams(max_new_tokens=128))
        ref = _hf_greedy(model, ids, 128)
        assert req.output_ids == ref[: len(req.output_ids)]
        assert len(req.output_ids) == len(ref) or req.finish_reason == "stop"


def test_bf16_commits_only_target_argmax_within_a_small_gap():
    """bf16 contract (docs/DESIGN.md §10): every committed token is the target's argmax,
    up to a small logit gap, when the whole output is re-scored in one fp32 pass."""
    eng = load_engine("smollm2", dtype="bf16", device="cpu", verify="full")
    ref = load_engine("smollm2", no_spec=True, dtype="fp32", device="cpu").target.model
    for prompt in PROMPTS:
        ids = eng.encode(prompt, chat=True)
        req = eng.generate(ids, SamplingParams(max_new_tokens=96))
        seq = torch.tensor([ids + req.output_ids])
        with torch.no_grad():
            logits = ref(seq).logits[0, len(ids) - 1 : -1]
        chosen = logits.gather(1, torch.tensor(req.output_ids)[:, None]).squeeze(1)
        gap = (logits.max(-1).values - chosen).max().item()
        assert gap < 0.5, f"a committed token trails the fp32 argmax by {gap:.3f} logits"


def test_the_activations_flag_builds_the_kernels_it_names_and_stays_lossless():
    """`--activations bf16` is a setting a user passes, not an environment variable: on the AVX2 build
    the int4 matmuls then take bf16 activations (their own build), the start-up lines say so, and
    speculative output is still plain decoding's own in that numerics."""
    import json
    import subprocess
    import sys

    from dspark import kernels

    if kernels.q4_activations() is None:
        pytest.skip(f"no dspark kernel here: {kernels.q4_status()}")
    cmd = [sys.executable, "-m", "dspark", "generate", "--chat", "--prompt", PROMPTS[0], "--max-new-tokens", "24"]
    done = subprocess.run(
        cmd + ["--activations", "bf16", "--verify", "full", "--compare", "--json", "--no-check", "--threads", "2"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    runtime = next(line for line in done.stderr.splitlines() if line.startswith("runtime auto"))
    assert "int4 kernel" in runtime and "8-bit activations" not in runtime, runtime
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["plain"]["same_output"] is True and out["drafted_steps"] >= 3
