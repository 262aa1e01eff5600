"""Issue 7: `dspark bench` runs every arm on the same prompts and writes all its outputs."""

from __future__ import annotations

import json

import pytest
import torch
from dspark.bench.prompts import load_sets
from dspark.bench.runner import Arm, ForwardTimer, interleaved, parse_arms
from dspark.cli import main
from dspark.errors import DSparkError

from tests.test_train_fixtures import char_tokenizer
from tests.tiny import tiny_draft, tiny_target


def _repeat_draft(model):
    """A draft whose Markov head says "the previous token again": the tiny random target's greedy
    text settles into loops, so this draft is accepted some of the time and rejected some of the
    time, which gives the profile non-trivial rates to check."""
    V = model.config.vocab_size
    draft = tiny_draft(model, gamma=3, markov_rank=V, mask_token_id=3)
    with torch.no_grad():
        draft.markov_head.markov_w1.weight.copy_(torch.eye(V))
        draft.markov_head.markov_w2.weight.copy_(torch.eye(V) * 50.0)
    return draft


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from dspark.formats.convert import write_deepspec

    root = tmp_path_factory.mktemp("bench")
    tok = char_tokenizer()
    model = tiny_target(vocab=len(tok))
    model.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    draft = _repeat_draft(model)
    write_deepspec(draft.spec, draft.own_state_dict(), root / "draft")
    data = root / "datasets"
    data.mkdir()
    for name, rows in {
        "gsm8k": ["What is 12 plus 30?", "Tom has 3 apples and buys 4 more. How many?", "unused"],
        "humaneval": ["def add(a, b):", "Write a function that reverses a list."],
    }.items():
        (data / f"{name}.jsonl").write_text("".join(json.dumps({"turns": [r, "second turn"]}) + "\n" for r in rows))
    (root / "mine.txt").write_text("Say hello.\nCount to five.\n")
    return root


def test_bench_end_to_end_writes_every_output(setup, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))  # the adaptive arm's cost curve
    out = tmp_path / "out"
    rc = main(
        [
            "bench",
            "--target",
            str(setup / "target"),
            "--draft",
            str(setup / "draft"),
            "--dtype",
            "fp32",
            "--device",
            "cpu",
            "--dataset-dir",
            str(setup / "datasets"),
            "--prompts",
            str(setup / "mine.txt"),
            "--limit",
            "2",
            "--max-new-tokens",
            "12",
            "--ignore-eos",
            "--arms",
            "hf,lookup,plain,full,adaptive,full@2",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    for name in (
        "results.json",
        "results.md",
        "speculation_profile.json",
        "acceptance_per_position.png",
        "speedup.png",
    ):
        assert (out / name).stat().st_size > 0, name
    for png in ("acceptance_per_position.png", "speedup.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    res = json.loads((out / "results.json").read_text())
    assert list(res["sets"]) == ["gsm8k", "humaneval", "chat", "mine", "all"]
    assert res["config"]["prompt_sets"]["gsm8k"]["prompts"] == 2  # --limit
    for set_name, block in res["sets"].items():
        n = 8 if set_name == "all" else 2
        for name, arm in block["arms"].items():
            assert arm["requests"] == n and arm["generated_tokens"] == 12 * n, (set_name, name)
            assert arm["tokens_per_second"] > 0
            t = arm["time_s"]
            assert t["target_forward"] > 0
            assert t["target_forward"] + t["draft"] + t["overhead"] == pytest.approx(t["wall"], abs=2e-3)
        assert block["arms"]["hf"]["ratio_to_baseline"] == 1.0
        # fp32: every dspark arm is lossless, token for token equal to transformers' greedy output
        for name in ("plain", "full", "adaptive", "full@2"):
            assert block["arms"][name]["same_output_as_baseline"] == 1.0, (set_name, name)
        assert "acceptance" not in block["arms"]["plain"]
    acc = res["sets"]["all"]["arms"]["full"]["acceptance"]
    assert 0 < acc["draft_acceptance_rate"] < 1  # both accepted and rejected drafts: the rates mean something
    assert acc["mean_accept_length"] == pytest.approx(1 + sum(acc["marginal_accept_rates"]), abs=1e-3)

    prof = json.loads((out / "speculation_profile.json").read_text())
    assert prof["validation"]["passed"] and prof["measurement_conditions"]["arm"] == "full"
    assert prof["num_speculative_tokens"] == 3 and prof["block_size"] == 3
    assert prof["mean_accept_length"] == pytest.approx(acc["mean_accept_length"], abs=1e-4)
    assert sum(prof["acceptance_length_histogram"].values()) == acc["verify_steps"]
    assert set(prof["per_category"]) == {"gsm8k", "humaneval", "chat", "mine"}

    md = (out / "results.md").read_text()
    assert "| gsm8k | dspark full |" in md and "## Acceptance per position (`full` arm)" in md
    assert "Reproduce: `dspark bench --target" in md and md in capsys.readouterr().out


def test_arms_are_interleaved_per_prompt_with_rotating_order():
    calls = []

    class Fake:
        def __init__(self, name):
            self.name = name

        def __call__(self, prompts, params):
            calls.append((self.name, tuple(p[0] for p in prompts)))
            return [[1, 2]] * len(prompts), [None] * len(prompts)

    class Set:
        def __init__(self, name, n):
            self.name, self.prompts = name, [""] * n

    arms = parse_arms("hf,plain,full,adaptive@2")
    runners = {a.name: Fake(a.name) for a in arms}
    sets = [Set("a", 3)]
    encoded = {"a": [[10], [11], [12]]}
    with ForwardTimer(torch.nn.Identity(), "cpu") as timer:  # it wraps NativeTarget._forward until closed
        chunks = interleaved(arms, runners, sets, encoded, lambda i: None, timer, "cpu")
    assert calls == [
        ("hf", (10,)),
        ("plain", (10,)),
        ("full", (10,)),  # prompt 0
        ("plain", (11,)),
        ("full", (11,)),
        ("hf", (11,)),  # prompt 1: order rotated
        ("adaptive@2", (10, 11)),  # the batched arm decodes the group together
        ("full", (12,)),
        ("hf", (12,)),
        ("plain", (12,)),
        ("adaptive@2", (12,)),
    ]
    assert [c.indices for c in chunks if c.arm == "adaptive@2"] == [[0, 1], [2]]


def test_engine_arms_step_side_by_side_on_each_prompt():
    """dspark's arms on a prompt advance one engine step each in turn (the first to step rotating),
    each charged only its own steps; transformers arms run whole, in the rotated order."""
    from types import SimpleNamespace

    from dspark.bench.runner import EngineRunner

    log = []

    class FakeEngine:
        def __init__(self, name, steps):
            self.name, self.steps, self.left = name, steps, 0
            self.draft = None if name == "plain" else object()
            self.speculative = self.draft is not None
            self.metrics = SimpleNamespace(t_draft=0.0, t_verify=0.0, t_other=0.0)

        def add_request(self, ids, params):
            self.left = self.steps
            return SimpleNamespace(output_ids=[ids[0]] * self.steps, metrics=None)

        def has_work(self):
            return self.left > 0

        def step(self):
            log.append(self.name)
            self.left -= 1

    class HF:
        def __call__(self, prompts, params):
            log.append("hf")
            return [[1]], [None]

    class Set:
        def __init__(self, name, n):
            self.name, self.prompts = name, [""] * n

    arms = parse_arms("hf,plain,full")
    runners = {"hf": HF(), "plain": EngineRunner(FakeEngine("plain", 2)), "full": EngineRunner(FakeEngine("full", 3))}
    timer = ForwardTimer(torch.nn.Identity(), "cpu")
    chunks = interleaved(arms, runners, [Set("a", 2)], {"a": [[10], [11]]}, lambda i: None, timer, "cpu")
    timer.close()
    assert log == [
        "hf",
        "plain",
        "full",
        "full",
        "plain",
        "full",  # prompt 0: hf, then the engines in turn
        "full",
        "plain",
        "plain",
        "full",
        "full",
        "hf",
    ]  # prompt 1: order rotated
    assert [(c.arm, c.indices, c.outputs) for c in chunks] == [
        ("hf", [0], [[1]]),
        ("plain", [0], [[10, 10]]),
        ("full", [0], [[10, 10, 10]]),
        ("plain", [1], [[11, 11]]),
        ("full", [1], [[11, 11, 11]]),
        ("hf", [1], [[1]]),
    ]
    assert all(c.wall_s > 0 for c in chunks)


def test_arm_parsing_and_prompt_set_errors(setup, tmp_path):
    assert parse_arms("hf, lookup,adaptive@4") == [Arm("hf"), Arm("lookup"), Arm("adaptive", 4)]
    for bad, match in (
        ("magic", "unknown bench arm"),
        ("hf@2", "one request at a time"),
        ("full@x", "integer"),
        ("full,full", "twice"),
        ("full@0", ">= 1"),
    ):
        with pytest.raises(DSparkError, match=match):
            parse_arms(bad)
    sets = load_sets(str(setup / "datasets"), None, [], 5)
    assert [s.name for s in sets] == ["gsm8k", "humaneval", "chat"]
    assert sets[0].prompts == ("What is 12 plus 30?", "Tom has 3 apples and buys 4 more. How many?", "unused")
    with pytest.raises(DSparkError, match=r"prompt sets \['mbpp'\] not found"):
        load_sets(str(setup / "datasets"), ["mbpp"], [], 5)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": []}\n')
    with pytest.raises(DSparkError, match="bad.jsonl:1"):
        load_sets(None, ["bad"], [str(bad)], 5)
    rc = main(
        ["bench", "--target", str(setup / "target"), "--arms", "hf", "--baseline", "full", "--out", str(tmp_path / "o")]
    )
    assert rc == 2  # a baseline that is not an arm: one-line error before any model loads


def test_bench_measures_target_runtimes_side_by_side(setup, tmp_path, capsys):
    """`--runtimes`: transformers generate and the native runtime's weight formats in the same run,
    each with tokens/s, the 8-token verify cost against a 1-token step and the engine's overhead."""
    out = tmp_path / "out"
    rc = main(
        [
            "bench",
            "--target",
            str(setup / "target"),
            "--no-spec",
            "--dtype",
            "fp32",
            "--device",
            "cpu",
            "--prompts",
            str(setup / "mine.txt"),
            "--sets",
            "mine",
            "--limit",
            "1",
            "--max-new-tokens",
            "8",
            "--ignore-eos",
            "--arms",
            "hf,plain",
            "--runtimes",
            "hf-fp32,native-fp32,native-int8",
            "--runtime-rounds",
            "1",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    rt = json.loads((out / "results.json").read_text())["runtimes"]
    rows = {r["arm"]: r for r in rt["rows"]}
    assert list(rows) == ["hf-fp32", "native-fp32", "native-int8"]
    for name, r in rows.items():
        assert r["tokens_per_s"] > 0 and set(r["ms"]) == {"1", "2", "4", "8"} and r["verify8_over_1"] > 0, name
    assert rows["hf-fp32"]["engine_overhead"] is None  # generate has no engine
    assert all(0 <= rows[n]["engine_overhead"] < 1 for n in ("native-fp32", "native-int8"))
    assert (rows["native-fp32"]["format"], rows["native-int8"]["format"]) == ("fp32", "int8")
    md = (out / "results.md").read_text()
    assert (
        "## Target runtimes" in md
        and "| native-int8 | int8" in md
        and "--runtimes hf-fp32,native-fp32,native-int8" in md
    )
    assert "--no-spec" in md  # the reproduce line repeats the run
    capsys.readouterr()
    assert (
        main(
            [
                "bench",
                "--target",
                str(setup / "target"),
                "--no-spec",
                "--dtype",
                "fp32",
                "--device",
                "cpu",
                "--sets",
                "chat",
                "--limit",
                "1",
                "--max-new-tokens",
                "4",
                "--arms",
                "hf",
                "--runtimes",
                "native-int3",
                "--out",
                str(tmp_path / "bad"),
            ]
        )
        == 2
    )
    assert "unknown runtime arm 'native-int3'" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()  # refused before anything ran


def test_bench_runtime_command_on_any_supported_target(setup, capsys):
    assert (
        main(
            [
                "bench-runtime",
                "--target",
                str(setup / "target"),
                "--arms",
                "hf-fp32,native-fp32",
                "--tokens",
                "6",
                "--rounds",
                "1",
                "--context",
                "16",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| native-fp32 | fp32 |" in out and "8-token verify / 1-token step" in out and "weights='auto' picks" in out
    assert "Draft phase" not in out  # a target other than smollm2 has no draft by default
    # prefill tokens/s of the default lengths the target holds
    from dspark.bench import runtime
    from transformers import AutoConfig

    positions = AutoConfig.from_pretrained(setup / "target").max_position_embeddings
    holds = [n for n in runtime.PREFILL if n <= positions]
    assert ("Prefill (one forward" in out) == bool(holds)
    assert all(f"| {n} tokens" in out for n in holds)
    rows = runtime.run(
        ["hf-fp32", "native-fp32"], 1, 4, 2, 8, str(setup / "target"), "cpu", None, "auto", prefill=(5, 12)
    )
    assert all(set(r["prefill_tok_s"]) == {5, 12} and min(r["prefill_tok_s"].values()) > 0 for r in rows)
    table = runtime.table(rows, 1, 4, 8, str(setup / "target"))
    assert "| 5 tokens | 12 tokens |" in table and "| native-fp32 | " in table.split("Prefill")[1]
    assert "x transformers bf16" not in table  # no hf-bf16 arm: tokens/s alone
    with pytest.raises(DSparkError, match="--prefill 100000"):
        runtime.run(["native-fp32"], 1, 4, 1, 8, str(setup / "target"), "cpu", None, "auto", prefill=(100000,))
    # with a draft: its drafting phase on each native arm, against that arm's own 1-token step
    rows = runtime.run(["hf-fp32", "native-fp32"], 1, 6, 1, 16, str(setup / "target"), "cpu", str(setup / "draft"))
    native = rows[1]
    assert "draft_ms" not in rows[0] and set(native["draft_ms"]) == {1, 2, 3}
    assert all(v > 0 for v in native["draft_ms"].values()) and native["draft_over_step"] > 0
    table = runtime.table(rows, 1, 6, 16, str(setup / "target"))
    assert "Draft phase after a target step (draft " in table and "| native-fp32 | " in table.split("Draft phase")[1]
    assert (
        main(["bench-runtime", "--target", str(setup / "target"), "--draft", str(setup / "draft"), "--no-draft"]) == 2
    )


def test_runtime_arms_compare_the_int4_kernels(setup, capsys):
    """native-<weights>@torch runs torch's int4 kernel beside dspark's, so a run shows what each costs."""
    from dspark import kernels
    from dspark.bench import runtime
    from dspark.errors import DSparkError

    assert (
        main(
            [
                "bench-runtime",
                "--target",
                str(setup / "target"),
                "--arms",
                "native-int4,native-int4@torch",
                "--tokens",
                "6",
                "--rounds",
                "1",
                "--context",
                "16",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    ours = "dspark" if kernels.extension() is not None else "torch"
    assert f"| native-int4 | int4, {ours} kernel" in out and "| native-int4@torch | int4, torch kernel" in out
    # the AVX2 build's int4 kernel quantises its activations: the arm says so (kernels.q4_activations)
    assert (", 8-bit activations" in out) == (kernels.q4_activations() == "int8")
    for bad in ("hf-bf16@torch", "native-int4@cuda", "native-int4@"):
        with pytest.raises(DSparkError, match="unknown runtime arm"):
            runtime.parse_arms(bad)


def test_the_forward_timer_puts_the_native_forward_back():
    """It wraps NativeTarget._forward, which its four forwards run (every native call counts), only
    while open, keeping its signature."""
    import inspect

    from dspark.target.native import NativeTarget

    original = NativeTarget._forward
    with ForwardTimer(torch.nn.Identity(), "cpu"):
        assert NativeTarget._forward is not original
        assert inspect.signature(NativeTarget._forward) == inspect.signature(original)
    assert NativeTarget._forward is original


def test_bench_feeds_a_prompt_ids_record_as_it_is(setup, tmp_path, monkeypatch):
    """A prompt file's `{"prompt_ids": [...]}` record is decoded from exactly those ids, as every
    other command that reads prompt files does (it was once handed to the tokenizer as text)."""
    from dspark.bench import runner

    ids = [5, 9, 17, 3]
    (tmp_path / "ids.jsonl").write_text(json.dumps({"prompt_ids": ids}) + "\n" + json.dumps({"prompt": "hi"}) + "\n")
    seen = []
    real = runner.EngineRunner.__call__

    def spy(self, prompts, params):
        seen.extend(list(p) for p in prompts)
        return real(self, prompts, params)

    monkeypatch.setattr(runner.EngineRunner, "__call__", spy)
    out = tmp_path / "out"
    args = ["bench", "--target", str(setup / "target"), "--no-spec", "--dtype", "fp32", "--device", "cpu"]
    args += ["--prompts", str(tmp_path / "ids.jsonl"), "--sets", "ids", "--max-new-tokens", "4", "--ignore-eos"]
    assert main([*args, "--arms", "plain", "--baseline", "plain", "--out", str(out)]) == 0
    assert ids in seen
    res = json.loads((out / "results.json").read_text())
    assert res["sets"]["ids"]["arms"]["plain"]["requests"] == 2


def test_bench_no_draft_runs_the_lookup_in_the_full_arm_and_refuses_draft_arms(setup, tmp_path, capsys):
    """--no-draft: the 'full' arm speculates from the text alone against plain decoding, the same
    output in fp32; arms that size a draft's block, or no speculative arm at all, are refused."""
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt_ids": [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]}) + "\n")
    out = tmp_path / "out"
    args = ["bench", "--target", str(setup / "target"), "--no-draft", "--dtype", "fp32", "--device", "cpu"]
    args += ["--prompts", str(tmp_path / "p.jsonl"), "--sets", "p", "--max-new-tokens", "24", "--ignore-eos"]
    assert main([*args, "--arms", "plain,full", "--baseline", "plain", "--out", str(out)]) == 0
    full = json.loads((out / "results.json").read_text())["sets"]["p"]["arms"]["full"]
    assert full["same_output_as_baseline"] == 1.0 and full["acceptance"]["lookup"]["verify_steps"] > 0
    assert full["acceptance"]["verify_steps"] == 0  # no draft ran
    assert "--no-draft" in (out / "results.md").read_text()  # the reproduce line repeats it
    capsys.readouterr()
    for arms, why in (("plain,adaptive", "size a draft's block"), ("plain", "add full to --arms")):
        assert main([*args, "--arms", arms, "--baseline", "plain", "--out", str(out)]) == 2
        assert why in capsys.readouterr().err
