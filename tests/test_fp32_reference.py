"""`--dtype fp32` means fp32 (issue 52): a speculators-format draft, as the `speculators` library
computes it, proposes in the engine exactly what that library's model proposes.

The reference decoder: the target's own greedy text (transformers, fp32) and, at each anchor the
engine drafted from, the library's `DSparkDraftModel` (fp32) over that text: greedy verification
accepts the leading slots whose argmax is the text's next token (while every earlier slot
matched, the Markov head's teacher-forced previous token is the walk's own). The engine, built
with nothing but `dtype="fp32"`, must accept exactly that many at every step of every prompt;
the compiled drafting phase (bf16 activations, Q4_1, Q8_0 or bf16 matrices), which explicit fp32
ran before, agreed on 3 of 4 prompts with the healthy draft (4 of 4 with the weak one)."""

from __future__ import annotations

import pytest
import torch
from dspark.api import EngineConfig, build_engine
from dspark.engine.sampling import SamplingParams
from dspark.formats.convert import write_speculators
from dspark.model import fast

from tests.trained import TAPS

PROMPTS = [
    [7, 12, 40, 9, 33, 21, 5, 18],
    [50, 4, 4, 61, 30, 11, 27, 8],
    [13, 22, 35, 46, 57, 13, 22, 35],
    [60, 9, 44, 17, 28, 39, 6, 52],
]
NEW = 40  # tokens the engine generates per prompt


def _speculators_draft(trained, name: str) -> str:
    """The trained draft written as a speculators file (the library's format, its verifier the target)."""
    path = trained["root"] / f"speculators-{name}"
    if not (path / "config.json").exists():
        spec, tensors = (
            (trained["spec"], trained["tensors"])
            if name == "healthy"
            else (
                trained["weak_spec"],
                trained["weak_tensors"],
            )
        )
        write_speculators(spec, tensors, path, verifier=trained["target"])
    return str(path)


def _library_model(path: str):
    spec_lib = pytest.importorskip("speculators.models.dspark")
    config = spec_lib.DSparkSpeculatorConfig.from_pretrained(path)
    config.transformer_layer_config._attn_implementation = "sdpa"  # flex attention needs a compiler on CPU
    model = spec_lib.DSparkDraftModel.from_pretrained(path, config=config, dtype=torch.float32).eval()
    assert model.config.sample_from_anchor and list(config.aux_hidden_state_layer_ids) == list(TAPS)
    return model


def _reference_accepted(library, target, ids: torch.Tensor, anchors: list[int], monkeypatch) -> list[int]:
    """Greedy acceptance of the library's block at each anchor position of the target's text `ids`."""
    import speculators.models.dflash.core as dflash_core
    import speculators.models.dspark.core as dspark_core

    captured = {}

    def capture(logits, *args, **kwargs):
        captured["logits"] = logits
        return torch.zeros(()), {}

    at = torch.tensor(anchors)
    monkeypatch.setattr(dspark_core, "compute_metrics", capture)
    monkeypatch.setattr(
        dflash_core, "select_anchors", lambda mask, n, bs: (at.clone(), torch.ones(n, dtype=torch.bool))
    )
    L, gamma = ids.shape[0], library.block_size
    # layer id i is the output of decoder layer i (the last one before the final norm, which
    # transformers' output_hidden_states applies to its last entry)
    layers, hidden = target.model.layers, {}
    hooks = [
        layers[i - 1].register_forward_hook(
            lambda m, a, out, i=i: hidden.__setitem__(i, out[0] if isinstance(out, tuple) else out)
        )
        for i in TAPS
    ]
    try:
        with torch.no_grad():
            target(ids[None])
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():
        library(
            hidden_states=torch.cat([hidden[i] for i in TAPS], -1),
            input_ids=ids[None],
            loss_mask=torch.ones(1, L),
            verifier_last_hidden_states=hidden[TAPS[-1]],  # the loss's targets only: not read here
            document_ids=torch.zeros(1, L, dtype=torch.long),
            max_anchors=len(anchors),
            loss_config={},
        )
    guess = captured["logits"].view(len(anchors), gamma, -1).argmax(-1)  # slot k predicts ids[p + k + 1]
    out = []
    for b, p in enumerate(anchors):
        hit = (guess[b] == ids[p + 1 : p + 1 + gamma]).tolist()
        out.append(hit.index(False) if False in hit else gamma)
    return out


@pytest.mark.parametrize("name", ["healthy", "weak"])
def test_fp32_reproduces_the_speculators_librarys_acceptance_step_for_step(trained, name, monkeypatch):
    path = _speculators_draft(trained, name)
    library, target = _library_model(path), trained["model"]
    engine = build_engine(
        EngineConfig(target=trained["target"], draft=path, dtype="fp32", device="cpu", verify="full", lookup=False)
    )
    assert engine.target.dtype == torch.float32 and engine.draft.fc.weight.dtype == torch.float32
    assert fast.weights(engine.draft) == "fp32" and fast.FP32_REASON in " ".join(engine.notes)
    gamma = engine.draft.spec.gamma
    steps: list[int] = []

    class Recorder:  # a StepObserver: what each step accepted
        def observe(self, res, running):
            steps.append(int(res.accepted[0]))

    engine.observers.append(Recorder())
    agree = 0
    for prompt in PROMPTS:
        steps.clear()
        req = engine.generate(prompt, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
        P = len(prompt)
        with torch.no_grad():  # the target's own greedy text, past the engine's last block
            text = target.generate(
                torch.tensor([prompt]),
                max_new_tokens=NEW + gamma + 1,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )[0]
        assert req.output_ids == text[P : P + NEW].tolist()  # fp32: lossless, token for token
        anchors, pos = [], P  # each drafting step's anchor: the first generated token, then after each commit
        for a in steps:
            if pos + gamma + 1 > P + NEW:  # a block the token budget cut short
                break
            anchors.append(pos)
            pos += a + 1
        assert len(anchors) >= 8
        reference = _reference_accepted(library, target, text, anchors, monkeypatch)
        assert steps[: len(anchors)] == reference, f"prompt {prompt}: engine {steps} vs library {reference}"
        agree += 1
    assert agree == len(PROMPTS) and sum(steps) > 0
