"""Sequential Temperature Scaling: known-answer recovery, the metrics it reports, the file
the schedulers load, recording from the engine, and `dspark calibrate` end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest
from dspark.engine.calibration import (
    Calibration,
    auc,
    brier,
    ece,
    fit_sts,
    position_metrics,
    prefix_labels,
    record_generations,
    sigmoid,
)
from dspark.engine.sampling import SamplingParams
from dspark.engine.scheduler import VerifyPolicy
from dspark.errors import DSparkError

from tests.tiny import engine_for, tiny_draft, tiny_target


def synthetic(n: int, temps, seed: int):
    """Confidence logits z [n, g]; slot k is truly accepted (given its prefix) with
    probability sigmoid(z_k / temps[k]); the raw head (t = 1) is miscalibrated wherever
    temps[k] != 1. Returns (z, accepted [n], verified [n] = g)."""
    rng = np.random.default_rng(seed)
    g = len(temps)
    z = rng.normal(1.0, 2.0, size=(n, g))
    ok = rng.random((n, g)) < sigmoid(z / np.asarray(temps))
    accepted = np.where(ok.all(axis=1), g, (~ok).argmax(axis=1))
    return z, accepted, np.full(n, g)


def test_sts_recovers_known_temperatures_and_cuts_ece_on_held_out_data():
    truth = (2.0, 0.5, 1.0, 3.0)
    cal = fit_sts(*synthetic(15000, truth, seed=0))
    for fitted, t in zip(cal.temperatures, truth):
        assert abs(np.log(fitted / t)) < np.log(1.2), (cal.temperatures, truth)
    z, acc, ver = synthetic(15000, truth, seed=1)  # held out
    before = position_metrics(z, acc, ver, [1.0] * 4)
    after = position_metrics(z, acc, ver, cal.temperatures)
    for b, a in zip(before, after):
        assert a["ece"] < b["ece"] and a["ece"] < 0.02, (b, a)
        assert a["brier"] < b["brier"]
    assert sum(a["ece"] for a in after) < 0.4 * sum(b["ece"] for b in before)


def test_sts_keeps_a_calibrated_head():
    cal = fit_sts(*synthetic(15000, (1.0, 1.0, 1.0), seed=2))
    assert all(abs(np.log(t)) < np.log(1.2) for t in cal.temperatures), cal.temperatures


def test_prefix_labels_with_trimmed_blocks():
    # gamma 4: full block accepted 2; trimmed to 2 and both accepted (slots 2, 3 unknown);
    # trimmed to 3 with a rejection at slot 1 (later slots known dead)
    y, known = prefix_labels(np.array([2, 2, 1]), np.array([4, 2, 3]), 4)
    assert y.tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 0, 0, 0]]
    assert known.tolist() == [[True] * 4, [True, True, False, False], [True] * 4]
    # unknown labels never enter the fit: a slot with too few labels keeps temperature 1
    z = np.zeros((50, 2))
    cal = fit_sts(z, np.full(50, 1), np.full(50, 1))
    assert cal.temperatures[1] == 1.0


def test_metric_values():
    y = np.array([0, 0, 1, 1.0])
    assert auc(np.array([0.1, 0.2, 0.8, 0.9]), y) == 1.0
    assert auc(np.array([0.9, 0.8, 0.2, 0.1]), y) == 0.0
    assert auc(np.full(4, 0.5), y) == 0.5  # ties count half
    assert np.isnan(auc(np.full(4, 0.5), np.ones(4)))
    assert brier(np.array([1.0, 0.0]), np.array([0.0, 0.0])) == 0.5
    # two bins: {0.1, 0.1} with outcomes {0, 1} (gap 0.4) and {0.9} with outcome 1 (gap 0.1)
    assert ece(np.array([0.1, 0.1, 0.9]), np.array([0, 1, 1.0])) == pytest.approx((2 * 0.4 + 0.1) / 3)
    assert ece(np.array([1.0, 0.0]), np.array([1.0, 0.0])) == 0.0


def test_calibration_file_roundtrip_and_errors(tmp_path):
    path = tmp_path / "cal.json"
    Calibration((0.5, 2.0), {"target": "t"}).save(path)
    cal = Calibration.load(path)
    assert cal.temperatures == (0.5, 2.0) and cal.meta["target"] == "t"
    for bad, match in [
        ({"format": "other"}, "not a calibration file"),
        ({"format": "dspark-calibration", "gamma": 2, "temperatures": "1,2"}, "must be a list"),
        ({"format": "dspark-calibration", "gamma": 3, "temperatures": [1, 2]}, "differs"),
        ({"format": "dspark-calibration", "gamma": 2, "temperatures": [1, -2]}, "positive"),
    ]:
        path.write_text(json.dumps(bad))
        with pytest.raises(DSparkError, match=match):
            Calibration.load(path)
    path.write_text("{")
    with pytest.raises(DSparkError, match="not JSON"):
        Calibration.load(path)
    with pytest.raises(DSparkError, match="does not exist"):
        Calibration.load(tmp_path / "missing.json")


class _Trim(VerifyPolicy):
    def verify_lengths(self, prop, batch):
        return prop.tokens.new_zeros(prop.tokens.shape[0])


def test_record_generations_forces_full_verification_and_leaves_the_engine_alone():
    model = tiny_target()
    draft = tiny_draft(model)
    trim = _Trim()
    eng = engine_for(model, draft, max_batch=2, policy=trim)
    rec, reqs = record_generations(eng, [[5, 6, 7], [9, 10], [11]], [SamplingParams(max_new_tokens=6)] * 3)
    assert eng.policy is trim and eng.observers == [] and eng.metrics.steps == 0
    z, acc, ver = rec.arrays()
    # one record per (step, request): every request's own steps
    assert z.shape == (len(acc), draft.spec.gamma) and len(acc) == sum(r.metrics.steps for r in reqs)
    assert (ver == draft.spec.gamma).all()
    one = rec.arrays({reqs[0].id})
    assert 0 < len(one[1]) < len(acc)
    with pytest.raises(DSparkError, match="confidence head"):
        record_generations(engine_for(model, tiny_draft(model, confidence_head=False)), [[5]], [SamplingParams()])


def test_calibrate_cli(tmp_path, capsys):
    from dspark.cli import main
    from dspark.engine.scheduler import make_scheduler
    from dspark.formats.convert import write_deepspec

    model = tiny_target()
    draft = tiny_draft(model)
    model.save_pretrained(tmp_path / "target")
    write_deepspec(draft.spec, draft.own_state_dict(), tmp_path / "draft")
    prompts = [[5 + i, 6 + 2 * i, 7] for i in range(8)]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps({"prompt_ids": p}) for p in prompts))
    out = tmp_path / "cal.json"
    args = [
        "calibrate",
        "--target",
        str(tmp_path / "target"),
        "--draft",
        str(tmp_path / "draft"),
        "--dtype",
        "fp32",
        "--device",
        "cpu",
        "--prompts",
        str(tmp_path / "p.jsonl"),
        "--out",
        str(out),
        "--max-new-tokens",
        "12",
        "--concurrency",
        "4",
    ]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "ECE before" in text and "Brier after" in text and "wrote" in text
    data = json.loads(out.read_text())
    assert data["gamma"] == draft.spec.gamma and data["records"]["eval"] > 0
    assert len(data["metrics"]["before"]) == len(data["metrics"]["after"]) == draft.spec.gamma
    eng = engine_for(model, draft)
    assert make_scheduler("threshold", eng.target, eng.draft, calibration=out).calibration.temperatures == tuple(
        data["temperatures"]
    )
    (tmp_path / "bad.jsonl").write_text('{"question": "x"}\n')
    assert main(args[:-6] + ["--prompts", str(tmp_path / "bad.jsonl"), "--out", str(out)]) == 2
    assert 'expected a "prompt_ids"' in capsys.readouterr().err
