"""Exports of a trained draft: the real `speculators` library loads the speculators file and computes
the very logits dspark trained (both layouts); dspark reads both families back identically."""

import json

import pytest
import torch
from dspark.model.load import load_draft
from dspark.target.load import load_target
from dspark.train.config import DraftOptions, TrainConfig
from dspark.train.dataset import load_sequences
from dspark.train.errors import TrainError
from dspark.train.export import export_run
from dspark.train.features import OnlineFeatures
from dspark.train.loss import draft_rows, make_blocks
from dspark.train.trainer import train

from tests.test_train_fixtures import save_tiny_target, synthetic_shard

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    return root, save_tiny_target(root / "target"), synthetic_shard(root / "d.jsonl", 6)


def trained(tiny, layout, markov, name, draft_vocab=None):
    root, target, data = tiny
    d = DraftOptions(
        gamma=4,
        num_layers=2,
        markov_rank=8,
        markov_head_type=markov,
        taps=(1, 3),
        mask_token_id=3,
        layout=layout,
        draft_vocab=draft_vocab,
    )
    cfg = TrainConfig(
        target=str(target), data=str(data), out=str(root / name), dtype="fp32", draft=d, steps=3, batch_size=3, lr=1e-2
    )
    return train(cfg, progress=False)


@pytest.mark.parametrize(
    "layout,markov,draft_vocab",
    [("anchor_first", "vanilla", None), ("bonus_anchor", "rnn", None), ("anchor_first", "vanilla", 40)],
)
def test_speculators_library_loads_the_export_and_computes_the_trained_logits(
    tiny, layout, markov, draft_vocab, monkeypatch
):
    spec_lib = pytest.importorskip("speculators.models.dspark")
    import speculators.models.dflash.core as dflash_core
    import speculators.models.dspark.core as dspark_core

    root, target, data = tiny
    res = trained(tiny, layout, markov, f"run-{layout}-{draft_vocab}", draft_vocab)
    cfg_json = json.loads((res.draft_dir / "config.json").read_text())
    gamma_written = cfg_json["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    assert cfg_json["sample_from_anchor"] is (layout == "anchor_first") and gamma_written == 4
    assert cfg_json["block_size"] == (4 if layout == "anchor_first" else 5)
    assert cfg_json["speculators_config"]["verifier"]["name_or_path"] == str(target.resolve())
    assert cfg_json["aux_hidden_state_layer_ids"] == [1, 3]

    config = spec_lib.DSparkSpeculatorConfig.from_pretrained(res.draft_dir)
    config.transformer_layer_config._attn_implementation = "sdpa"  # flex attention needs a compiler on CPU
    theirs_model = spec_lib.DSparkDraftModel.from_pretrained(res.draft_dir, config=config, dtype=torch.float32).eval()
    assert theirs_model.config.sample_from_anchor is (layout == "anchor_first")
    if draft_vocab:  # the reduced vocabulary's mapping reaches the library as written
        sd = theirs_model.state_dict()
        assert int(sd["t2d"].sum()) == draft_vocab and sd["d2t"].shape == (draft_vocab,)

    model, _ = load_target(str(target), "fp32")
    ours = load_draft(str(res.draft_dir), model, dtype=torch.float32)
    seq = load_sequences(data)[0]
    L = len(seq.ids)
    taps, final = OnlineFeatures(model, ours.spec.hidden_state_indices, [seq]).get([0])[0]
    anchors = torch.tensor([8, 11])
    blocks = make_blocks(seq.ids, torch.ones(L, dtype=torch.bool), anchors, layout=layout, gamma=4, mask_token_id=3)
    with torch.no_grad():
        out = draft_rows(
            ours,
            ours.context_kv(taps[None], torch.arange(L)[None]),
            blocks,
            seq.ids,
            final,
            model.get_output_embeddings(),
        )

    captured = {}

    def capture(logits, targets, confidence_logits, *args, **kwargs):
        captured["logits"], captured["conf"] = logits, confidence_logits
        return torch.zeros(()), {}

    monkeypatch.setattr(dspark_core, "compute_metrics", capture)
    monkeypatch.setattr(
        dflash_core, "select_anchors", lambda mask, n, bs: (anchors.clone(), torch.ones(2, dtype=torch.bool))
    )
    with torch.no_grad():
        theirs_model(
            hidden_states=taps[None],
            input_ids=seq.ids[None],
            loss_mask=torch.ones(1, L),
            verifier_last_hidden_states=final[None],
            document_ids=torch.zeros(1, L, dtype=torch.long),
            max_anchors=2,
            loss_config={},
        )
    S = blocks.block_ids.shape[1]
    theirs = captured["logits"].view(2, S, -1)[out.rows[:, 0], out.rows[:, 1]]
    assert torch.allclose(theirs, out.logits, atol=1e-5)
    if draft_vocab:
        assert torch.equal(sd["d2t"].long(), ours.d2t.long())
    assert torch.allclose(captured["conf"].view(2, S)[out.rows[:, 0], out.rows[:, 1]], out.conf_logits, atol=1e-5)


def test_deepspec_export_reads_back_identically_and_refuses_bonus_anchor(tiny):
    root, target, _ = tiny
    res = trained(tiny, "anchor_first", "gated", "run-ds")
    export_run(res.draft_dir.parent, root / "ds", "deepspec")
    cfg = json.loads((root / "ds" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["block_size"] == 4
    assert cfg["target_layer_ids"] == [0, 2]  # DeepSpec counts layer outputs: aux index - 1
    model, _ = load_target(str(target), "fp32")
    a, b = load_draft(str(root / "ds"), model).own_state_dict(), load_draft(str(res.draft_dir), model).own_state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "embed_tokens.weight" not in a and "lm_head.weight" not in a
    with pytest.raises(TrainError, match="not empty"):
        export_run(res.draft_dir.parent, root / "ds", "deepspec")
    bonus = trained(tiny, "bonus_anchor", "vanilla", "run-bonus")
    with pytest.raises(TrainError, match="anchor-first"):
        export_run(bonus.draft_dir.parent, root / "ds-bonus", "deepspec")
