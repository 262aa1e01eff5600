"""Issue 7: `dspark doctor` calls a correct draft healthy and names what is wrong with a misread one.

The doctor needs a draft that really predicts its target: the `trained` fixture of
tests/trained.py (a tiny target that learnt a pattern, a draft trained on its answers).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace

import torch

from dspark.api import EngineConfig, build_engine
from dspark.bench.doctor import EXIT_UNHEALTHY, diagnose, quick_check
from dspark.cli import main
from dspark.formats.convert import write_deepspec, write_speculators
from dspark.formats.load import force_layout, load_spec
from tests.tiny import engine_for
from tests.trained import MASK, TAPS


def _run(trained, draft_dir):
    engine = build_engine(EngineConfig(target=trained["target"], no_spec=True, dtype="fp32", device="cpu", check=False))
    return diagnose(engine, draft_dir)


def _variant(trained, name, writer, spec):
    """A copy of the trained draft whose config says `spec` (written once, atomically: xdist workers share it)."""
    path = trained["root"] / name
    if not path.exists():
        tmp = trained["root"] / f"{name}.tmp{os.getpid()}"
        writer(spec, trained["tensors"], tmp)
        try:
            os.rename(tmp, path)
        except OSError:  # another worker got there first
            shutil.rmtree(tmp)
    return str(path)


def test_correct_checkpoint_is_healthy(trained):
    report = _run(trained, trained["healthy"])
    assert report.healthy and report.exit_code() == 0 and not report.diagnoses
    declared = report.readings[0]
    assert declared.name == "declared" and declared.agreement > 0.4
    names = {r.name for r in report.readings}
    # every alternative reading was measured, and each is clearly worse than the declared one
    assert {"bonus-anchor", "taps-1", "mask=0", "mask=2", "bonus-anchor taps-1 mask=2"} <= names
    for r in report.readings[1:]:
        assert r.agreement < declared.agreement - 0.2, r.name
        assert not report.comparisons[r.name]["better"]
    assert all(c.status == "ok" for c in report.checks), report.checks


def test_flipped_layout_is_diagnosed(trained):
    path = _variant(trained, "flipped", write_speculators, force_layout(trained["spec"], "bonus_anchor"))
    assert load_spec(path).layout == "bonus_anchor"  # the file really says bonus-anchor
    report = _run(trained, path)
    assert report.exit_code() == EXIT_UNHEALTHY and len(report.diagnoses) == 1
    msg = report.diagnoses[0]
    assert msg.startswith("the file says bonus-anchor but the weights behave like anchor-first: per-slot agreement")
    assert report.best.name == "anchor-first"
    declared, best = report.readings[0].agreement, report.best.agreement
    assert f"{declared:.2f} vs {best:.2f}" in msg and best > declared + 0.4


def test_shifted_layer_ids_are_diagnosed(trained):
    shifted = replace(trained["spec"], hidden_state_indices=tuple(i - 1 for i in TAPS))
    report = _run(trained, _variant(trained, "shifted", write_deepspec, shifted))
    assert report.exit_code() == EXIT_UNHEALTHY and len(report.diagnoses) == 1
    assert "the file says hidden_state_indices [0, 1] but the weights behave like [1, 2] (shifted by +1" \
        in report.diagnoses[0]


def test_wrong_mask_id_is_diagnosed(trained):
    # eos as the mask: a plausible slip; the doctor tries the config's special ids and finds 1
    report = _run(trained, _variant(trained, "mask", write_deepspec, replace(trained["spec"], mask_token_id=2)))
    assert report.exit_code() == EXIT_UNHEALTHY and len(report.diagnoses) == 1
    assert report.diagnoses[0].startswith(
        f"the file says mask_token_id 2 but the weights behave like mask_token_id {MASK}: per-slot agreement")


def test_two_misreads_at_once_are_both_named(trained):
    """Wrong layout and shifted taps: every single change still scores ~0, only the combination recovers."""
    both = replace(force_layout(trained["spec"], "bonus_anchor"), hidden_state_indices=tuple(i - 1 for i in TAPS))
    report = _run(trained, _variant(trained, "both", write_speculators, both))
    singles = [r for r in report.readings if len(r.factors) == 1]
    assert max(r.agreement for r in singles) < 0.1
    assert report.best.name == "anchor-first taps+1" and len(report.diagnoses) == 2
    assert "bonus-anchor but the weights behave like anchor-first" in report.diagnoses[0]
    assert "hidden_state_indices [0, 1] but the weights behave like [1, 2]" in report.diagnoses[1]


def test_cli_json_and_table(trained, capsys):
    flipped = _variant(trained, "flipped", write_speculators, force_layout(trained["spec"], "bonus_anchor"))
    rc = main(["doctor", "--target", trained["target"], "--draft", flipped, "--dtype", "fp32", "--device", "cpu",
               "--tokens", "24", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == EXIT_UNHEALTHY and out["exit_code"] == rc and out["healthy"] is False
    assert out["declared"]["layout"] == "bonus_anchor"
    best = next(r for r in out["readings"] if r["name"] == "anchor-first")
    assert best["vs_declared"]["better"] and best["agreement"] > out["readings"][0]["agreement"]
    rc = main(["doctor", "--target", trained["target"], "--draft", trained["healthy"], "--dtype", "fp32",
               "--device", "cpu", "--tokens", "24"])
    text = capsys.readouterr().out
    assert rc == 0 and "healthy: the declared reading is the best one tried" in text and "taps-1" in text
    # without --draft only smollm2 has a default (the bundled draft); any other target must name one
    assert main(["doctor", "--target", trained["target"], "--device", "cpu"]) == 2
    assert "no draft given" in capsys.readouterr().err


def test_nan_and_quantised_weights_fail_the_static_checks(trained):
    from safetensors.torch import load_file, save_file

    for name, edit in (("nan", lambda t: t.float().index_fill_(0, torch.tensor([0]), float("nan"))),
                       ("int8", lambda t: t.to(torch.int8))):
        path = trained["root"] / f"broken-{name}-{os.getpid()}"
        if not path.exists():
            shutil.copytree(trained["healthy"], path)
            tensors = load_file(path / "model.safetensors")
            tensors["fc.weight"] = edit(tensors["fc.weight"])
            save_file(tensors, path / "model.safetensors")
        report = _run(trained, str(path))
        failed = {c.name for c in report.checks if c.status == "fail"}
        assert failed == ({"finite weights"} if name == "nan" else {"dtype"}), report.checks
        assert report.exit_code() == EXIT_UNHEALTHY and not report.readings  # not measured: it cannot be trusted


def test_quick_check_warns_on_a_misread_draft_and_restores_the_engine(trained):
    from dspark.model.load import load_draft

    model = trained["model"]
    flipped = _variant(trained, "flipped", write_speculators, force_layout(trained["spec"], "bonus_anchor"))
    engine = engine_for(model, load_draft(flipped, model), eos_token_ids=(2,))
    warnings = quick_check(engine)
    assert len(warnings) == 1 and "bonus-anchor but the weights behave like anchor-first" in warnings[0]
    assert engine.target.tap_indices == TAPS  # the engine's taps are back
    healthy = engine_for(model, load_draft(trained["healthy"], model), eos_token_ids=(2,))
    assert quick_check(healthy) == []
    assert quick_check(engine_for(model, None)) == []  # no draft: nothing to check
