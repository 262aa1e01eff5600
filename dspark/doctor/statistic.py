"""The doctor's statistic: paired comparisons of readings and the diagnosis they support."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.bench.paired import Comparison, compare, z_for
from dspark.doctor.report import ALPHA, LL_MIN_GAIN, MIN_GAIN, PRETTY_LAYOUT, Reading
from dspark.formats.spec import query_slots_for

# ---- the statistic -----------------------------------------------------------------------------


@dataclass
class Rule:
    """The decision thresholds for one check (paired.compare)."""

    min_gain: float
    z_better: float
    z_not_better: float
    ll_min_gain: float = LL_MIN_GAIN

    def to_json(self) -> dict:
        return {
            "min_gain": self.min_gain,
            "loglik_min_gain": self.ll_min_gain,
            "alpha": ALPHA,
            "z_better": round(self.z_better, 3),
            "z_not_better": round(self.z_not_better, 3),
        }


def rule_for(alternatives: int, looks: int, min_gain: float = MIN_GAIN, alpha: float = ALPHA) -> Rule:
    """A false alarm needs any one of the alternatives to pass at any look: alpha is shared by all
    of them (Bonferroni). A miss needs the one true reading to be excluded at some look: alpha is
    shared by the looks only."""
    return Rule(min_gain, z_for(alpha, alternatives * looks), z_for(alpha, looks))


def add_scores(r: Reading, scored: tuple[torch.Tensor, torch.Tensor]) -> None:
    r.accepted.append(scored[0])
    r.loglik.append(scored[1])


def paired(a: Reading, b: Reading, rule: Rule) -> Comparison:
    """b against a on the texts both were measured on, over their common slots."""
    n = min(len(a.accepted), len(b.accepted))
    x, y = a.accepted[:n], b.accepted[:n]
    if not n:
        return compare(
            torch.zeros(0),
            torch.zeros(0),
            [],
            1,
            min_gain=rule.min_gain,
            z_better=rule.z_better,
            z_not_better=rule.z_not_better,
        )
    slots = min(a.spec.gamma, b.spec.gamma)
    ll = (torch.cat(a.loglik[:n]), torch.cat(b.loglik[:n]))
    return compare(
        torch.cat(x),
        torch.cat(y),
        [int(t.numel()) for t in x],
        slots,
        min_gain=rule.min_gain,
        z_better=rule.z_better,
        z_not_better=rule.z_not_better,
        ll=ll,
        ll_min_gain=rule.ll_min_gain,
    )


def leads(c: Comparison, rule: Rule, z: float) -> bool:
    """An alternative ahead of the declared reading by the rule's margin on either statistic, at
    z >= `z`: worth more text at load time (noise alone rarely puts a reading there; a misread's
    true reading stays there as the text grows)."""
    return (c.gain >= rule.min_gain and c.z >= z) or (c.ll_gain >= rule.ll_min_gain and c.ll_z >= z)


def explain(readings: list[Reading], comparisons: dict, rule: Rule) -> tuple[Reading | None, Reading | None, bool]:
    """(best, evidence, settled): the reading that explains a misread file with the fewest
    changes, the better reading whose numbers prove it, and whether the explanation is settled.

    Start from the better reading with the highest acceptance length (the evidence); then undo
    each change that is not needed (undoing it does not make the reading clearly worse), so that
    noise does not turn an irrelevant change into a second "finding". A layout change keeps gamma
    when keeping block_size is not clearly better (the consistent file is the likelier one). The
    explanation is settled when every undo taken rests on a reading that is itself better."""
    declared = readings[0]
    better = [r for r in readings[1:] if comparisons[r.name].status == "better"]
    if not better:
        return None, None, True
    # the likelihood ranks readings far more precisely than acceptance (paired.py); gains, each on
    # the slots the reading shares with the declared one, not levels over different slot counts
    evidence = best = max(better, key=lambda r: (comparisons[r.name].ll_gain, comparisons[r.name].gain))
    by_key = {r.key: r for r in readings}
    d = declared.spec

    def undos(r, f):
        if f == "layout":
            keep_gamma = query_slots_for(r.spec.layout, d.gamma)
            first = (
                [(r.spec.layout, keep_gamma, r.shift, r.spec.mask_token_id)] if r.spec.query_slots != keep_gamma else []
            )
            return first + [(d.layout, d.query_slots, r.shift, r.spec.mask_token_id)]
        if f == "hidden_state_indices":
            return [(r.spec.layout, r.spec.query_slots, 0, r.spec.mask_token_id)]
        return [(r.spec.layout, r.spec.query_slots, r.shift, d.mask_token_id)]

    settled, changed = True, True
    while changed:
        changed = False
        for f in best.factors:
            for key in undos(best, f):
                simpler = by_key.get(key)
                if (
                    simpler is None
                    or simpler is declared
                    or comparisons[simpler.name].status == "not better"
                    or paired(simpler, best, rule).status == "better"
                ):
                    continue
                settled = settled and comparisons[simpler.name].status == "better"
                best, changed = simpler, True
                break
            if changed:
                break
    return best, evidence, settled


def simpler_readings(readings: list[Reading], best: Reading) -> list[Reading]:
    """The readings that make some, not all, of `best`'s changes, each the way `best` makes it."""

    def same(r: Reading, f: str) -> bool:
        if f == "layout":
            return (r.spec.layout, r.spec.query_slots) == (best.spec.layout, best.spec.query_slots)
        if f == "hidden_state_indices":
            return r.shift == best.shift
        return r.spec.mask_token_id == best.spec.mask_token_id

    return [r for r in readings[1:] if set(r.factors) < set(best.factors) and all(same(r, f) for f in r.factors)]


_KEYS = {  # format -> (taps key, offset from hidden_state_indices to the file's value, mask key)
    "speculators": ("aux_hidden_state_layer_ids", 0, "mask_token_id"),
    "deepspec": ("target_layer_ids", -1, "mask_token_id"),
    "specforge": ("dflash_config.target_layer_ids", -1, "dflash_config.mask_token_id"),
    "deepseek_v4": ("dspark_target_layer_ids", -1, "dspark_noise_token_id"),
}


def says(spec) -> str:
    return "--layout forces" if spec.layout_source == "forced" else "the file says"


def layout_fix(declared, alt) -> str:
    """The config keys that make a file read as `alt` (docs/DESIGN.md §3)."""
    flag = "true" if alt.layout == "anchor_first" else "false"
    if declared.format == "speculators":
        return (
            f"set sample_from_anchor: {flag}, block_size: {alt.query_slots} and speculative_tokens: {alt.gamma} "
            f"in config.json, or run with --layout {alt.layout}"
        )
    if alt.layout == "bonus_anchor":
        return (
            f"{declared.format} files are read anchor-first: write it as a speculators file with "
            f"sample_from_anchor: false and block_size: {alt.query_slots}, or run with --layout bonus_anchor"
        )
    return (
        f"write it as a speculators file with sample_from_anchor: true and block_size: {alt.query_slots}, "
        "or run with --layout anchor_first"
    )


def taps_keys(d, a) -> tuple[str, list[int], list[int]]:
    """(the file's taps key, its value as declared, the value that reads the file as `a`)."""
    key, off, _ = _KEYS.get(d.format, ("hidden_state_indices", 0, "mask_token_id"))
    return key, [i + off for i in d.hidden_state_indices], [i + off for i in a.hidden_state_indices]


def diagnosis(declared: Reading, best: Reading, factor: str, cmp: Comparison, evidence: Reading) -> str:
    """One finding: what the file says, what the weights behave like, the numbers (of `evidence`,
    the better reading measured), and the config keys to change."""
    d, a = declared.spec, best.spec
    nums = (
        f"acceptance length {cmp.tau_declared:.2f} -> {cmp.tau_alt:.2f} tokens per step ({cmp.gain:+.0%}, "
        f"z {cmp.z:.1f}, p {cmp.p:.1g}), log-likelihood of the target's tokens {cmp.ll_declared:.2f} -> "
        f"{cmp.ll_alt:.2f} nats per slot (z {cmp.ll_z:.1f}, p {cmp.ll_p:.1g}); {cmp.anchors} anchors, {cmp.slots} slots"
    )
    if len(evidence.factors) > 1 or evidence is not best:
        nums += f" reading it as {evidence.name}"
    if factor == "layout":
        return (
            f"{says(d)} {PRETTY_LAYOUT[d.layout]} (gamma {d.gamma}, block_size {d.query_slots}) but the weights behave "
            f"like {PRETTY_LAYOUT[a.layout]} (gamma {a.gamma}, block_size {a.query_slots}): {nums}. Fix: "
            f"{layout_fix(d, a)} (docs/DESIGN.md §3)"
        )
    if factor == "hidden_state_indices":
        key, now, want = taps_keys(d, a)
        return (
            f"{says(d)} {key} {now} but the weights behave like {want} (hidden_state_indices shifted by "
            f"{best.shift:+d}: DeepSpec target_layer_ids t are speculators aux_hidden_state_layer_ids t+1): {nums}. "
            f"Fix: set {key}: {want}"
        )
    mask_key = _KEYS.get(d.format, ("hidden_state_indices", 0, "mask_token_id"))[2]
    return (
        f"{says(d)} {mask_key} {d.mask_token_id} but the weights behave like {mask_key} {a.mask_token_id}: "
        f"{nums}. Fix: set {mask_key}: {a.mask_token_id}"
    )
