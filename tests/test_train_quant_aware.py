"""`dspark train fit --quant-aware q4`: the draft trains against the Q4_1 values the engine holds
its matrices in, gradients straight through to the float weights that the export writes."""

import copy
import json

import pytest
import torch
from dspark.model import fast
from dspark.train.config import TrainConfig
from dspark.train.errors import TrainError
from dspark.train.quant_aware import make_quant_aware, matrices
from dspark.train.trainer import train

from tests.test_train_fit import cfg_for, setup  # noqa: F401  (the module fixture)
from tests.tiny import tiny_draft, tiny_target

torch.set_num_threads(1)


def test_q4_1_values_are_what_the_packed_matrix_holds():
    torch.manual_seed(0)
    w = torch.randn(32, 96)
    q, d, lo = fast.q4_1_groups(w)
    assert q.min() >= 0 and q.max() <= 15 and torch.equal(q, q.round())
    held = fast.q4_1_values(w)
    assert torch.equal(held, (q * d[..., None] + lo[..., None]).reshape(w.shape))
    assert float((held - w).abs().max()) <= float(d.max()) / 2 + 1e-6  # within half a step of every value
    assert torch.equal(fast.q4_1_values(held), held)  # a Q4_1 matrix rounds to itself


def _draft_and_input():
    model = tiny_target()
    draft = tiny_draft(model, taps=(1, 3)).float().train()
    torch.manual_seed(1)
    taps = torch.randn(1, 9, draft.fc.in_features)
    return draft, taps


def _loss(draft, taps):
    kv = draft.context_kv(taps, torch.arange(taps.shape[1])[None])
    return sum((a.k.square().sum() + a.v.sum()) for a in kv), kv


def test_the_forward_is_the_engines_q4_1_matrices_and_the_gradient_goes_straight_through():
    draft, taps = _draft_and_input()
    scale = torch.rand(draft.fc.in_features) + 0.5
    held = copy.deepcopy(draft)  # the float module at the values the engine will hold
    with torch.no_grad():
        for lin, ref in zip(matrices(draft), matrices(held)):
            w = lin.weight if lin is not draft.fc else lin.weight / scale[None, :]
            q = fast.q4_1_values(w.to(torch.bfloat16))
            ref.weight.copy_(q if lin is not draft.fc else q * scale[None, :])
    keys = set(draft.state_dict())
    assert make_quant_aware(draft, "q4", scale) == 1 + 7 * len(draft.layers)
    assert set(draft.state_dict()) == keys  # the export writes the float weights, under their names
    la, kva = _loss(draft, taps)
    lb, kvb = _loss(held, taps)
    for a, b in zip(kva, kvb):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    la.backward()
    lb.backward()
    for lin, ref in zip(matrices(draft), matrices(held)):
        if lin.weight.grad is not None or ref.weight.grad is not None:
            assert torch.equal(lin.weight.grad, ref.weight.grad)
    assert draft.fc.weight.grad is not None and draft.fc.weight.grad.abs().sum() > 0


def test_none_leaves_the_draft_and_other_formats_are_refused():
    draft, taps = _draft_and_input()
    before, _ = _loss(draft, taps)
    assert make_quant_aware(draft, "none") == 0
    after, _ = _loss(draft, taps)
    assert torch.equal(before, after)
    with pytest.raises(ValueError, match="quant-aware format"):
        make_quant_aware(draft, "q8")


def test_a_quant_aware_fit_trains_and_records_the_setting(setup, capsys):  # noqa: F811
    cfg = cfg_for(setup, "qat", quant_aware="q4", steps=6, eval_every=6, ckpt_every=6)
    result = train(cfg, progress=False, echo=print)
    assert "quant-aware: 8 matrices" in capsys.readouterr().out
    assert result.step == 6 and len(result.losses) == 6 and all(torch.isfinite(torch.tensor(result.losses)))
    saved = json.loads((setup["root"] / "qat" / "train_config.json").read_text())
    assert saved["quant_aware"] == "q4"
    with pytest.raises(TrainError, match="--quant-aware must be none or q4"):
        cfg_for(setup, "bad", quant_aware="q8").check()
    assert TrainConfig.__dataclass_fields__["quant_aware"].default == "none"
