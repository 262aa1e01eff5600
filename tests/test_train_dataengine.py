"""The self-distillation data engine: prompts written by the target, their filters, several sampled
answers per prompt, compact packed storage, and the trainer's warm start / time budget / best checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from dspark.train.checkpoint import keep_best
from dspark.train.config import DraftOptions, TrainConfig
from dspark.train.data import GenSettings, generate_shard
from dspark.train.dataset import load_sequences, read_records, token_subset
from dspark.train.errors import TrainError
from dspark.train.magpie import (
    FilterSettings,
    NearDuplicates,
    PromptFilter,
    PromptSampling,
    categorize,
    garbage_reason,
    protected_shingles,
    user_prefix,
    write_prompts,
)
from dspark.train.prompts import Prompt
from dspark.train.store import pack, unpack
from dspark.train.trainer import train
from safetensors.torch import load_file

from tests.test_train_fixtures import char_tokenizer, save_tiny_target, synthetic_shard
from tests.tiny import tiny_target

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- prompts (Magpie) and filters


def test_user_prefix_is_the_template_up_to_the_users_words():
    tok = char_tokenizer()
    assert user_prefix(tok) == "<|im_start|>user\n"
    with pytest.raises(TrainError, match="no chat template"):
        user_prefix(char_tokenizer(chat_template=False))


@pytest.mark.parametrize(
    "text,reason",
    [
        ("Hi", "too short"),
        ("word " * 200, "too long"),
        ("Tell me <|im_start|> something nice please", "non-text"),
        ("}}} {{{ ;;; ))) ((( ### $$$ %%% ^^^ &&& *** !!!", "non-text"),
        ("Объясни мне пожалуйста как работает фотосинтез", "non-text"),
        ("the the the the the the the the the the the the the", "repetitive"),
        ("Explain how photosynthesis turns light into sugar.", None),
        ("Write a Python function that returns the n-th Fibonacci number.", None),
    ],
)
def test_garbage_filter_names_why_a_prompt_is_rejected(text, reason):
    assert garbage_reason(text, FilterSettings()) == reason


def test_near_duplicates_are_caught_and_distinct_prompts_kept():
    nd = NearDuplicates(0.7)
    base = "Can you explain the main differences between renewable and non-renewable energy sources in detail"
    assert nd.add_if_new(base)
    assert not nd.add_if_new(base + " please")  # one word more: Jaccard of 3-grams ~0.94
    assert nd.add_if_new("Write a short poem about a cat who wants to become an astronaut on the moon")


def test_filter_drops_exact_and_protected_and_reports_categories(tmp_path):
    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"turns": ["Please reason step by step and put your final answer in a box now"]}) + "\n")
    f = PromptFilter(FilterSettings(), protected_shingles([held]))
    assert f.keep("Write a Python function that sorts a list of numbers.") is not None
    assert f.keep("write a python function that SORTS a list of numbers.") is None  # exact (normalized) duplicate
    assert f.keep("How many apples? Please reason step by step and put your final answer in a box now") is None
    assert f.keep("Explain why the sky is blue to a child.", finished=False) is None
    r = f.report.to_dict()
    assert r["kept"] == 1 and r["sampled"] == 4
    assert r["rejected"] == {"duplicate": 1, "overlaps a protected set": 1, "unfinished": 1}
    assert r["categories"] == {"code": 1}
    assert categorize("Solve the equation 2x + 3 = 7") == "math"
    assert categorize("Write a poem about rain") == "writing"


def test_protected_sets_must_exist(tmp_path):
    with pytest.raises(TrainError, match="does not exist"):
        protected_shingles([tmp_path / "nope.jsonl"])
    with pytest.raises(TrainError, match="no .jsonl"):
        protected_shingles([tmp_path])


def test_write_prompts_samples_from_the_prefix_appends_and_resumes(tmp_path):
    model, tok = tiny_target(), char_tokenizer()
    loose = FilterSettings(min_words=1, min_letter_frac=0.0, min_unique_frac=0.0, max_words=10_000)
    s = PromptSampling(max_new_tokens=12, batch_size=8, seed=3)
    out = tmp_path / "p.jsonl"
    # a random target rarely emits its one end token: a quarter of the ids end a turn here, so turns finish
    stops = set(range(60, 84))
    rep = write_prompts(model, tok, 5, out, sampling=s, stops=stops, filters=loose, max_batches=4, progress=False)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert rep.sampled >= 8 and len(lines) == min(5, rep.kept)
    assert {"prompt", "category"} <= set(lines[0])
    before = out.read_text()
    write_prompts(model, tok, len(lines), out, sampling=s, stops=stops, filters=loose, progress=False)
    assert out.read_text() == before  # already holds n: nothing sampled
    with pytest.raises(TrainError, match="other sampling"):
        write_prompts(
            model, tok, 50, out, sampling=PromptSampling(temperature=0.5), stops=stops, filters=loose, progress=False
        )


def test_openings_begin_the_sampled_turns_in_turn_and_are_pinned(tmp_path):
    """--opening: each batch's turns start with its opening (the batches take them in turn), the
    model writing the rest; a file written with openings refuses to resume without them."""
    model, tok = tiny_target(), char_tokenizer()
    loose = FilterSettings(min_words=1, min_letter_frac=0.0, min_unique_frac=0.0, max_words=10_000)
    s = PromptSampling(max_new_tokens=12, batch_size=8, seed=3, openings=("ab ", "cd "))
    stops = set(range(60, 84))
    out = tmp_path / "p.jsonl"
    write_prompts(model, tok, 100, out, sampling=s, stops=stops, filters=loose, max_batches=2, progress=False)
    texts = [json.loads(x)["prompt"] for x in out.read_text().splitlines()]
    assert texts and all(t.startswith(("ab", "cd")) for t in texts)
    assert {t[:2] for t in texts} == {"ab", "cd"}  # batch 0 the first opening, batch 1 the second
    side = json.loads(out.with_name(out.name + ".meta.json").read_text())
    assert side["sampling"]["openings"] == ["ab ", "cd "]
    with pytest.raises(TrainError, match="other sampling"):
        write_prompts(
            model,
            tok,
            200,
            out,
            sampling=PromptSampling(max_new_tokens=12, batch_size=8, seed=3),
            stops=stops,
            filters=loose,
            progress=False,
        )


# ---------------------------------------------------------------- answers and packed storage


def _tiny_dir(tmp_path) -> Path:
    p = save_tiny_target(tmp_path / "target")
    char_tokenizer().save_pretrained(p)
    return p


def test_several_sampled_answers_per_prompt_with_top_k(tmp_path):
    model, tok = tiny_target(), char_tokenizer()
    prompts = [Prompt("hello there"), Prompt("what is up")]
    out = tmp_path / "s.jsonl"
    s = GenSettings(max_new_tokens=8, temperature=0.7, top_p=0.8, top_k=20, samples=3, seed=1)
    st = generate_shard(model, tok, prompts, out, s, target_name="tiny", batch_size=4, progress=False)
    recs = read_records(out)
    assert st.written == 6 and st.tokens_per_s > 0
    assert sorted(r["key"] for r in recs) == sorted(k for p in prompts for k in (p.key, p.key + "#1", p.key + "#2"))
    again = generate_shard(model, tok, prompts, out, s, target_name="tiny", batch_size=4, progress=False)
    assert again.written == 0 and again.skipped == 6
    with pytest.raises(TrainError, match="--samples"):
        GenSettings(temperature=0.0, samples=2).check()


def test_pack_roundtrip_is_exact_and_compact_and_checked(tmp_path):
    shard = synthetic_shard(tmp_path / "d.jsonl", 40, seed=2)
    (tmp_path / "d.jsonl.meta.json").write_text(json.dumps({"target": "tiny", "vocab_size": 96, "temperature": 0.0}))
    weights = tmp_path / "w.bin"
    weights.write_bytes(b"weights")
    m = pack([shard], tmp_path / "packed", target_file=weights, chat_template="T", note="test")
    assert m["counts"]["sequences"] == 40 and m["target_file"]["name"] == "w.bin"
    assert m["parts"][0]["settings"]["temperature"] == 0.0
    with np.load(tmp_path / "packed" / "tokens.npz") as z:
        assert z["ids"].dtype == np.uint16
    a, b = load_sequences(shard, 96), load_sequences(tmp_path / "packed", 96)
    assert [(x.ids.tolist(), x.loss_mask.tolist()) for x in a] == [(x.ids.tolist(), x.loss_mask.tolist()) for x in b]
    assert unpack(tmp_path / "packed", tmp_path / "back.jsonl") == 40
    assert [r["ids"] for r in read_records(tmp_path / "back.jsonl")] == [r["ids"] for r in read_records(shard)]
    (tmp_path / "packed" / "tokens.npz").write_bytes(b"corrupt")
    with pytest.raises(TrainError, match="does not match its manifest"):
        load_sequences(tmp_path / "packed", 96)


def test_committed_training_data_is_readable_and_large():
    """The bundled draft's data set is in the repository, compact, with a manifest that pins the target."""
    root = ROOT / "data" / "smollm2"
    seqs = load_sequences(root / "selfdistill-v1", 49152)
    m = json.loads((root / "selfdistill-v1" / "manifest.json").read_text())
    assert m["counts"]["answer_tokens"] == sum(int(s.loss_mask.sum()) for s in seqs) >= 1_000_000
    assert m["target_file"]["name"].endswith(".gguf") and len(m["target_file"]["sha256"]) == 64
    assert {p["settings"]["temperature"] for p in m["parts"]} == {0.0, 0.7}
    held = load_sequences(root / "heldout-v1", 49152)
    assert len(held) == 40


def test_the_next_data_rounds_answer_only_prompts_no_other_set_answers(tmp_path):
    """Each round after selfdistill-v1 (v2, v3, ...) answers Magpie prompts no earlier set answers,
    none of them held out, sampled as v1's sampled half, each with its own seed;
    scripts/unanswered_prompts.py then leaves exactly the rest."""
    import subprocess
    import sys

    from dspark.train.prompts import load_prompts

    root = ROOT / "data" / "smollm2"
    rounds = sorted((p.name for p in root.glob("selfdistill-v*")), key=lambda n: int(n.rsplit("v", 1)[1]))
    assert rounds[:3] == ["selfdistill-v1", "selfdistill-v2", "selfdistill-v3"]
    held = {p.key for p in load_prompts("heldout")}
    keys, seeds = {}, set()
    for name in rounds:
        with np.load(root / name / "tokens.npz") as z:
            keys[name] = {str(k).split("#")[0] for k in z["keys"]}
        assert keys[name] and not keys[name] & held, name
        if name == "selfdistill-v1":
            continue
        for earlier in rounds[: rounds.index(name)]:
            assert not keys[name] & keys[earlier], (name, earlier)
        m = json.loads((root / name / "manifest.json").read_text())
        settings = m["parts"][0]["settings"]
        assert (settings["temperature"], settings["top_p"], settings["top_k"]) == (0.7, 0.8, 20), name
        assert settings["seed"] not in seeds, name  # a round's answers are not another's resampled
        seeds.add(settings["seed"])
        assert m["counts"]["sequences"] == len(keys[name]) == len(load_sequences(root / name, 49152))
    out = tmp_path / "rest.jsonl"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "unanswered_prompts.py"), str(root / "magpie-prompts-v1.jsonl.gz")]
        + [str(root / name) for name in rounds]
        + ["--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    rest = {p.key for p in load_prompts(str(out))}
    every = {p.key for p in load_prompts(str(root / "magpie-prompts-v1.jsonl.gz"))}
    assert rest == every - set().union(*keys.values())


def test_the_science_round_answers_prompts_the_target_wrote_from_openings():
    """science-v1: answers to prompts SmolLM2 wrote from explanation openings (`train prompts
    --opening`), none held out, none answered by another set, none on the README prompt's topic
    (the sky's colour: the README job must not be trained on), sampled as the rounds are, with a
    seed of its own."""
    from dspark.train.prompts import load_prompts

    root = ROOT / "data" / "smollm2"
    prompts = {p.key: p.text for p in load_prompts(str(root / "science-prompts-v1.jsonl.gz"))}
    side = json.loads((root / "science-prompts-v1.meta.json").read_text())
    assert len(side["sampling"]["openings"]) >= 10
    with np.load(root / "science-v1" / "tokens.npz") as z:
        keys = {str(k).split("#")[0] for k in z["keys"]}
    assert keys and keys <= set(prompts)
    assert not keys & {p.key for p in load_prompts("heldout")}
    assert not [k for k in keys if "sky" in prompts[k].lower() and "blue" in prompts[k].lower()]
    seeds = set()
    for other in root.glob("selfdistill-v*"):
        with np.load(other / "tokens.npz") as z:
            assert not keys & {str(k).split("#")[0] for k in z["keys"]}, other.name
        seeds.add(json.loads((other / "manifest.json").read_text())["parts"][0]["settings"]["seed"])
    m = json.loads((root / "science-v1" / "manifest.json").read_text())
    settings = m["parts"][0]["settings"]
    assert (settings["temperature"], settings["top_p"], settings["top_k"]) == (0.7, 0.8, 20)
    assert settings["seed"] not in seeds
    assert m["counts"]["sequences"] == len(keys) == len(load_sequences(root / "science-v1", 49152))


def test_token_subset_is_seeded_and_sized(tmp_path):
    seqs = load_sequences(synthetic_shard(tmp_path / "sub.jsonl", 50), 96)
    a, b = token_subset(seqs, 100, 0), token_subset(seqs, 100, 0)
    assert [s.key for s in a] == [s.key for s in b]
    total = sum(int(s.loss_mask.sum()) for s in a)
    assert 100 <= total < 100 + max(int(s.loss_mask.sum()) for s in seqs)


# ---------------------------------------------------------------- trainer: best checkpoint, budget, warm start


def _cfg(tmp_path, target, data, **kw) -> TrainConfig:
    d = DraftOptions(gamma=3, num_layers=1, markov_rank=8, n_taps=2, mask_token_id=3)
    base = dict(
        target=str(target),
        data=str(data),
        heldout=str(data),
        out=str(tmp_path / "run"),
        dtype="fp32",
        draft=d,
        steps=6,
        batch_size=4,
        lr=3e-3,
        max_anchors=8,
        eval_every=2,
        ckpt_every=3,
        eval_max_anchors=16,
    )
    base.update(kw)
    return TrainConfig(**base)


def test_best_is_judged_by_one_measure(tmp_path):
    exported: list[int] = []

    def keep(ev, step, window=128):
        return keep_best(tmp_path, ev, step, lambda d: exported.append(step) or d, window)

    walk = {"blocks": 9, "tau_greedy": 1.9, "greedy_conditional": [0.5], "walk_mal": 1.6, "walk_first_slot": 0.4}
    assert keep(walk, 1)["measure"] == "walk_mal" and exported == [1]
    # a higher tau_greedy with a lower walk does not replace it; a higher walk does
    assert keep({**walk, "tau_greedy": 2.5, "walk_mal": 1.5}, 2)["step"] == 1 and exported == [1]
    assert keep({**walk, "tau_greedy": 1.0, "walk_mal": 1.7}, 3)["step"] == 3 and exported == [1, 3]
    # another window, or whole answers (no walk): figures that do not compare, so the new one is kept
    assert keep({**walk, "walk_mal": 1.1}, 4, window=256)["answer_tokens"] == 256 and exported[-1] == 4
    whole = keep({"blocks": 9, "tau_greedy": 1.2, "greedy_conditional": [0.2]}, 5, window=0)
    assert whole["measure"] == "tau_greedy" and "walk_mal" not in whole and exported[-1] == 5
    assert keep({"blocks": 9, "tau_greedy": 1.1, "greedy_conditional": [0.1]}, 6, window=0)["step"] == 5
    assert keep({"blocks": 0}, 7) is None and exported[-1] == 5


def test_best_checkpoint_time_budget_and_warm_start(tmp_path):
    target = _tiny_dir(tmp_path)
    data = synthetic_shard(tmp_path / "d.jsonl", 24)
    res = train(_cfg(tmp_path, target, data), progress=False)
    run = tmp_path / "run"
    best = json.loads((run / "best.json").read_text())
    evals = [json.loads(x)["eval"] for x in (run / "metrics.jsonl").read_text().splitlines() if '"eval"' in x]
    # judged by the decoding walk over the answers' first 128 tokens (the default), recorded as such
    assert best["measure"] == "walk_mal" and best["answer_tokens"] == 128
    assert best["walk_mal"] == max(e["walk_mal"] for e in evals) and res.best == best
    assert all(e["walk_blocks"] > 0 and 0 <= e["walk_first_slot"] <= 1 for e in evals)
    assert (run / "best" / "config.json").exists()

    # a tiny budget stops the session early, saves, and a rerun continues to the planned end
    cfg = _cfg(tmp_path, target, data, out=str(tmp_path / "budget"), steps=40, time_budget=1e-3)
    r1 = train(cfg, progress=False)
    assert r1.stopped_early and r1.step < 40 and (tmp_path / "budget" / "state.pt").exists()
    r2 = train(_cfg(tmp_path, target, data, out=str(tmp_path / "budget"), steps=40), progress=False)
    assert r2.step == 40 and not r2.stopped_early

    # warm start: step-0 held-out evaluation of the new run equals the init draft's trained quality
    warm = train(
        _cfg(
            tmp_path, target, data, out=str(tmp_path / "warm"), steps=1, lr=1e-12, warmup=0.0, init=str(run / "draft")
        ),
        progress=False,
    )
    assert abs(warm.eval["tau_greedy"] - res.eval["tau_greedy"]) < 0.05
    assert abs(warm.eval["loss"] - res.eval["loss"]) < 0.02
    # ... measured before the first step too: the init draft is the best checkpoint until beaten
    first = json.loads((tmp_path / "warm" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 0 and abs(first["eval"]["tau_greedy"] - warm.eval["tau_greedy"]) < 1e-4  # lr ~0
    assert json.loads((tmp_path / "warm" / "best.json").read_text())["tau_greedy"] >= first["eval"]["tau_greedy"]
    with pytest.raises(TrainError, match="does not fit"):
        train(
            _cfg(
                tmp_path,
                target,
                data,
                out=str(tmp_path / "bad"),
                init=str(run / "draft"),
                draft=DraftOptions(gamma=3, num_layers=2, markov_rank=8, n_taps=2, mask_token_id=3),
            ),
            progress=False,
        )
    # --init-adapt: another block size and other taps of the same count start from the same weights,
    # and the run says what changed; the tap count and the architecture still must match
    other = DraftOptions(gamma=2, num_layers=1, markov_rank=8, taps=(3,), mask_token_id=3)  # the init taps (2,)
    with pytest.raises(TrainError, match="does not fit"):
        train(
            _cfg(tmp_path, target, data, out=str(tmp_path / "noadapt"), init=str(run / "draft"), draft=other),
            progress=False,
        )
    said = []
    adapted = train(
        _cfg(
            tmp_path,
            target,
            data,
            out=str(tmp_path / "adapt"),
            steps=1,
            init=str(run / "draft"),
            draft=other,
            init_adapt=True,
        ),
        progress=False,
        echo=said.append,
    )
    assert adapted.step == 1 and any("gamma 3 -> 2" in s and "(2,) -> (3,)" in s for s in said)
    init = load_file(str(run / "draft" / "model.safetensors"))
    assert torch.equal(
        load_file(str(tmp_path / "adapt" / "best" / "model.safetensors"))["layers.0.mlp.down_proj.weight"],
        init["layers.0.mlp.down_proj.weight"],
    )  # step 0 (the init's weights) is the best so far
    with pytest.raises(TrainError, match="hidden_state_indices"):
        train(
            _cfg(
                tmp_path,
                target,
                data,
                out=str(tmp_path / "adapt3"),
                init=str(run / "draft"),
                init_adapt=True,
                draft=DraftOptions(gamma=3, num_layers=1, markov_rank=8, taps=(1, 2), mask_token_id=3),
            ),
            progress=False,
        )
    with pytest.raises(TrainError, match="--init-adapt needs --init"):
        train(_cfg(tmp_path, target, data, out=str(tmp_path / "adapt4"), init_adapt=True), progress=False)
    # --init-adapt grows a deeper draft: the file's layer first, the new one adding nothing at the start,
    # so the grown draft's step-0 figures are the file's own; a shallower run is still refused
    said = []
    deeper = train(
        _cfg(
            tmp_path,
            target,
            data,
            out=str(tmp_path / "grow"),
            steps=1,
            lr=1e-12,
            warmup=0.0,
            init=str(run / "draft"),
            init_adapt=True,
            draft=DraftOptions(gamma=3, num_layers=2, markov_rank=8, n_taps=2, mask_token_id=3),
        ),
        progress=False,
        echo=said.append,
    )
    assert any("num_layers 1 -> 2" in s for s in said)
    first = json.loads((tmp_path / "grow" / "metrics.jsonl").read_text().splitlines()[0])
    assert abs(first["eval"]["loss"] - warm.eval["loss"]) < 1e-4
    assert abs(first["eval"]["tau_greedy"] - warm.eval["tau_greedy"]) < 1e-4
    grown = load_file(str(tmp_path / "grow" / "draft" / "model.safetensors"))
    assert torch.equal(grown["layers.0.self_attn.q_proj.weight"], init["layers.0.self_attn.q_proj.weight"])
    assert grown["layers.1.mlp.gate_proj.weight"].abs().max() > 0  # trained from its init, not zero
    assert deeper.step == 1
    with pytest.raises(TrainError, match="num_layers"):
        train(
            _cfg(
                tmp_path,
                target,
                data,
                out=str(tmp_path / "shrink"),
                init=str(tmp_path / "grow" / "draft"),
                init_adapt=True,
            ),
            progress=False,
        )


def test_a_resumed_warm_start_with_a_reduced_vocabulary_trains_against_its_own_head_rows(tmp_path):
    """Found resuming a SmolLM2 fit: the resumed run recomputed the vocabulary from
    its data, restored the checkpoint's rows, but kept a bf16 copy of the recomputed rows for the
    frozen head matmul -- acceptance fell from 1.58 to 1.04. The copy must be the checkpoint's."""
    from dspark.train import distributed
    from dspark.train.trainer import Run

    target = _tiny_dir(tmp_path)
    d = DraftOptions(gamma=3, num_layers=1, markov_rank=8, n_taps=2, mask_token_id=3, draft_vocab=40)
    first = synthetic_shard(tmp_path / "a.jsonl", 24, seed=0)
    train(_cfg(tmp_path, target, first, draft=d, out=str(tmp_path / "init")), progress=False)
    other = synthetic_shard(tmp_path / "b.jsonl", 24, seed=7)  # another vocabulary would be chosen from this
    cfg = _cfg(
        tmp_path,
        target,
        other,
        draft=d,
        out=str(tmp_path / "warm"),
        steps=20,
        time_budget=1e-3,
        init=str(tmp_path / "init" / "draft"),
    )
    assert train(cfg, progress=False).stopped_early
    run = Run(
        _cfg(
            tmp_path,
            target,
            other,
            draft=d,
            out=str(tmp_path / "warm"),
            steps=20,
            init=str(tmp_path / "init" / "draft"),
        ),
        distributed.setup(),
        progress=False,
    )
    assert run.resumed and run.head_weight is not None
    assert torch.equal(run.head_weight, run.draft.lm_head.weight.detach().to(torch.bfloat16))
    init = load_file(str(tmp_path / "init" / "draft" / "model.safetensors"))
    assert torch.equal(run.draft.d2t.cpu(), init["d2t"])  # the init's vocabulary, kept through the resume


@pytest.mark.slow
def test_scale_recipe_runs_every_stage_at_tiny_scale(tmp_path):
    target = _tiny_dir(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"Tell me fact number {i} about rivers."}) + "\n" for i in range(12))
    )
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "scale_recipe.py"),
            "--out",
            str(out),
            "--target",
            str(target),
            "--scale",
            "tiny",
            "--prompts-from",
            str(prompts),
            "--dtype",
            "fp32",
            "--fit-s",
            "6",
            "--probe-s",
            "3",
            "--data-s",
            "40",
            "--budget-s",
            "90",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stages"]["data"]["answer_tokens"] > 0
    winner = summary["returned_draft"]
    assert winner in ("L1-r64", "L2-r64") and summary["returned_drafts"] == [winner, "L1-r64-bonus", "L1-r0"]
    assert {f.name for f in (out / "return").iterdir()} == {
        "tokens.npz",
        "meta.tar.gz",
        f"draft-{winner}.tar",
        "draft-L1-r64-bonus.tar",
        "draft-L1-r0.tar",
    }
    assert load_sequences(out / "data", 96)
    # the returned drafts travel without their reduced-vocabulary head rows; restore rebuilds them exactly
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "scale_recipe.py"),
            "--restore",
            str(out / "return"),
            "--target",
            str(target),
            "--out",
            str(tmp_path / "restored"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in summary["returned_drafts"]:
        got = load_file(tmp_path / "restored" / f"draft-{name}" / "model.safetensors")
        want = load_file(out / "runs" / name / "best" / "model.safetensors")
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want), name
        assert json.loads((tmp_path / "restored" / f"draft-{name}" / "config.json").read_text()) == json.loads(
            (out / "runs" / name / "best" / "config.json").read_text()
        )
    # a second run trains on the data set the first one packed (what a GPU session with committed data does)
    again = tmp_path / "again"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "scale_recipe.py"),
            "--out",
            str(again),
            "--target",
            str(target),
            "--scale",
            "tiny",
            "--data-from",
            str(out / "data"),
            "--heldout-from",
            str(out / "heldout.jsonl"),
            "--runs",
            "L1-r64,L1-r64-bonus",
            "--dtype",
            "fp32",
            "--fit-s",
            "6",
            "--probe-s",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((again / "summary.json").read_text())
    assert set(summary["stages"]["fit"]["runs"]) == {"L1-r64", "L1-r64-bonus"}
    assert summary["returned_drafts"] == ["L1-r64", "L1-r64-bonus"]


def test_engine_generator_matches_hf_greedy_and_sampled_answers_do_not_depend_on_batching(tmp_path):
    from dspark.engine.engine import Engine
    from dspark.target.hf import HFTarget

    model, tok = tiny_target(), char_tokenizer()
    prompts = [Prompt("hello there"), Prompt("what is up, friend?"), Prompt("a"), Prompt("tell me a story now")]
    engine = Engine(HFTarget(model), None, tok, (2,))
    greedy = GenSettings(max_new_tokens=12)
    generate_shard(model, tok, prompts, tmp_path / "hf.jsonl", greedy, target_name="tiny", batch_size=3, progress=False)
    generate_shard(
        model,
        tok,
        prompts,
        tmp_path / "en.jsonl",
        greedy,
        target_name="tiny",
        batch_size=3,
        progress=False,
        engine=engine,
    )
    by_key = lambda p: {r["key"]: (r["ids"], r["finish"]) for r in read_records(p)}  # noqa: E731
    assert by_key(tmp_path / "hf.jsonl") == by_key(tmp_path / "en.jsonl")  # fp32: the same greedy answers

    sampled = GenSettings(max_new_tokens=12, temperature=1.0, samples=2, seed=5)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    generate_shard(model, tok, prompts, a, sampled, target_name="tiny", batch_size=1, progress=False, engine=engine)
    st = generate_shard(
        model, tok, prompts, b, sampled, target_name="tiny", batch_size=8, progress=False, engine=engine
    )
    assert st.written == 8 and by_key(a) == by_key(b)
    with pytest.raises(TrainError, match="other settings"):  # one shard, one generator
        generate_shard(model, tok, prompts, a, sampled, target_name="tiny", batch_size=1, progress=False)


def test_cli_prompts_gives_up_clearly_and_pack_writes_a_loadable_set(tmp_path, capsys):
    from dspark.cli import main

    target = _tiny_dir(tmp_path)
    out = tmp_path / "p.jsonl"
    # a random tiny model never ends a user turn: the command stops at its bound with a clear error
    code = main(
        [
            "train",
            "prompts",
            "--target",
            str(target),
            "--dtype",
            "fp32",
            "--quiet",
            "--n",
            "50",
            "--out",
            str(out),
            "--gen-batch-size",
            "8",
            "--max-new-tokens",
            "4",
            "--max-batches",
            "2",
        ]
    )
    err = capsys.readouterr()
    assert code == 2 and "stopped after 2 batches" in err.err and "unfinished 16" in err.out
    base = ["train", "prompts", "--target", str(target), "--dtype", "fp32", "--quiet", "--n", "50"]
    code = main([*base, "--out", str(tmp_path / "o.jsonl"), "--max-batches", "1", "--opening", " "])
    assert code == 2 and "--opening takes the words a prompt starts with" in capsys.readouterr().err
    main([*base, "--out", str(tmp_path / "o.jsonl"), "--max-batches", "1", "--gen-batch-size", "2", "--opening", "Why"])
    side = json.loads((tmp_path / "o.jsonl.meta.json").read_text())
    assert side["sampling"]["openings"] == ["Why"]
    shard = synthetic_shard(tmp_path / "d.jsonl", 10)
    assert main(["train", "pack", str(shard), "--out", str(tmp_path / "packed"), "--target", str(target)]) == 0
    assert "10 sequences" in capsys.readouterr().out
    m = json.loads((tmp_path / "packed" / "manifest.json").read_text())
    assert m["target_file"]["name"] == "model.safetensors" and len(load_sequences(tmp_path / "packed", 96)) == 10
