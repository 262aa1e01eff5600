"""`dspark generate` (the README's main job) from the command line: streaming text, statistics,
`--compare` against plain decoding in the same run, and how a bf16 difference is explained."""

from __future__ import annotations

import json

import torch
from dspark.api import EngineConfig, build_engine
from dspark.bench.runner import side_by_side
from dspark.cli import main
from dspark.engine.compare import first_difference
from dspark.engine.sampling import SamplingParams

from tests.test_serve_cli import saved  # noqa: F401  (fixture: a tiny target with SmolLM2's tokenizer + a draft)
from tests.tiny import tiny_target


def test_generate_compare_json_reports_speedup_and_identical_output(saved, capsys):  # noqa: F811
    target, draft = saved
    args = [
        "generate",
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--dtype",
        "fp32",
        "--device",
        "cpu",
        "--prompt",
        "Name three rivers.",
        "--chat",
        "--max-new-tokens",
        "12",
        "--compare",
        "--json",
        "--no-check",
    ]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["speculative"] and out["dtype"] == "fp32" and out["generated_tokens"] >= 1
    assert out["plain"]["same_output"] is True and "first_difference" not in out["plain"]  # fp32: token for token
    ratio = round(out["tokens_per_second"] / out["plain"]["tokens_per_second"], 3)
    assert out["arms_ratio"] == ratio
    # a speedup only where a step drafted: otherwise both arms ran plain decoding and it is said so
    assert out["speedup"] == (ratio if out["drafted_steps"] else None)
    assert 0 <= out["drafted_steps"] <= out["timed_steps"] and out["timed_steps"] >= 3  # 3 rounds, >= 1 step each
    assert out["compare_rounds"] == 3  # warmed up, then three rounds of the arms stepping in turn
    rounds = out["speedup_rounds"]  # each round's own ratio, around the overall one
    assert len(rounds) == 3 and min(rounds) <= ratio + 1e-3 and max(rounds) >= ratio - 1e-3
    assert main(args + ["--compare-rounds", "0"]) == 2 and "--compare-rounds" in capsys.readouterr().err
    assert main(args + ["--verify", "full"]) == 0  # drafts every step: a speedup, measured
    full = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert full["drafted_steps"] >= 3 and full["speedup"] == full["arms_ratio"]
    assert out["plain"]["sampled"] is False
    # sampled arms draw differently: the table says their outputs are not compared, not that they differ
    sampled = [a for a in args if a != "--json"] + ["--temperature", "1.0", "--seed", "3"]
    assert main(sampled) == 0
    table = capsys.readouterr().out
    assert "not compared (sampled" in table or "│ True" in table
    m = out["metrics"]
    assert m["verify_steps"] + m["plain_steps"] >= 1  # adaptive (the default) may skip drafting throughout
    if m["verify_steps"]:
        assert m["mean_accept_length"] == round(1 + sum(m["marginal_accept_rates"]), 4)


def test_generate_no_draft_compares_lookup_speculation_with_plain(saved, capsys):  # noqa: F811
    """--no-draft: the target speculates from the text alone (no draft loaded, none named); --compare
    measures it against plain decoding, the same output in fp32; the doctor and train eval, which
    examine a draft, refuse the flag by name."""
    target, _ = saved
    text = "one two three four five six seven. one two three four five six seven. one two three"
    args = ["generate", "--target", str(target), "--no-draft", "--dtype", "fp32", "--device", "cpu",
            "--prompt", f"Repeat this text exactly: {text}", "--max-new-tokens", "24",
            "--compare", "--json"]  # fmt: skip
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["speculative"] and "layout" not in out and out["plain"]["same_output"] is True
    m = out["metrics"]
    assert m["verify_steps"] == 0 and "lookup" in m  # proposals from the text, none from a draft
    assert out["timed_steps"] >= 3 and out["speedup"] == (out["arms_ratio"] if out["drafted_steps"] else None)
    assert main(args[:-1]) == 0 and "steps without drafting" not in capsys.readouterr().out
    for command in (["doctor"], ["train", "eval"]):
        assert main([*command, "--target", str(target), "--no-draft", "--device", "cpu"]) != 0
        assert "a draft" in (err := capsys.readouterr().err) and "drop --no-draft" in err


def _hello(saved) -> list[str]:  # noqa: F811
    """`generate` of six tokens of "Hello" on the tiny target and draft, compared, fully verified."""
    target, draft = saved
    return ["generate", "--target", str(target), "--draft", str(draft), "--dtype", "fp32", "--device", "cpu",
            "--prompt", "Hello", "--max-new-tokens", "6", "--compare", "--no-check", "--verify", "full",
            "--no-lookup"]  # fmt: skip


def test_generate_streams_text_and_prints_the_summary(saved, capsys):  # noqa: F811
    assert main(_hello(saved)) == 0
    text = capsys.readouterr().out
    for row in ("mean acceptance length", "speedup over plain decoding", "same output as plain"):
        assert row in text
    assert "(rounds " in text  # the spread of the three rounds
    assert "steps without drafting" not in text  # full verification drafts every step
    assert "no step drafted" not in text


def test_no_speedup_is_claimed_when_no_step_drafted(saved, capsys, monkeypatch):  # noqa: F811
    """A policy that never drafts (adaptive, when the draft cannot pay): both arms ran the same
    plain steps, so the summary says so instead of printing their ratio as a speedup."""
    from dspark.engine.scheduler import FullScheduler

    monkeypatch.setattr(FullScheduler, "should_draft", lambda self, batch: False)
    target, _ = saved
    args = _hello(saved)
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "none: the timed rounds drafted no step (0 of" in text and "both decoded plainly" in text
    assert "their ratio (noise)" in text
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["drafted_steps"] == 0 and out["speedup"] is None and out["arms_ratio"] > 0
    assert main(["generate", "--target", str(target), "--prompt", "x", "--max-new-tokens", "0"]) == 2


def test_a_streamed_run_that_drafted_does_not_stand_for_the_timed_rounds(saved, capsys, monkeypatch):  # noqa: F811
    """The streamed run drafts (its verify steps are shown) while the timed rounds do not (an
    adaptive policy that looked once and went back to plain steps): the speedup row speaks of
    the timed rounds and says how many of their steps drafted, so the two rows cannot contradict."""
    from dspark.cli import generate
    from dspark.engine.scheduler import FullScheduler

    timed = {"on": False}
    real = generate.side_by_side

    def rounds(*a, **k):
        timed["on"] = True
        try:
            return real(*a, **k)
        finally:
            timed["on"] = False

    monkeypatch.setattr(generate, "side_by_side", rounds)
    monkeypatch.setattr(FullScheduler, "should_draft", lambda self, batch: not timed["on"])
    args = _hello(saved)
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["metrics"]["verify_steps"] >= 1 and out["drafted_steps"] == 0 and out["speedup"] is None
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "none: the timed rounds drafted no step" in text and "verify steps" in text


def test_compare_rounds_step_the_two_arms_in_turn(saved):  # noqa: F811
    """--compare's measurement: both requests advance one engine step each in turn, which arm steps
    first alternating, and each arm is charged only its own steps."""
    target, draft = saved
    eng = build_engine(
        EngineConfig(target=str(target), draft=str(draft), dtype="fp32", device="cpu", verify="full", check=False)
    )
    plain = eng.derive(speculative=False)
    order = []
    for name, e in (("spec", eng), ("plain", plain)):
        e.step = lambda orig=e.step, name=name: (order.append(name), orig())[1]
    ids, params = eng.encode("Name three rivers."), SamplingParams(max_new_tokens=10, ignore_eos=True)
    (a, b), secs, _ = side_by_side([eng, plain], ids, params, first=1)
    assert order[:6] == ["plain", "spec", "spec", "plain", "plain", "spec"]
    assert len(a.output_ids) == len(b.output_ids) == 10 and a.output_ids == b.output_ids  # fp32: lossless
    assert all(s > 0 for s in secs) and not eng.has_work() and not plain.has_work()


def test_first_difference_reports_where_outputs_part_and_the_logit_gap():
    model = tiny_target(seed=2)
    prompt, common = [1, 5, 9], [14, 20]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + common])).logits[0, -1]
    a, b = 30, 31
    d = first_difference(model, prompt, common + [a, 7], common + [b, 8, 9])
    assert d["token"] == 2 and abs(d["logit_gap"] - abs(float(logits[a] - logits[b]))) < 1e-3
    assert first_difference(model, prompt, common, common + [4]) == {"token": 2, "logit_gap": None}
