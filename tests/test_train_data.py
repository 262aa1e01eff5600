"""Self-distillation shards, prompt sets and the feature cache."""

import json
import re
from pathlib import Path

import pytest
import torch
from dspark.train.data import GenSettings, generate_shard
from dspark.train.dataset import Sequence, answer_heads, load_sequences
from dspark.train.errors import TrainError
from dspark.train.features import CachedFeatures, Extractor, OnlineFeatures, build_cache
from dspark.train.prompts import Prompt, load_prompts

from tests.test_train_fixtures import char_tokenizer, synthetic_shard
from tests.tiny import q4_exact, tiny_target

torch.set_num_threads(1)
PROMPTS = [Prompt("Hi there!"), Prompt("Name a fruit."), Prompt("  hi   THERE! "), Prompt("Count to 3.")]


def _gen(model, tok, out, prompts, **kw):
    s = GenSettings(max_new_tokens=kw.pop("max_new_tokens", 10), temperature=kw.pop("temperature", 0.0))
    return generate_shard(model, tok, prompts, out, s, target_name="tiny", batch_size=3, progress=False, **kw)


def test_generation_saves_prompt_answer_and_mask_and_matches_unbatched_greedy(tmp_path):
    model, tok = tiny_target(), char_tokenizer()
    out = tmp_path / "d.jsonl"
    st = _gen(model, tok, out, PROMPTS)
    assert (st.total, st.written, st.skipped) == (3, 3, 0)  # "  hi   THERE! " duplicates "Hi there!"
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    for rec in recs:
        n = rec["prompt_len"]
        assert rec["loss_mask"] == [0] * n + [1] * (len(rec["ids"]) - n)
        answer = rec["ids"][n:]
        assert 1 <= len(answer) <= 10
        assert (answer[-1] == 2) == (rec["finish"] == "stop")  # EOS kept in the answer, and only at its end
        # left padding in the batch must not change the answer (fp32 greedy)
        alone = model.generate(
            torch.tensor([rec["ids"][:n]]), max_new_tokens=10, do_sample=False, eos_token_id=2, pad_token_id=0
        )[0, n:].tolist()
        assert answer == alone[: len(answer)]
    seqs = load_sequences(out, vocab_size=96)
    assert [int(s.loss_mask.sum()) for s in seqs] == [len(r["ids"]) - r["prompt_len"] for r in recs]


def test_generation_resumes_skips_done_prompts_and_repairs_a_torn_line(tmp_path):
    model, tok = tiny_target(), char_tokenizer()
    out = tmp_path / "d.jsonl"
    _gen(model, tok, out, PROMPTS[:2])
    with open(out, "a") as f:
        f.write('{"key": "torn", "ids": [1, 2')  # a crash in the middle of a write
    st = _gen(model, tok, out, PROMPTS)
    assert (st.skipped, st.written) == (2, 1)
    keys = [json.loads(line)["key"] for line in out.read_text().splitlines()]
    assert len(keys) == len(set(keys)) == 3
    with pytest.raises(TrainError, match="other settings"):
        _gen(model, tok, out, PROMPTS, temperature=0.7)


def test_sampled_generation_is_reproducible_per_batch(tmp_path):
    """A run interrupted after a batch and resumed writes what an uninterrupted run writes."""
    model, tok = tiny_target(), char_tokenizer()
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    full = [PROMPTS[0], PROMPTS[1], PROMPTS[3], Prompt("Say yes.")]
    _gen(model, tok, a, full, temperature=1.0)
    b.write_text("".join(line + "\n" for line in a.read_text().splitlines()[:3]))  # stopped after its first batch
    (tmp_path / "b.jsonl.meta.json").write_text((tmp_path / "a.jsonl.meta.json").read_text())
    _gen(model, tok, b, full, temperature=1.0)  # ... and resumed
    assert sorted(a.read_text().splitlines()) == sorted(b.read_text().splitlines())


def test_bad_inputs_are_clear_errors(tmp_path):
    model = tiny_target()
    with pytest.raises(TrainError, match="chat template"):
        _gen(model, char_tokenizer(chat_template=False), tmp_path / "x.jsonl", PROMPTS)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"ids": [1, 2, 3], "loss_mask": [0, 1]}) + "\n")
    with pytest.raises(TrainError, match="equal length"):
        load_sequences(bad)
    bad.write_text(json.dumps({"ids": [1, 500, 3], "loss_mask": [0, 1, 1]}) + "\n")
    with pytest.raises(TrainError, match="vocabulary"):
        load_sequences(bad, vocab_size=96)
    bad.write_text('{"ids": [1]}\n{"ids": \n' + json.dumps({"ids": [1], "loss_mask": [0]}) + "\n")
    with pytest.raises(TrainError, match="malformed"):
        load_sequences(bad)
    with pytest.raises(TrainError, match="no such file"):
        load_prompts(str(tmp_path / "missing.jsonl"))


def test_several_data_sets_comma_separated_train_as_one_in_order(tmp_path):
    a = synthetic_shard(tmp_path / "a.jsonl", 3)
    b = synthetic_shard(tmp_path / "b.jsonl", 5, seed=1)
    sa, sb = load_sequences(a, vocab_size=96), load_sequences(b, vocab_size=96)
    both = load_sequences(f"{a},{b}", vocab_size=96)
    assert [s.ids.tolist() for s in both] == [s.ids.tolist() for s in sa + sb]
    with pytest.raises(TrainError, match="empty name"):
        load_sequences(f"{a},", vocab_size=96)
    with pytest.raises(TrainError, match="does not exist"):
        load_sequences(f"{a},{tmp_path / 'missing'}", vocab_size=96)


def test_bundled_prompt_sets_are_varied_disjoint_and_not_evaluation_data():
    train, held = load_prompts("train"), load_prompts("heldout")
    assert len(train) >= 300 and 35 <= len(held) <= 50
    assert not {p.key for p in train} & {p.key for p in held}
    kinds = {"explanation", "code", "math", "list", "story", "dialogue"}
    assert kinds <= {p.category for p in train} and kinds <= {p.category for p in held}
    data = Path(__file__).resolve().parents[2] / "shared" / "datasets"
    if not data.is_dir():
        pytest.skip("evaluation sets not present")

    def shingles(text, n=8):
        w = re.findall(r"[a-z0-9]+", text.lower())
        return {" ".join(w[i : i + n]) for i in range(len(w) - n + 1)}

    evaluation = set()
    for f in data.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            for turn in json.loads(line)["turns"]:
                evaluation |= shingles(turn)
    leaked = [p.text for p in train + held if shingles(p.text) & evaluation]
    assert not leaked


def test_feature_cache_matches_online_features_and_hf_hidden_states(tmp_path, capsys):
    model = tiny_target()
    seqs = load_sequences(synthetic_shard(tmp_path / "d.jsonl", 5), vocab_size=96)
    taps = (0, 2, 4)  # embeddings, input of layer 2, output of the last layer (pre-norm)
    lengths = [len(s.ids) for s in seqs]
    assert sorted(lengths) != lengths  # the cache computes by length and writes in data order
    order = [3, 0, 4, 1, 2]
    online = OnlineFeatures(model, taps, seqs, max_tokens=64).get(order)
    cache = build_cache(model, taps, seqs, tmp_path / "cache", target_name="tiny", max_tokens=64, progress=False)
    cached = CachedFeatures(cache, taps, seqs).get(order)
    for (t1, f1), (t2, f2), s in zip(online, cached, [seqs[i] for i in order]):
        assert t2.dtype == torch.bfloat16 and t2.shape == (len(s.ids), 3 * 64)
        assert torch.allclose(t1, t2.float(), atol=0.05, rtol=0.02)
        assert torch.allclose(f1, f2.float(), atol=0.05, rtol=0.02)
        with torch.no_grad():
            hf = model(s.ids[None], output_hidden_states=True)
        assert torch.allclose(t1[:, :64], hf.hidden_states[0][0], atol=1e-5)
        assert torch.allclose(t1[:, 64:128], hf.hidden_states[2][0], atol=1e-5)
        # tap 4 = last layer's output before the final norm, which HF's hidden_states[-1] is not
        assert not torch.allclose(t1[:, 128:], hf.hidden_states[4][0], atol=1e-3)
        assert torch.allclose(model.lm_head(f1), hf.logits[0], atol=1e-4)  # final states are post-norm
    with pytest.raises(TrainError, match="taps"):
        CachedFeatures(cache, (1, 2), seqs)
    with pytest.raises(TrainError, match="other training data"):
        CachedFeatures(cache, taps, seqs[:4])


def test_engine_features_are_the_4bit_targets_and_a_cache_keeps_them_apart(tmp_path):
    """--feature-runtime engine: the native runtime with the engine's numbers (a model of exact 4-bit
    layers runs them as int4 on the kernels), close to the float model's states and not the same
    numbers; a cache says which states it holds and is not reused for the other kind."""
    model = q4_exact(tiny_target())
    seqs = load_sequences(synthetic_shard(tmp_path / "d.jsonl", 4), vocab_size=96)
    taps = (0, 2, 4)
    engine = Extractor(model, taps, "engine")
    assert engine.native.weights == "int4"
    native = Extractor(model, taps, "native")
    assert native.native.weights == "fp32"
    got, want = engine(seqs), native(seqs)
    differs = False
    for (t1, f1), (t2, f2) in zip(got, want):
        assert t1.shape == t2.shape and f1.shape == f2.shape
        assert (t1.float() - t2).norm() <= 0.05 * t2.norm() and (f1.float() - f2).norm() <= 0.05 * f2.norm()
        differs |= not torch.equal(f1.float(), f2)
    assert differs  # int4 kernels with the CPU's activations: the engine's numbers, not the float model's
    cache = build_cache(model, taps, seqs, tmp_path / "c", target_name="tiny", progress=False, runtime="engine")
    assert json.loads((cache / "meta.json").read_text())["numbers"] == "engine"
    ((t, f),) = CachedFeatures(cache, taps, seqs, "engine").get([0])
    assert torch.allclose(t.float(), got[0][0].float(), atol=0.05, rtol=0.02)
    assert torch.allclose(f.float(), got[0][1].float(), atol=0.05, rtol=0.02)
    with pytest.raises(TrainError, match="engine's states but --feature-runtime native"):
        CachedFeatures(cache, taps, seqs, "native")
    with pytest.raises(TrainError, match="engine's states but --feature-runtime hf"):
        build_cache(model, taps, seqs, cache, target_name="tiny", progress=False, runtime="hf")


def _all_args(tmp_path, train_prompts: str, held_prompts: str, *extra: str) -> list[str]:
    """`dspark train all` on a tiny target with a character tokenizer, settings small enough for a test."""
    target = tmp_path / "target"
    tiny_target().save_pretrained(target)
    char_tokenizer().save_pretrained(target)
    train_txt, held_txt = tmp_path / "train.txt", tmp_path / "held.txt"
    train_txt.write_text(train_prompts)
    held_txt.write_text(held_prompts)
    return [
        "train",
        "all",
        "--target",
        str(target),
        "--dtype",
        "fp32",
        "--out",
        str(tmp_path / "root"),
        "--train-prompts",
        str(train_txt),
        "--heldout-prompts",
        str(held_txt),
        "--max-new-tokens",
        "12",
        "--gamma",
        "3",
        "--layers",
        "1",
        "--markov-rank",
        "8",
        "--n-taps",
        "2",
        "--mask-token-id",
        "1",
        "--steps",
        "3",
        "--batch-size",
        "2",
        "--eval-max-new-tokens",
        "10",
        "--quiet",
        *extra,
    ]


def test_cli_all_runs_every_stage_and_a_rerun_resumes(tmp_path, capsys):
    from dspark.cli import main

    args = _all_args(
        tmp_path,
        "Say hi.\nName a color.\nCount to five.\nsay HI.\nWhat is two plus two?\n",
        "Name an animal.\nSay bye.\n",
        "--eval-prompts",
        "2",
    )
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "4 answers written" in out  # "say HI." duplicates "Say hi."
    assert "trained to step 3/3" in out and "outputs equal to plain decoding: 2/2" in out
    root = tmp_path / "root"
    for d in ("draft-speculators", "draft-deepspec", "run/draft", "features"):
        assert (root / d).is_dir(), d
    assert json.loads((root / "engine_eval.json").read_text())["outputs_equal_plain"] == 2
    assert main(args) == 0  # everything done: nothing regenerated, nothing retrained
    out = capsys.readouterr().out
    assert "0 answers written" in out and "4 of 4 answers already done" in out and "nothing left to train" in out

    # `train eval` decodes through build_engine with the shared engine flags
    evaluate = [
        "train",
        "eval",
        "--target",
        str(tmp_path / "target"),
        "--draft",
        str(root / "run" / "draft"),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--prompts",
        str(tmp_path / "held.txt"),
        "--max-new-tokens",
        "10",
        "--max-batch",
        "2",
        "--quiet",
        "--json",
    ]
    assert main(evaluate) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["prompts"] == 2 and res["outputs_equal_plain"] == 2 and res["verify_steps"] >= 1
    assert main(evaluate[:-1] + ["--no-spec"]) == 2  # nothing to compare without a draft


def test_cli_all_with_a_reduced_vocabulary_exports_speculators_only(tmp_path, capsys):
    from dspark.cli import main

    args = _all_args(
        tmp_path,
        "Say hi.\nName a color.\nCount to five.\n",
        "Name an animal.\n",
        "--draft-vocab",
        "24",
        "--eval-prompts",
        "1",
    )
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "draft vocabulary: 24 of" in out and "outputs equal to plain decoding: 1/1" in out
    root = tmp_path / "root"
    assert (root / "draft-speculators" / "model.safetensors").exists() and not (root / "draft-deepspec").exists()
    cfg = json.loads((root / "draft-speculators" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 24


def test_one_prompt_reader_for_training_and_measuring(tmp_path):
    """dspark.prompts reads every prompt file: gzipped JSON lines for training as for bench,
    and a training text file keeps a line that starts with '{' as text."""
    import gzip

    from dspark.prompts import read_prompt_file

    gz = tmp_path / "set.jsonl.gz"
    gz.write_bytes(gzip.compress(b'{"prompt": "first", "category": "a"}\n\n{"prompt": "second"}\n'))
    assert [(p.text, p.category) for p in load_prompts(str(gz))] == [("first", "a"), ("second", "")]
    assert read_prompt_file(gz) == ["first", "second"]
    txt = tmp_path / "set.txt"
    txt.write_text('{"prompt": "json-looking"}\nplain\n')
    assert [p.text for p in load_prompts(str(txt))] == ['{"prompt": "json-looking"}', "plain"]
    assert read_prompt_file(txt) == ["json-looking", "plain"]


def test_answer_heads_keep_each_answers_first_tokens():
    ids = torch.arange(12)
    mask = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1], dtype=torch.bool)
    prompt_only = Sequence("p", torch.arange(3), torch.zeros(3, dtype=torch.bool))
    cut, short, bare = answer_heads([Sequence("a", ids, mask), Sequence("b", ids[:5], mask[:5]), prompt_only], 4)
    assert cut.ids.tolist() == [0, 1, 2, 3, 4, 5, 6] and cut.loss_mask.sum() == 4 and cut.key == "a"
    assert short.ids.tolist() == [0, 1, 2, 3, 4]  # shorter than the window: whole
    assert bare.ids.tolist() == [0, 1, 2]
