"""`dspark train probe`: what a first draft slot could reach from given inputs, measured cheaply."""

from __future__ import annotations

import json

from dspark.cli import main
from dspark.train import probe as P
from dspark.train.dataset import load_sequences
from tests.test_train_fixtures import char_tokenizer, save_tiny_target, synthetic_shard


def test_the_probe_learns_what_its_inputs_carry(tmp_path, capsys):
    """Answers where the token after the anchor is anchor + 3: with the anchor's embedding the probe
    finds the rule on held-out answers it never trained on (chance is 1 / 96); the JSON holds the
    figures and the curve; the bigram baseline is measured on the same anchors."""
    target = save_tiny_target(tmp_path / "target")
    char_tokenizer().save_pretrained(target)
    data, held = synthetic_shard(tmp_path / "d.jsonl", 40, seed=0), synthetic_shard(tmp_path / "h.jsonl", 8, seed=5)
    out = tmp_path / "probe.json"
    args = ["train", "probe", "--target", str(target), "--dtype", "fp32", "--data", str(data), "--heldout", str(held),
            "--pairs", "400", "--steps", "300", "--batch", "64", "--lr", "3e-3", "--width", "64", "--quiet",
            "--draft", "none", "--out", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    rec = json.loads(out.read_text())
    assert rec["figures"]["probe"] >= 0.6 and rec["figures"]["bigram"] >= 0.9  # chance: 1 / 96
    assert rec["heldout_anchors"] > 50 and rec["training_anchors"] >= 400 and rec["curve"][-1]["step"] == 300
    assert "| probe (final,embed) |" in text and "| bigram of the training answers |" in text
    # the held-out answers never enter training
    seqs = load_sequences(str(data), 96)
    keys = {seqs[i].key for i in P.draw_sequences(seqs, 400, 0)}
    assert not keys & {s.key for s in load_sequences(str(held), 96)}


def test_bad_probe_settings_are_one_error(tmp_path, capsys):
    target = save_tiny_target(tmp_path / "target")
    data = synthetic_shard(tmp_path / "d.jsonl", 4)
    base = ["train", "probe", "--target", str(target), "--dtype", "fp32", "--data", str(data), "--heldout", str(data)]
    assert main(base + ["--inputs", "final,tap:99"]) == 2
    assert "--inputs 'tap:99'" in capsys.readouterr().err
    assert main(base + ["--inputs", "embed"]) == 2
    assert "bigram" in capsys.readouterr().err
