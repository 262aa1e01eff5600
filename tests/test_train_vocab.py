"""`dspark train vocab`: a draft cut to the tokens its answers use most drafts those exactly as
before (same states, same logits over the kept tokens), stays lossless, and says what it cut."""

from __future__ import annotations

import json

import pytest
import torch
from dspark.cli import main
from dspark.engine.sampling import SamplingParams
from dspark.formats.convert import write_speculators
from dspark.model.load import load_draft
from dspark.train.dataset import load_sequences
from dspark.train.errors import TrainError
from dspark.train.vocab import select_draft_vocab, shrink_draft_vocab

from tests.test_train_fixtures import synthetic_shard
from tests.tiny import engine_for, hf_greedy, tiny_draft, tiny_target

torch.set_num_threads(1)
V = 96


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab")
    model = tiny_target(layers=2)
    draft = tiny_draft(model, gamma=3)
    src = root / "full"
    write_speculators(draft.spec, draft.own_state_dict(), src)  # the head is borrowed: not in the file
    data = synthetic_shard(root / "d.jsonl", 12)
    return {"root": root, "model": model, "src": src, "data": data, "seqs": load_sequences(data, V)}


def _slot0_logits(draft, taps, anchors):
    """The first slot's Markov-corrected logits over the draft vocabulary, teacher-forced (modules)."""
    T = taps.shape[1]
    ctx = draft.context_kv(taps, torch.arange(T)[None].expand(taps.shape[0], -1))
    block = torch.full((anchors.shape[0], draft.spec.query_slots), draft.spec.mask_token_id)
    block[:, 0] = anchors
    h = draft(block, ctx, torch.full((anchors.shape[0],), T))
    bias, _ = draft.markov_head.block_bias(block, h)
    return (draft.lm_head(h) + bias)[:, 0]


def test_the_kept_tokens_are_drafted_exactly_as_before(setup, tmp_path):
    model, seqs = setup["model"], setup["seqs"]
    with pytest.raises(TrainError, match="borrows the target's LM head"):
        shrink_draft_vocab(setup["src"], tmp_path / "x", seqs, 40)
    done = shrink_draft_vocab(
        setup["src"], tmp_path / "d40", seqs, 40, target_head=lambda: model.get_output_embeddings().weight
    )
    assert (done.spec.draft_vocab_size, done.spec.has_d2t, done.coverage_before) == (40, True, 1.0)
    # cut again, from a draft that stores its head and d2t: the top 20 of its 40 are the top 20
    again = shrink_draft_vocab(tmp_path / "d40", tmp_path / "d20", seqs, 20)
    assert 0 < again.coverage_after < done.coverage_after < 1.0

    full = load_draft(str(setup["src"]), model, dtype=torch.float32)
    for n in (40, 20):
        small = load_draft(str(tmp_path / f"d{n}"), model, dtype=torch.float32)
        ids = small.to_target_ids(torch.arange(n))
        assert ids.tolist() == select_draft_vocab(seqs, V, n).tolist()  # the answers' most used tokens
        assert torch.equal(small.lm_head.weight, full.lm_head.weight[ids])
        assert torch.equal(small.markov_head.markov_w2.weight, full.markov_head.markov_w2.weight[ids])
        gen = torch.Generator().manual_seed(n)
        taps = torch.randn(6, 9, full.fc.weight.shape[1], generator=gen)
        anchors = torch.randint(4, V, (6,), generator=gen)
        with torch.no_grad():
            a, b = _slot0_logits(full, taps, anchors), _slot0_logits(small, taps, anchors)
        assert torch.allclose(b, a[:, ids], atol=1e-6)  # the same logits over the kept tokens
        best = a.argmax(-1)
        kept = torch.isin(best, ids)
        assert kept.any() and torch.equal(ids[b.argmax(-1)][kept], best[kept])

    req = engine_for(model, small).generate([1, 5, 9, 14], SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert req.output_ids == hf_greedy(model, [1, 5, 9, 14], 20)


def test_cli_writes_the_cut_draft_and_refuses_what_it_cannot_do(setup, tmp_path, capsys):
    base = ["train", "vocab", "--draft", str(setup["src"]), "--data", str(setup["data"])]
    target = tmp_path / "target"
    setup["model"].save_pretrained(target)
    out = tmp_path / "d30"
    assert main([*base, "--draft-vocab", "30", "--out", str(out), "--target", str(target)]) == 0
    line = capsys.readouterr().out
    assert "draft vocabulary 96 -> 30 tokens, covering 100.00% ->" in line and str(out) in line
    assert main(["inspect", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["vocab_size"], info["draft_vocab_size"], info["has_d2t"]) == (V, 30, True)
    # not fewer tokens than it has; an output that holds something
    assert main([*base, "--draft-vocab", "96", "--out", str(tmp_path / "same"), "--target", str(target)]) == 2
    assert "choose fewer" in capsys.readouterr().err
    cut = ["train", "vocab", "--draft", str(out), "--data", str(setup["data"]), "--draft-vocab", "10"]
    assert main([*cut, "--out", str(out)]) == 2
    assert "not an empty directory" in capsys.readouterr().err
