"""`dspark train probe`: what a first draft slot could reach from given inputs, measured cheaply."""

from __future__ import annotations

import json
import random

import torch
from dspark.cli import main
from dspark.train import probe as P
from dspark.train.dataset import Sequence, load_sequences

from tests.test_train_fixtures import save_tiny_target
from tests.tiny import tiny_draft, tiny_target

V = 96


def rule(x: int) -> int:
    return 4 + (7 * x + 3) % (V - 4)


def planted_shard(path, n: int, seed: int) -> str:
    """Answers of pairs (x, rule(x)) with x random: the token after an anchor x is rule(x), which
    only the anchor itself tells (the states at a-1 have not seen x); after rule(x) comes a random
    token. An ideal first slot given the anchor is right on half the anchors, one without ~1/92."""
    rnd = random.Random(seed)
    lines = []
    for i in range(n):
        prompt = [1] + [rnd.randrange(4, V) for _ in range(rnd.randint(3, 6))]
        answer = [t for _ in range(rnd.randint(6, 12)) for x in [rnd.randrange(4, V)] for t in (x, rule(x))] + [2]
        lines.append(
            json.dumps(
                {"key": f"p{seed}-{i}", "ids": prompt + answer, "loss_mask": [0] * len(prompt) + [1] * len(answer)}
            )
        )
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def run_probe(tmp_path, target, data, held, inputs, name, capsys, *extra):
    out = tmp_path / f"{name}.json"
    args = [
        "train",
        "probe",
        "--target",
        str(target),
        "--dtype",
        "fp32",
        "--data",
        data,
        "--heldout",
        held,
        "--inputs",
        inputs,
        "--pairs",
        "3000",
        "--steps",
        "300",
        "--batch-size",
        "64",
        "--lr",
        "1e-2",
        "--width",
        "64",
        "--quiet",
        "--draft",
        "none",
        "--out",
        str(out),
        *extra,
    ]
    assert main(args) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def test_the_probe_finds_what_its_inputs_carry_and_only_that(tmp_path, capsys):
    target = save_tiny_target(tmp_path / "target")
    data = planted_shard(tmp_path / "d.jsonl", 150, seed=0)
    held = planted_shard(tmp_path / "h.jsonl", 10, seed=7)
    with_anchor, text = run_probe(tmp_path, target, data, held, "final,embed", "fe", capsys)
    without, _ = run_probe(tmp_path, target, data, held, "final", "f", capsys)
    # half the held-out anchors are predictable, and only from the anchor
    assert with_anchor["figures"]["probe"] >= 0.45
    assert without["figures"]["probe"] <= 0.1
    assert with_anchor["figures"]["bigram"] >= 0.45  # the rule is a bigram: the baseline sees it too
    # the JSON holds the figures with their counts, the settings, the curve and the timings
    n = with_anchor["heldout_anchors"]
    assert n == sum(len(P.answer_anchors(s)) for s in load_sequences(held, V)) and n > 100
    assert with_anchor["hits"]["probe"] == round(with_anchor["figures"]["probe"] * n)
    assert with_anchor["training_anchors"] > 2000 and with_anchor["settings"]["inputs"] == ["final", "embed"]
    assert with_anchor["steps"] == 300 and with_anchor["curve"][-1]["step"] == 300
    assert with_anchor["curve"][-1]["heldout_loss"] < with_anchor["curve"][0]["heldout_loss"]
    assert with_anchor["seconds"]["fit"] > 0 and "draft" not in with_anchor["figures"]
    # one table: the probe and the bigram as a share of the held-out anchors, with the counts
    assert "| probe (final,embed), 300 steps |" in text and "| bigram of the training answers (150) |" in text
    assert f"| {with_anchor['hits']['probe']} / {n} |" in text


def test_heldout_answers_never_become_training_pairs(tmp_path, capsys):
    target = save_tiny_target(tmp_path / "target")
    held = planted_shard(tmp_path / "h.jsonl", 6, seed=7)
    # the training data holds the held-out answers too, and another answer to one of their prompts
    copies = [json.loads(x) for x in (tmp_path / "h.jsonl").read_text().splitlines()]
    other = dict(copies[0], key="resampled", ids=copies[0]["ids"][:-3] + [5, 6, 2])
    own = [json.loads(x) for x in open(planted_shard(tmp_path / "d0.jsonl", 20, seed=0))]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in own + copies + [other]) + "\n")
    rec, text = run_probe(
        tmp_path, target, str(tmp_path / "d.jsonl"), held, "final,embed", "x", capsys, "--pairs", "100000"
    )
    assert rec["dropped_heldout_prompts"] == 7 and rec["training_answers"] == 20 and rec["probe_answers"] == 20
    assert "7 training answers to held-out prompts dropped" in text
    kept, dropped = P.without_heldout(load_sequences(tmp_path / "d.jsonl", V), load_sequences(held, V))
    assert dropped == 7 and {s.key for s in kept} == {f"p0-{i}" for i in range(20)}


def test_bad_probe_settings_are_one_error_naming_them(tmp_path, capsys):
    target = save_tiny_target(tmp_path / "target")
    data = planted_shard(tmp_path / "d.jsonl", 4, seed=0)
    base = ["train", "probe", "--target", str(target), "--dtype", "fp32", "--data", data, "--heldout", data]
    for bad, said in [
        ("final,tap:99", "--inputs 'tap:99'"),
        ("final,hidden", "--inputs 'hidden'"),
        ("final,,embed", "an empty name"),
        ("embed,embed", "embed given twice"),
    ]:
        assert main(base + ["--inputs", bad]) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert len(errors) == 1 and errors[0].startswith("dspark train: error: ") and said in errors[0], errors
    assert main(base + ["--pairs", "0"]) == 2
    assert "--pairs must be >= 1" in capsys.readouterr().err


def test_a_drafts_first_slot_is_what_propose_drafts(tmp_path):
    """The draft figure counts the token `propose` (greedy decoding's drafting) names at slot 1,
    each anchor reading the committed positions before it."""
    from dspark.engine.batch import Batch
    from dspark.engine.drafting import propose
    from dspark.engine.sampling import SamplingParams
    from dspark.train.features import OnlineFeatures

    model = tiny_target()
    draft = tiny_draft(model)
    gen = torch.Generator().manual_seed(3)
    seqs = []
    for k in range(3):
        ids = torch.randint(4, V, (int(torch.randint(12, 30, (1,), generator=gen)),), generator=gen)
        seqs.append(Sequence(f"r{k}", ids, torch.arange(len(ids)) >= 4))
    taps = tuple(draft.spec.hidden_state_indices)
    feats = P.Remembered(OnlineFeatures(model, taps, seqs, runtime="hf"))
    pairs = P.collect(feats, seqs, [0, 1, 2], ("embed",), taps, model.config.hidden_size)
    drafted = []
    for i, a in pairs.where.tolist():
        t, _ = feats.get([i])[0]
        ctx = draft.new_context_cache(1, "cpu", dtype=draft.fc.weight.dtype)  # the block in Python, as the probe's
        batch = Batch(
            None,
            ctx,
            seqs[i].ids[a : a + 1].clone(),
            [SamplingParams()],
            [None],
            [t[None, :a].to(draft.fc.weight.dtype)],
        )
        drafted.append(int(propose(draft, batch, 1).tokens[0, 0]))
    got = P.draft_slot1_tokens(draft, feats, taps, model.config.hidden_size, seqs, pairs, chunk=7)
    assert got.tolist() == drafted and len(set(drafted)) > 5
