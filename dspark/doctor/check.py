"""The sequential check: readings measured on more text until a verdict."""

from __future__ import annotations

import time

import torch

from dspark.bench import fingerprint
from dspark.bench.paired import MIN_TEXTS_TO_EXCLUDE, Comparison
from dspark.doctor.readings import (
    context_for,
    mask_candidates,
    readings_for,
    score_anchors,
)
from dspark.doctor.report import (
    FACTORS,
    LL_MIN_GAIN,
    LOW_FIRST_SLOT,
    MIN_GAIN,
    Budget,
    Reading,
    Report,
    Text,
)
from dspark.doctor.static import static_checks
from dspark.doctor.statistic import (
    Rule,
    add_scores,
    diagnosis,
    explain,
    leads,
    paired,
    rule_for,
    says,
    simpler_readings,
    taps_keys,
)
from dspark.doctor.texts import generate_texts, prompt_pool
from dspark.engine.engine import Engine
from dspark.formats.load import load_spec
from dspark.model import fast
from dspark.model.load import build_draft

# ---- the sequential check ----------------------------------------------------------------------


def measure(
    target,
    draft,
    tokenizer,
    *,
    eos,
    prompts=None,
    budget: Budget | None = None,
    extra_masks=(),
    report: Report | None = None,
    full_grid: bool = True,
    rule: Rule | None = None,
) -> Report:
    """Write text round by round, measure the readings still open, decide (module docstring)."""
    t_start = time.perf_counter()
    spec = draft.spec
    budget = budget or Budget()
    report = report or Report("", spec.path or "", spec)
    cands = mask_candidates(spec, tokenizer, target.config, target.vocab_size, extra_masks)
    readings = readings_for(spec, target.num_layers, cands, full_grid)
    plan = budget.rounds()
    rule = rule or rule_for(len(readings) - 1, len(plan))
    report.readings, report.thresholds = (
        readings,
        {**rule.to_json(), "looks": len(plan), "alternatives": len(readings) - 1},
    )
    taps = sorted({i for r in readings for i in r.spec.hidden_state_indices})
    g_max = max(r.spec.gamma for r in readings)
    source = prompt_pool(tokenizer, target.vocab_size, prompts)
    declared, open_ = readings[0], list(readings[1:])
    generated = n_texts = 0
    kept: list = []  # every text so far: readings dropped early are measured again when they matter
    for k, n in enumerate(plan):
        t0 = time.perf_counter()
        batch = [next(source) for _ in range(n)]
        texts = generate_texts(target, tokenizer, eos, batch, budget.tokens, taps)
        generated += sum(int(t.ids.shape[0]) - t.prompt_len for t in texts)
        n_texts += len(texts)
        t1 = time.perf_counter()
        with torch.inference_mode():
            for text in texts:
                ctx: dict = {}
                for r in [declared, *open_]:
                    shift = r.shift
                    if shift not in ctx:
                        ctx[shift] = context_for(draft, r.spec, text)
                    add_scores(r, score_anchors(draft, r.spec, text, g_max, ctx[shift]))
        kept.extend(texts)
        for r in open_:
            report.comparisons[r.name] = paired(declared, r, rule)
        if n_texts >= MIN_TEXTS_TO_EXCLUDE:
            open_ = [r for r in open_ if report.comparisons[r.name].status != "not better"]
        report.rounds.append(
            {
                "round": k + 1,
                "texts": len(texts),
                "generated_tokens": generated,
                "anchors": declared.anchors,
                "open": len(open_),
                "seconds_generate": round(t1 - t0, 2),
                "seconds_readings": round(time.perf_counter() - t1, 2),
            }
        )
        if declared.anchors == 0:
            continue
        if any(report.comparisons[r.name].status == "better" for r in open_):
            if explain(readings, report.comparisons, rule)[2]:
                break  # otherwise more text decides which changes are needed
        if not open_:
            break
        if (
            budget.stop_when_quiet
            and n_texts >= MIN_TEXTS_TO_EXCLUDE
            and not any(leads(report.comparisons[r.name], rule, budget.quiet_z) for r in open_)
        ):
            break
    report.measured = declared.anchors > 0
    report.texts = {"prompts": n_texts, "generated_tokens": generated, "anchors": declared.anchors}
    report.seconds += time.perf_counter() - t_start
    if not report.measured:
        report.warnings.append(
            f"the target generated too few tokens for a block of {g_max}: nothing measured "
            "(raise --tokens or give longer prompts)"
        )
        return report
    best, evidence, _ = explain(readings, report.comparisons, rule)
    for _ in FACTORS:  # each pass can only remove a change, so this ends
        # The simpler readings an explanation is judged against must stand on the same text as the
        # evidence: one dropped early would keep an irrelevant change in the diagnosis.
        # explain() names both or neither
        stale = (
            [r for r in simpler_readings(readings, best) if r.anchors < evidence.anchors]
            if best is not None and evidence is not None
            else []
        )
        if not stale:
            break
        with torch.inference_mode():
            for r in stale:
                for text in kept[len(r.accepted) :]:
                    add_scores(r, score_anchors(draft, r.spec, text, g_max, context_for(draft, r.spec, text)))
                report.comparisons[r.name] = paired(declared, r, rule)
        best, evidence, _ = explain(readings, report.comparisons, rule)
    if best is not None and evidence is not None:  # explain() names both or neither
        report.best, report.found_by = best, "behaviour"
        report.diagnoses = [
            diagnosis(declared, best, f, report.comparisons[evidence.name], evidence) for f in best.factors
        ]
    weights_finding(report, readings, draft, kept)
    top = max(r.per_slot[0] if r.per_slot else 0.0 for r in readings if r.accepted)
    if best is None and top < LOW_FIRST_SLOT:
        report.warnings.append(
            f"the draft's first token is accepted {top:.0%} of the time under every reading tried: an untrained "
            "draft, a draft for another target, or a mismatch this doctor does not vary (RoPE settings, dtype)"
        )
    return report


def weights_finding(report: Report, readings: list[Reading], draft, texts: list[Text]) -> None:
    """Taps that behaviour cannot tell apart, named by fc's weights (bench/fingerprint.py).

    Fits every taps reading (reported); decides only where behaviour found nothing: a shifted-taps
    reading whose layers fc fits FIT_RATIO times better than the declared ones, and which behaves
    as well as the declared reading (no worse than either margin on either statistic), is a
    finding. A draft trained on raw taps has no fingerprint (its profile explains too little of
    fc's column norms, `fingerprint.points_to`) and never gets one."""
    declared = readings[0]
    taps_only = [r for r in readings if r.factors in ((), ("hidden_state_indices",))]
    layers = {i for r in taps_only for i in r.spec.hidden_state_indices}
    rms = fingerprint.layer_rms([(t.taps, t.prompt_len) for t in texts], layers)
    report.fits = {r.name: fingerprint.tap_fit(draft.fc.weight, rms, r.spec.hidden_state_indices) for r in taps_only}
    base = report.fits[declared.name]
    if report.best is not None:
        return
    for r in taps_only[1:]:
        fit, cmp = report.fits[r.name], report.comparisons.get(r.name)
        if cmp is None or not fingerprint.points_to(base, fit):
            continue
        if cmp.gain <= -MIN_GAIN or cmp.ll_gain <= -LL_MIN_GAIN:
            continue  # behaviour prefers the declared taps: it outranks the weights' shape
        report.best, report.found_by = r, "weights"
        report.diagnoses = [taps_diagnosis(declared.spec, r, base, fit, cmp)]
        return


def taps_diagnosis(d, r: Reading, base, fit, cmp: Comparison) -> str:
    key, now, want = taps_keys(d, r.spec)
    return (
        f"{says(d)} {key} {now} but fc's weights were fitted to {want} (hidden_state_indices shifted by "
        f"{r.shift:+d}): fc's column norms follow the per-dimension scale of those layers' hidden states "
        f"(misfit {fit.misfit:.4f} against {base.misfit:.4f} for the declared layers, correlation "
        f"{fit.correlation:.2f}; `dspark train` folds each tap's scale into fc), while this draft's behaviour "
        f"cannot tell the two apart (acceptance length {cmp.tau_declared:.2f} -> {cmp.tau_alt:.2f}, "
        f"log-likelihood {cmp.ll_declared:.2f} -> {cmp.ll_alt:.2f} nats per slot; {cmp.anchors} anchors). "
        f"Fix: set {key}: {want}"
    )


# ---- entry points ------------------------------------------------------------------------------


def check_engine(
    engine,
    *,
    prompts=None,
    budget: Budget | None = None,
    extra_masks=(),
    full_grid: bool = True,
    report: Report | None = None,
) -> Report:
    """The measured part of the doctor on an assembled engine (its target, draft, tokenizer, EOS).
    Leaves the engine as it found it (its target's taps are restored)."""
    return measure(
        engine.target,
        engine.draft,
        engine.tokenizer,
        eos=engine.eos_token_ids,
        prompts=prompts,
        budget=budget,
        extra_masks=extra_masks,
        report=report,
        full_grid=full_grid,
    )


def diagnose(
    engine,
    draft_path: str,
    *,
    budget: Budget | None = None,
    prompts: list | None = None,
    extra_masks=(),
    layout: str | None = None,
) -> Report:
    """The full doctor: static checks, then the sequential check of every reading.

    engine: a target-only engine (dspark.api.build_engine with no_spec): the draft is built here,
    from a spec read without value checks, because a broken draft is what the doctor reports on.
    layout: force the declared reading's layout (as --layout does for decoding)."""
    t0 = time.perf_counter()
    target, tokenizer = engine.target, engine.tokenizer
    spec = load_spec(draft_path, layout=layout, check_values=False)  # values are checked below, and reported
    name = engine.config.target if engine.config is not None else ""
    report = Report(name, str(draft_path), spec)
    checks, tensors = static_checks(spec, target.checkpoint, tokenizer, target.dtype)
    report.checks = checks
    if tensors is None or any(c.status == "fail" for c in checks if c.name in ("vocabulary", "dtype")):
        return report  # a draft that cannot be built for this target is not measured
    draft = build_draft(spec, target.checkpoint, tensors, dtype=target.dtype)
    if engine.config is not None:  # the numbers asked for (--draft-weights, fp32 under --dtype fp32)
        fast.set_weights(draft, engine.config.draft_weights)
    with_draft = Engine(target, draft, tokenizer, engine.eos_token_ids)
    report.seconds = time.perf_counter() - t0
    return check_engine(with_draft, prompts=prompts, budget=budget, extra_masks=extra_masks, report=report)


# Load time: four prompts of 64 tokens, then eight (a handful of texts can point the wrong way:
# a barely trained draft's layout lie looked healthy on the first four); more text (doubling)
# only while some open alternative leads the declared reading (`leads`), up to 3072 tokens.
