"""Issues 7 and 14: `dspark doctor` calls a correct draft healthy and names what is wrong with a
misread one, weak drafts included; too little text is "undecided", never "healthy".

The doctor needs drafts that really predict their target: the `trained` fixture of
tests/trained.py (a tiny target that learnt a pattern, a strong draft trained on its answers
and a weak one, acceptance length about 1.5).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace

import pytest
import torch
from dspark.api import EngineConfig, build_engine
from dspark.cli import main
from dspark.doctor.check import diagnose
from dspark.doctor.quick import quick_check
from dspark.doctor.readings import context_for, engines_walk, layout_readings, score_anchors
from dspark.doctor.report import EXIT_UNDECIDED, EXIT_UNHEALTHY, Budget
from dspark.doctor.texts import generate_texts
from dspark.engine.sampling import SamplingParams
from dspark.formats.convert import write_deepspec, write_speculators
from dspark.formats.load import force_layout
from dspark.model import fast
from dspark.model.load import build_draft, load_draft

from tests.tiny import engine_for
from tests.trained import MASK, TAPS


def _run(trained, draft_dir, **kw):
    engine = build_engine(EngineConfig(target=trained["target"], dtype="fp32", device="cpu", no_spec=True, check=False))
    return diagnose(engine, draft_dir, **kw)


def _variant(trained, name, writer, spec, strength="healthy"):
    """A copy of a trained draft whose config says `spec` (written once, atomically: xdist workers share it)."""
    path = trained["root"] / f"{strength}-{name}"
    if not path.exists():
        tmp = trained["root"] / f"{strength}-{name}.tmp{os.getpid()}"
        writer(spec, trained["tensors" if strength == "healthy" else "weak_tensors"], tmp)
        try:
            os.rename(tmp, path)
        except OSError:  # another worker got there first
            shutil.rmtree(tmp)
    return str(path)


def _spec(trained, strength):
    return trained["spec" if strength == "healthy" else "weak_spec"]


# The lies of issue 14: the layout flipped with block_size adjusted (the file stays consistent),
# the layout flag alone flipped (block_size kept), taps shifted by one, a wrong mask token.
LIES = {
    "flipped": (
        write_speculators,
        lambda s: layout_readings(s)[1][0],
        "the file says bonus-anchor (gamma 4, block_size 5) but the weights behave like anchor-first "
        "(gamma 4, block_size 4)",
        "set sample_from_anchor: true, block_size: 4 and speculative_tokens: 4",
    ),
    "flag": (
        write_speculators,
        lambda s: force_layout(s, "bonus_anchor"),
        "the file says bonus-anchor (gamma 3, block_size 4) but the weights behave like anchor-first",
        "set sample_from_anchor: true",
    ),
    "taps": (
        write_deepspec,
        lambda s: replace(s, hidden_state_indices=tuple(i - 1 for i in TAPS)),
        "the file says target_layer_ids [-1, 0] but the weights behave like [0, 1]",
        "set target_layer_ids: [0, 1]",
    ),
    "mask": (
        write_deepspec,
        lambda s: replace(s, mask_token_id=2),
        f"the file says mask_token_id 2 but the weights behave like mask_token_id {MASK}",
        f"set mask_token_id: {MASK}",
    ),
}


@pytest.mark.parametrize("strength", ["healthy", "weak"])
def test_correct_checkpoint_is_healthy(trained, strength):
    report = _run(trained, trained[strength])
    assert report.verdict == "healthy" and report.exit_code() == 0 and not report.diagnoses, report.to_json()
    declared = report.readings[0]
    tau = declared.accept_length
    assert declared.name == "declared" and (tau > 1.6 if strength == "healthy" else 1.2 <= tau <= 1.65), (
        tau
    )  # the weak drafts: tau about 1.3-1.6
    names = {r.name for r in report.readings}
    assert {
        "bonus-anchor",
        "bonus-anchor(block_size 4)",
        "taps-1",
        "mask=0",
        "mask=2",
        "bonus-anchor taps-1 mask=2",
    } <= names
    # every alternative reading was measured and excluded from being MIN_GAIN better
    assert all(c.status == "not better" for c in report.comparisons.values())
    assert all(c.status == "ok" for c in report.checks), report.checks


@pytest.mark.parametrize("strength", ["healthy", "weak"])
@pytest.mark.parametrize("lie", list(LIES))
def test_lies_are_diagnosed_naming_the_key(trained, strength, lie):
    writer, make, says, fix = LIES[lie]
    path = _variant(trained, lie, writer, make(_spec(trained, strength)), strength)
    report = _run(trained, path)
    assert report.verdict == "misread" and report.exit_code() == EXIT_UNHEALTHY, report.to_json()
    assert len(report.diagnoses) == 1, report.diagnoses
    msg = report.diagnoses[0]
    assert says in msg and fix in msg, msg
    c = report.comparisons[report.best.name]
    th = report.thresholds
    by_acceptance = c.gain >= th["min_gain"] and c.z >= th["z_better"]
    by_likelihood = c.ll_gain >= th["loglik_min_gain"] and c.ll_z >= th["z_better"] and c.z > -th["z_better"]
    assert c.status == "better" and {"acceptance": by_acceptance, "likelihood": by_likelihood}[c.by]
    assert c.tau_alt > c.tau_declared and c.ll_alt > c.ll_declared  # the true reading wins on both
    assert f"{c.tau_declared:.2f} -> {c.tau_alt:.2f} tokens per step" in msg
    assert f"{c.ll_declared:.2f} -> {c.ll_alt:.2f} nats per slot" in msg


def test_two_misreads_at_once_are_both_named(trained):
    """Wrong layout and shifted taps: every single change scores low, only the combination recovers."""
    both = replace(layout_readings(trained["spec"])[1][0], hidden_state_indices=tuple(i - 1 for i in TAPS))
    report = _run(trained, _variant(trained, "both", write_speculators, both))
    assert report.best.name == "anchor-first taps+1" and len(report.diagnoses) == 2, report.diagnoses
    assert "bonus-anchor (gamma 4, block_size 5) but the weights behave like anchor-first" in report.diagnoses[0]
    assert "aux_hidden_state_layer_ids [0, 1] but the weights behave like [1, 2]" in report.diagnoses[1]


def test_too_little_text_is_undecided_never_healthy(trained, capsys):
    """The weak healthy draft on 16 tokens: nothing is excluded yet, so the verdict is undecided."""
    report = _run(trained, trained["weak"], budget=Budget(prompts=1, tokens=16, max_tokens=16))
    assert report.verdict == "undecided" and report.exit_code() == EXIT_UNDECIDED and report.undecided
    assert not report.diagnoses
    rc = main(
        [
            "doctor",
            "--target",
            trained["target"],
            "--draft",
            trained["weak"],
            "--dtype",
            "fp32",
            "--device",
            "cpu",
            "--prompts-first",
            "1",
            "--tokens",
            "16",
            "--max-tokens",
            "16",
        ]
    )
    text = capsys.readouterr().out
    assert rc == EXIT_UNDECIDED and "undecided after" in text and "healthy" not in text
    # the same draft with the default budget is decided healthy
    assert _run(trained, trained["weak"]).verdict == "healthy"


def test_cli_json_and_table(trained, capsys):
    flipped = _variant(trained, "flipped", write_speculators, LIES["flipped"][1](trained["spec"]))
    rc = main(
        ["doctor", "--target", trained["target"], "--draft", flipped, "--dtype", "fp32", "--device", "cpu", "--json"]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == EXIT_UNHEALTHY and out["exit_code"] == rc and out["verdict"] == "misread"
    assert out["declared"]["layout"] == "bonus_anchor" and out["explained_by"] == "anchor-first"
    best = next(r for r in out["readings"] if r["name"] == "anchor-first")
    assert best["vs_declared"]["status"] == "better" and best["accept_length"] > out["readings"][0]["accept_length"]
    assert out["rounds"] and out["thresholds"]["min_gain"] == 0.03
    assert out["found_by"] == "behaviour" and set(out["fingerprint"]) == {"declared", "taps-1"}
    assert out["fingerprint"]["declared"]["taps"] == list(TAPS)
    rc = main(
        ["doctor", "--target", trained["target"], "--draft", trained["healthy"], "--dtype", "fp32", "--device", "cpu"]
    )
    text = capsys.readouterr().out
    assert rc == 0 and "healthy: no other reading gives 3% more tokens per step" in text and "taps-1" in text
    assert "misfit" in text  # the taps readings' fc fingerprint column
    # without --draft only smollm2 has a default (the bundled draft); any other target must name one
    assert main(["doctor", "--target", trained["target"], "--device", "cpu"]) == 2
    assert "no draft given" in capsys.readouterr().err
    assert main(["doctor", "--target", trained["target"], "--draft", flipped, "--max-tokens", "1"]) == 2


def test_nan_and_quantised_weights_fail_the_static_checks(trained):
    from safetensors.torch import load_file, save_file

    for name, edit in (
        ("nan", lambda t: t.float().index_fill_(0, torch.tensor([0]), float("nan"))),
        ("int8", lambda t: t.to(torch.int8)),
    ):
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


@pytest.mark.parametrize("strength", ["healthy", "weak"])
def test_quick_check_warns_on_a_layout_lie_and_restores_the_engine(trained, strength):
    model = trained["model"]
    flipped = _variant(trained, "flipped", write_speculators, LIES["flipped"][1](_spec(trained, strength)), strength)
    engine = engine_for(model, load_draft(flipped, model), eos_token_ids=(2,))
    warnings = quick_check(engine).warnings
    assert len(warnings) == 1 and warnings[0].startswith("LIKELY MISREAD: the file says bonus-anchor"), warnings
    assert "sample_from_anchor: true" in warnings[0]
    assert engine.target.tap_indices == TAPS  # the engine's taps are back
    healthy = engine_for(model, load_draft(trained[strength], model), eos_token_ids=(2,))
    check = quick_check(healthy)
    assert check.warnings == []
    # what the adaptive policy starts from: the declared reading's greedy acceptance per anchor
    assert (
        check.accepted.numel() > 0
        and 0 <= int(check.accepted.min()) <= int(check.accepted.max()) <= healthy.draft.spec.gamma
    )
    assert quick_check(engine_for(model, None)).warnings == []  # no draft: nothing to check


def test_measured_acceptance_is_the_engines(trained):
    """The doctor's per-anchor acceptance is what the engine's own speculative steps accept: run
    the engine (fp32, greedy) and compare at every anchor it verified."""
    model = trained["model"]
    draft = build_draft(trained["weak_spec"], model, trained["weak_tensors"])
    engine = engine_for(model, draft, eos_token_ids=(2,))
    steps = []

    class Recorder:  # a StepObserver
        def observe(self, res, running):
            steps.append(int(res.accepted[0]))

    engine.observers.append(Recorder())
    prompt = torch.randint(4, 64, (8,), generator=torch.Generator().manual_seed(5)).tolist()
    req = engine.generate(prompt, SamplingParams(max_new_tokens=48, ignore_eos=True))
    text = generate_texts(engine.target, None, (), [prompt], 48, TAPS)[0]
    assert text.ids[len(prompt) :].tolist() == req.output_ids  # the engine's plain decoding, same text
    L, _ = score_anchors(draft, draft.spec, text, draft.spec.gamma, context_for(draft, draft.spec, text))
    if fast.why_not(draft) is None:  # the engine drafts on the kernels: the doctor read their very walk
        anchors = torch.arange(len(prompt), text.ids.numel() - draft.spec.gamma + 1)
        assert torch.equal(engines_walk(draft, draft.spec, text, anchors, text.argmax), L)
    pos, measured = 0, []  # anchor index of each engine step: the first generated token, then after each commit
    for a in steps:
        if pos >= L.numel():
            break
        measured.append(int(L[pos]))
        pos += a + 1
    assert measured == steps[: len(measured)] and len(measured) >= 10 and sum(measured) > 0


def test_no_reading_is_dropped_on_a_handful_of_texts_and_explanations_stand_on_the_same_text(trained):
    """Issue 14, found calibrating weak SmolLM2 drafts: after 4 texts the long-run variance is too
    unreliable to exclude a reading (the true mask of a tau-1.14 draft was excluded there, and the
    diagnosis then carried an irrelevant taps change). Exclusion waits for MIN_TEXTS_TO_EXCLUDE
    texts, and the simpler readings of an explanation are measured on the evidence's text."""
    from dspark.bench.paired import MIN_TEXTS_TO_EXCLUDE
    from dspark.doctor.statistic import simpler_readings

    writer, make, _, _ = LIES["mask"]
    path = _variant(trained, "mask", writer, make(_spec(trained, "weak")), "weak")
    report = _run(trained, path, budget=Budget(prompts=4, tokens=64, max_tokens=4096))
    first = report.rounds[0]
    assert first["texts"] < MIN_TEXTS_TO_EXCLUDE and first["open"] == report.thresholds["alternatives"]
    best = report.best
    assert best is not None and best.name == f"mask={MASK}"
    combo = next(r for r in report.readings if r.name == f"taps-1 mask={MASK}")
    assert {r.name for r in simpler_readings(report.readings, combo)} == {f"mask={MASK}", "taps-1"}
    assert simpler_readings(report.readings, best) == []


def _series(seed, n, mean, sd):
    return mean + sd * torch.randn(n, 4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_likelihood_decides_where_acceptance_cannot_and_never_against_it():
    """paired.compare: a reading that gives the target's tokens clearly more log-probability is
    better even when acceptance cannot separate the two (a weak draft's shifted taps), unless its
    acceptance is itself clearly worse; excluded only when both statistics exclude it."""
    from dspark.bench.paired import compare

    n, segs = 2000, [200] * 10
    acc = torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(0))
    kw = dict(min_gain=0.03, z_better=3.7, z_not_better=2.8, ll_min_gain=0.02)
    declared_ll = _series(1, n, -5.0, 1.0)
    same_acc_better_ll = compare(acc, acc, segs, 4, ll=(declared_ll, declared_ll + 0.1), **kw)
    assert same_acc_better_ll.status == "better" and same_acc_better_ll.by == "likelihood"
    assert abs(same_acc_better_ll.ll_gain - 0.1) < 1e-9 and same_acc_better_ll.gain == 0.0
    worse_ll = compare(acc, acc, segs, 4, ll=(declared_ll, declared_ll - 0.1), **kw)
    assert worse_ll.status == "not better" and worse_ll.by == ""
    # more log-probability but clearly fewer accepted tokens: not a finding
    fewer = torch.zeros_like(acc)
    assert compare(acc, fewer, segs, 4, ll=(declared_ll, declared_ll + 0.1), **kw).status != "better"
    # equal on both, noise only: open or excluded, never better
    noisy = compare(acc, acc, segs, 4, ll=(declared_ll, _series(2, n, -5.0, 1.0)), **kw)
    assert noisy.status != "better"
    # acceptance alone still decides as before
    more = (acc + 1).clamp(max=4)
    assert compare(acc, more, segs, 4, ll=(declared_ll, declared_ll), **kw).by == "acceptance"

    # a healthy file on noisy text (docs/BENCHMARKS.md, "Checking a draft"): acceptance leaves a reading open a
    # little ahead of the declared one, while the draft's objective clearly prefers the declared reading
    def swapped(down: int, up: int) -> torch.Tensor:  # acc with `down` ones cleared and `up` zeros set
        g, o = torch.Generator().manual_seed(3), acc.clone()
        ones, zeros = (acc == 1).nonzero()[:, 0], (acc == 0).nonzero()[:, 0]
        o[ones[torch.randperm(len(ones), generator=g)[:down]]] = 0
        o[zeros[torch.randperm(len(zeros), generator=g)[:up]]] = 1
        return o

    other = swapped(300, 330)  # +1% acceptance length, far from significant
    alone = compare(acc, other, segs, 4, **kw)
    assert alone.status == "open" and 0 < alone.gain < kw["min_gain"], alone
    assert compare(acc, other, segs, 4, ll=(declared_ll, declared_ll - 0.1), **kw).status == "not better"
    # ... but not when acceptance shows the margin's advantage, nor when the likelihood is only a little lower
    wide = compare(acc, swapped(600, 700), segs, 4, ll=(declared_ll, declared_ll - 0.1), **kw)
    assert wide.gain >= kw["min_gain"] and wide.status == "open", wide
    slightly = compare(acc, other, segs, 4, ll=(declared_ll, declared_ll - 0.002 + _series(4, n, 0.0, 0.1)), **kw)
    assert slightly.ll_z_margin >= kw["z_not_better"] and -kw["z_better"] < slightly.ll_z < 0, slightly
    assert slightly.status == "open"


def test_weights_name_taps_that_behaviour_cannot_tell_apart(trained):
    """A barely trained draft as `dspark train` exports it (fc folded with its taps' per-dimension
    RMS; tests/trained.py scaled=True). Where behaviour cannot tell the taps readings apart (as on
    SmolLM2's weakly trained drafts, docs/history/benchmarks.md, "Calibration"), fc's weights name the true taps; they
    never outrank behaviour that prefers the declared taps, and a healthy file gets no finding."""
    from dspark.bench.paired import Comparison
    from dspark.doctor.check import weights_finding
    from dspark.doctor.readings import readings_for
    from dspark.doctor.report import Report

    from tests.trained import _train_draft

    draft = _train_draft(trained["model"], steps=15, scaled=True)
    engine = build_engine(EngineConfig(target=trained["target"], dtype="fp32", device="cpu", no_spec=True, check=False))
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(4, 64, (8,), generator=g).tolist() for _ in range(8)]
    texts = generate_texts(engine.target, None, (), prompts, 40, (0, 1, 2))
    lie = replace(draft.spec, hidden_state_indices=tuple(i - 1 for i in TAPS), format="speculators")

    def finding(spec, fc_of, ll_gain=0.0):
        """weights_finding where every reading behaves like the declared one (ll_gain aside)."""
        readings = readings_for(spec, 2, [])
        report = Report("", "", spec)
        for r in readings[1:]:
            report.comparisons[r.name] = Comparison(
                600, 4, 1.2, 1.2, 0.0, 0.0, 0.5, 4.0, "not better", -3.0, -3.0 + ll_gain, 0.0, 4.0
            )
        weights_finding(report, readings, fc_of, texts)
        return report

    r = finding(lie, draft)
    assert r.found_by == "weights" and r.best.name == "taps+1" and len(r.diagnoses) == 1, r.to_json()
    msg = r.diagnoses[0]
    assert "aux_hidden_state_layer_ids [0, 1] but fc's weights were fitted to [1, 2]" in msg, msg
    assert "Fix: set aux_hidden_state_layer_ids: [1, 2]" in msg and "1.20 -> 1.20" in msg
    assert r.fits["declared"].misfit >= 1.4 * r.fits["taps+1"].misfit
    assert not finding(lie, draft, ll_gain=-0.2).diagnoses  # behaviour prefers the declared taps: it decides
    healthy = finding(draft.spec, draft)
    assert not healthy.diagnoses and healthy.found_by == "" and set(healthy.fits) == {"declared", "taps-1"}
    # the fixture's drafts were fitted to raw taps: whatever their files say, the weights name nothing
    weak = load_draft(trained["weak"], trained["model"], dtype=torch.float32)
    assert not finding(weak.spec, weak).diagnoses and not finding(lie, weak).diagnoses
