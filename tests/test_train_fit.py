"""The training loop on a tiny target: loss goes down, checkpoints are drafts that `dspark inspect`
and the engine read, resume replays exactly, bad settings are clear errors."""

import json

import pytest
import torch
from dspark.cli import main
from dspark.engine.sampling import SamplingParams
from dspark.model.load import load_draft
from dspark.target.load import load_target
from dspark.train import trainer
from dspark.train.config import DraftOptions, TrainConfig
from dspark.train.errors import TrainError
from dspark.train.features import OnlineFeatures, fold_tap_scale, tap_scale
from dspark.train.trainer import load_state, train

from tests.test_train_fixtures import save_tiny_target, synthetic_shard
from tests.tiny import engine_for, hf_greedy

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("fit")
    return {
        "target": str(save_tiny_target(root / "target")),
        "data": str(synthetic_shard(root / "train.jsonl", 12)),
        "held": str(synthetic_shard(root / "held.jsonl", 3, seed=9)),
        "root": root,
    }


def cfg_for(setup, out, **kw):
    draft = kw.pop("draft", DraftOptions(gamma=4, num_layers=1, markov_rank=16, n_taps=2, mask_token_id=3))
    base = dict(
        target=setup["target"],
        data=setup["data"],
        heldout=setup["held"],
        out=str(setup["root"] / out),
        dtype="fp32",
        draft=draft,
        steps=24,
        batch_size=4,
        lr=3e-3,
        max_anchors=16,
        eval_every=12,
        ckpt_every=12,
    )
    base.update(kw)
    return TrainConfig(**base)


def test_training_reduces_loss_and_the_checkpoint_is_a_working_draft(setup, capsys):
    res = train(cfg_for(setup, "run"), progress=False, echo=print)
    assert res.step == 24 and len(res.losses) == 24
    assert sum(res.losses[-4:]) / 4 < 0.8 * sum(res.losses[:4]) / 4
    assert res.eval["blocks"] > 0 and 1.0 <= res.eval["tau_greedy"] <= 5.0 and len(res.eval["greedy_marginal"]) == 4
    log = [json.loads(line) for line in (setup["root"] / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r] == list(range(1, 25))
    assert [r["step"] for r in log if "eval" in r] == [12, 24]

    draft_dir = res.draft_dir
    assert "tau_greedy" in capsys.readouterr().out  # evaluations are reported as they happen
    assert main(["inspect", str(draft_dir), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["format"], info["layout"], info["gamma"], info["markov_rank"]) == (
        "speculators",
        "anchor_first",
        4,
        16,
    )
    assert not (set(json.loads((draft_dir / "config.json").read_text())) & {"embed_tokens.weight"})

    model, _ = load_target(setup["target"], "fp32")
    draft = load_draft(str(draft_dir), model)
    assert "embed_tokens.weight" in draft.borrowed and "lm_head.weight" in draft.borrowed
    saved = load_state(setup["root"] / "run")
    state = dict(saved["draft"])
    state["fc.weight"] = fold_tap_scale(state["fc.weight"], saved["tap_scale"])  # trained on scaled taps
    for k, v in draft.own_state_dict().items():  # the export is the trained fp32 weights in bf16
        assert torch.allclose(v.float(), state[k].to(torch.bfloat16).float()), k
    req = engine_for(model, draft).generate([1, 5, 9, 14], SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert req.output_ids == hf_greedy(model, [1, 5, 9, 14], 20)
    assert req.metrics.steps > 0


def test_resume_continues_from_the_saved_step_and_replays_exactly(setup, monkeypatch):
    full = train(cfg_for(setup, "straight", eval_every=100), progress=False)
    real = trainer.Run.train_step

    def crash_at_18(self, step):
        if step == 18:
            raise RuntimeError("power cut")
        return real(self, step)

    monkeypatch.setattr(trainer.Run, "train_step", crash_at_18)
    with pytest.raises(RuntimeError, match="power cut"):
        train(cfg_for(setup, "crashed", eval_every=100), progress=False)
    assert load_state(setup["root"] / "crashed")["step"] == 12  # the last periodic checkpoint
    monkeypatch.setattr(trainer.Run, "train_step", real)
    resumed = train(cfg_for(setup, "crashed", eval_every=100), progress=False)
    assert len(resumed.losses) == 12 and resumed.step == 24  # steps 13..24 only
    assert resumed.losses == pytest.approx(full.losses[12:], rel=1e-4)
    a, b = load_state(setup["root"] / "straight")["draft"], load_state(setup["root"] / "crashed")["draft"]
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    log = [json.loads(line) for line in (setup["root"] / "crashed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r] == list(
        range(1, 25)
    )  # steps 13..18 of the crashed session are not doubled
    with pytest.raises(TrainError, match="other settings"):
        train(cfg_for(setup, "crashed", lr=1e-3, eval_every=100), progress=False)


def test_markov_rank_0_and_bonus_anchor_train(setup):
    d = DraftOptions(gamma=3, num_layers=1, markov_rank=0, n_taps=2, mask_token_id=3, layout="bonus_anchor")
    res = train(cfg_for(setup, "dflash", draft=d, steps=6, eval_every=6, ckpt_every=6), progress=False)
    assert res.losses[-1] < res.losses[0]
    cfg = json.loads((res.draft_dir / "config.json").read_text())
    assert (cfg["sample_from_anchor"], cfg["block_size"], cfg["markov_rank"]) == (False, 4, 0)
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3


def test_bad_settings_are_clear_errors(setup, tmp_path):
    with pytest.raises(TrainError, match="anchor-first"):
        train(cfg_for(setup, "x", draft=DraftOptions(layout="bonus_anchor"), export_format="deepspec"), progress=False)
    with pytest.raises(TrainError, match="mask-token-id"):
        train(cfg_for(setup, "x", draft=DraftOptions(gamma=2, num_layers=1, mask_token_id=500)), progress=False)
    with pytest.raises(TrainError, match="taps"):
        train(cfg_for(setup, "x", draft=DraftOptions(gamma=2, num_layers=1, taps=(9,))), progress=False)
    with pytest.raises(TrainError, match="does not exist"):
        train(cfg_for(setup, "x", data=str(tmp_path / "none.jsonl")), progress=False)
    with pytest.raises(TrainError, match="--anchor-window"):
        train(cfg_for(setup, "x", anchor_window=-1), progress=False)
    with pytest.raises(TrainError, match="--eval-answer-tokens"):
        train(cfg_for(setup, "x", eval_answer_tokens=-5), progress=False)
    assert (
        main(
            [
                "train",
                "fit",
                "--target",
                setup["target"],
                "--data",
                setup["data"],
                "--out",
                str(tmp_path / "r"),
                "--warmup",
                "2",
            ]
        )
        == 2
    )


def test_cli_fit_with_feature_cache_then_export_both_formats(setup, tmp_path, capsys):
    run = tmp_path / "run"
    args = [
        "train",
        "fit",
        "--target",
        setup["target"],
        "--dtype",
        "fp32",
        "--data",
        setup["data"],
        "--heldout",
        setup["held"],
        "--features",
        str(tmp_path / "cache"),
        "--out",
        str(run),
        "--gamma",
        "3",
        "--layers",
        "1",
        "--markov-rank",
        "8",
        "--n-taps",
        "2",
        "--mask-token-id",
        "3",
        "--steps",
        "4",
        "--batch-size",
        "4",
        "--anchor-window",
        "20",
        "--eval-answer-tokens",
        "24",
        "--quiet",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "feature cache" in out and "MiB" in out and "trained to step 4/4" in out and "tau_greedy" in out
    assert "decoding walk: first slot" in out and "best held-out acceptance: walk_mal" in out
    assert "(first 24 answer tokens)" in out
    saved = json.loads((run / "train_config.json").read_text())
    assert saved["anchor_window"] == 20 and saved["eval_answer_tokens"] == 24
    for fmt in ("speculators", "deepspec"):
        assert main(["train", "export", "--run", str(run), "--format", fmt, "--out", str(tmp_path / fmt)]) == 0
        assert main(["inspect", str(tmp_path / fmt), "--json"]) == 0
    capsys.readouterr()
    assert (
        main(["train", "export", "--run", str(run), "--format", "deepspec", "--out", str(tmp_path / "deepspec")]) == 2
    )
    model, _ = load_target(setup["target"], "fp32")
    a = load_draft(str(tmp_path / "speculators"), model).own_state_dict()
    b = load_draft(str(tmp_path / "deepspec"), model).own_state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_refuses_changed_training_data(setup, tmp_path):
    data = synthetic_shard(tmp_path / "d.jsonl", 12)
    train(cfg_for(setup, "datachange", data=str(data), steps=2, eval_every=100, ckpt_every=1), progress=False)
    synthetic_shard(data, 12, seed=5)  # same path, other answers
    with pytest.raises(TrainError, match="other sequences"):
        train(cfg_for(setup, "datachange", data=str(data), steps=2, eval_every=100, ckpt_every=1), progress=False)


def test_reduced_draft_vocab_trains_exports_with_d2t_and_stays_lossless(setup, tmp_path, capsys):
    run = tmp_path / "run"
    args = [
        "train",
        "fit",
        "--target",
        setup["target"],
        "--dtype",
        "fp32",
        "--data",
        setup["data"],
        "--heldout",
        setup["held"],
        "--out",
        str(run),
        "--gamma",
        "3",
        "--layers",
        "1",
        "--markov-rank",
        "8",
        "--n-taps",
        "2",
        "--mask-token-id",
        "3",
        "--steps",
        "12",
        "--batch-size",
        "4",
        "--lr",
        "3e-3",
        "--draft-vocab",
        "40",
        "--quiet",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "draft vocabulary: 40 of 96 tokens" in out
    log = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    assert sum(losses[-3:]) < sum(losses[:3])
    assert main(["inspect", str(run / "draft"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["vocab_size"], info["draft_vocab_size"], info["has_d2t"]) == (96, 40, True)

    model, _ = load_target(setup["target"], "fp32")
    draft = load_draft(str(run / "draft"), model)
    assert "lm_head.weight" not in draft.borrowed  # a reduced head is saved with the draft
    ids = draft.d2t + torch.arange(40)
    assert torch.equal(
        draft.lm_head.weight.float(), model.get_output_embeddings().weight[ids].to(torch.bfloat16).float()
    )
    req = engine_for(model, draft).generate([1, 5, 9, 14], SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert req.output_ids == hf_greedy(model, [1, 5, 9, 14], 20)
    assert main(["train", "export", "--run", str(run), "--format", "deepspec", "--out", str(tmp_path / "ds")]) == 2
    assert "reduced draft vocabulary" in capsys.readouterr().err


def test_draft_output_norm_starts_at_the_targets_final_norm():
    from tests.tiny import tiny_draft, tiny_target

    model = tiny_target()
    with torch.no_grad():
        model.get_decoder().norm.weight.uniform_(0.5, 3.0)  # a trained target's gains are not all 1
    draft = tiny_draft(model)
    assert trainer.init_output_norm(draft, model)
    assert torch.equal(draft.norm.weight, model.get_decoder().norm.weight.detach())


def test_draft_layers_can_start_as_the_targets_last_layers(setup, tmp_path):
    """`--init-layers target`: each draft layer starts as one of the target's last layers (the
    draft-only q/k norms at 1), trains from there; mismatched shapes and --init are clear errors."""
    d = DraftOptions(gamma=3, num_layers=2, markov_rank=8, n_taps=2, mask_token_id=3)
    run = trainer.Run(
        cfg_for(setup, "init-target", draft=d, init_layers="target", steps=2, heldout=None),
        trainer.distributed.setup(),
        False,
    )
    source = list(run.model.get_decoder().layers)[-2:]
    for mine, theirs in zip(run.draft.layers, source):
        assert torch.equal(mine.mlp.gate_proj.weight, theirs.mlp.gate_proj.weight.float())
        assert torch.equal(mine.self_attn.k_proj.weight, theirs.self_attn.k_proj.weight.float())
        assert torch.equal(mine.input_layernorm.weight, theirs.input_layernorm.weight.float())
        assert bool((mine.self_attn.q_norm.weight == 1).all())
    fresh = trainer.Run(
        cfg_for(setup, "init-random", draft=d, steps=2, heldout=None), trainer.distributed.setup(), False
    )
    assert not torch.equal(fresh.draft.layers[1].mlp.gate_proj.weight, run.draft.layers[1].mlp.gate_proj.weight)
    rec = run.train_step(0)
    assert torch.isfinite(torch.tensor(rec["loss"]))
    narrow = DraftOptions(gamma=3, num_layers=1, markov_rank=8, n_taps=2, mask_token_id=3, intermediate_size=24)
    with pytest.raises(TrainError, match="init-layers target"):
        trainer.Run(
            cfg_for(setup, "init-narrow", draft=narrow, init_layers="target", heldout=None),
            trainer.distributed.setup(),
            False,
        )
    with pytest.raises(TrainError, match="choose one"):
        train(cfg_for(setup, "init-both", init_layers="target", init=str(tmp_path)), progress=False)
    with pytest.raises(SystemExit):  # argparse names the choices
        main(
            [
                "train",
                "fit",
                "--target",
                setup["target"],
                "--data",
                setup["data"],
                "--out",
                str(tmp_path / "r"),
                "--init-layers",
                "last",
            ]
        )


def test_tap_scaling_is_folded_into_fc_so_the_export_reads_raw_taps(setup):
    """Training conditions fc's input (taps / per-dim RMS); the exported draft must compute the
    same context from raw taps, or the engine would see a different draft than the one trained."""
    from dspark.train.dataset import load_sequences

    model, _ = load_target(setup["target"], "fp32")
    with torch.no_grad():  # give the tiny target a "massive" dimension like real residual streams
        model.get_decoder().layers[0].mlp.down_proj.weight[5].mul_(300.0)
    seqs = load_sequences(setup["data"], 96)
    feats = OnlineFeatures(model, (1, 3), seqs)
    scale = tap_scale(feats, list(range(len(seqs))), n_taps=2)
    raw_rms = torch.cat([t for t, _ in feats.get(list(range(len(seqs))))]).pow(2).mean(0).sqrt()
    assert scale.shape == (2 * 64,) and torch.allclose(scale, raw_rms, rtol=0.2)
    assert float(scale[5]) > 20 * float(scale.median())  # the massive dimension is what gets scaled down

    from tests.tiny import tiny_draft

    draft = tiny_draft(model, taps=(1, 3)).float()
    taps = feats.get([0])[0][0][None].float()
    pos = torch.arange(taps.shape[1])[None]
    trained = draft.context_kv(taps / scale, pos)
    with torch.no_grad():
        draft.fc.weight.copy_(fold_tap_scale(draft.fc.weight, scale))
    exported = draft.context_kv(taps, pos)
    for a, b in zip(trained, exported):
        assert torch.allclose(a.k, b.k, atol=1e-4) and torch.allclose(a.v, b.v, atol=1e-4)


@pytest.mark.parametrize("layout", ["anchor_first", "bonus_anchor"])
def test_one_draft_forward_over_many_sequences_trains_exactly_as_one_per_sequence(setup, layout):
    """Chunking (several sequences of different lengths padded into one draft forward) is a memory
    setting, not math: the step's loss and gradient equal sequence-by-sequence training."""
    d = DraftOptions(gamma=3, num_layers=1, markov_rank=8, n_taps=2, mask_token_id=3, layout=layout)
    kw = dict(draft=d, steps=4, eval_every=100, ckpt_every=100, head_dtype="fp32", heldout=None)
    runs = {
        n: trainer.Run(cfg_for(setup, f"{n}-{layout}", chunk_anchors=n, **kw), trainer.distributed.setup(), False)
        for n in (1, 10_000)
    }
    epoch, local = runs[1].batch(0)
    blocks = [runs[1].blocks(epoch, i) for i in local]
    assert len(runs[1].chunks(local, blocks)) == len(local)  # one sequence per forward
    assert len(runs[10_000].chunks(local, blocks)) == 1 and len({len(runs[1].seqs[i].ids) for i in local}) > 1
    recs = {n: run.train_step(0) for n, run in runs.items()}
    assert recs[10_000]["loss"] == pytest.approx(recs[1]["loss"], rel=1e-5)
    assert recs[10_000]["grad_norm"] == pytest.approx(recs[1]["grad_norm"], rel=1e-4)
    for p1, p2 in zip(runs[1].params, runs[10_000].params):
        assert torch.allclose(p1.grad, p2.grad, rtol=1e-4, atol=1e-7)
