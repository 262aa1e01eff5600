"""Issue 52: the load-time draft check is measured once per target, draft, runtime and machine
(dspark.doctor.cache), and start-up says what it does (dspark.progress, the CLI's stderr lines)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys

import numpy as np
import pytest
from dspark import progress
from dspark.api import EngineConfig, build_engine
from dspark.cli import show_library_log
from dspark.doctor import cache as check_cache
from dspark.doctor import quick
from dspark.formats.convert import write_deepspec

from tests.test_train_fixtures import char_tokenizer
from tests.tiny import tiny_draft, tiny_target


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("check-cache")
    model = tiny_target(vocab=len(char_tokenizer()))
    model.save_pretrained(root / "target")
    char_tokenizer().save_pretrained(root / "target")
    write_deepspec(*_draft(model, seed=1), root / "draft")
    write_deepspec(*_draft(model, seed=2), root / "other")  # the same config, other weights
    return root


def _draft(model, seed):
    draft = tiny_draft(model, gamma=3, seed=seed)
    return draft.spec, draft.own_state_dict()


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """A fresh cache folder, and quick_check counting its calls."""
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    calls = []
    real = quick.quick_check

    def counting(engine, **kw):
        calls.append(engine)
        return real(engine, **kw)

    monkeypatch.setattr(quick, "quick_check", counting)
    return calls


def _build(root, draft="draft", **kw):
    kw = {"dtype": "fp32", "device": "cpu", "verify": "full", **kw}
    return build_engine(EngineConfig(target=str(root / "target"), draft=str(root / draft), **kw))


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "dspark"]


def test_the_second_build_reads_the_check_back(saved, counted, monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="dspark"):
        first = _build(saved)
    assert len(counted) == 1 and first.prior is not None
    files = list((check_cache.envs.cache_dir() / "draft-checks").glob("*.json"))
    assert len(files) == 1
    said = first_said = _messages(caplog)
    assert any(m.startswith("checking the draft at load time") for m in said)
    assert any(m.startswith("load-time draft check: ") and m.split()[4] == "s" for m in said), said  # "N.N s"

    def refuse(engine, **kw):
        raise AssertionError("quick_check ran although its result was cached")

    monkeypatch.setattr(quick, "quick_check", refuse)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dspark"):
        second = _build(saved)
    said = _messages(caplog)
    assert not any(m.startswith("checking the draft") for m in said)
    # the random tiny draft looks misread: the warnings come back with the numbers
    warned = [m for m in said if m.startswith("WARNING: draft check: ")]
    assert warned, "the tiny draft (seed 1) no longer looks misread: pick a draft the check warns about"
    assert warned == [m for m in first_said if m.startswith("WARNING: draft check: ")]
    assert any(m.startswith(f"load-time draft check: cached ({files[0]}; measured in ") for m in said), said
    # what build_engine takes from the check is what was measured
    assert second.prior is not None and np.array_equal(second.prior.accepted, first.prior.accepted)
    assert second.prior.gamma == first.prior.gamma and second.prior.draft_seconds > 0  # timed afresh
    # --no-check as before: no check, nothing read, no prior
    assert _build(saved, check=False).prior is None


def test_a_changed_draft_file_or_setting_measures_again(saved, counted, tmp_path):
    _build(saved)
    _build(saved, "other")  # other weights, the same config
    assert len(counted) == 2
    _build(saved, runtime="hf")  # the same files through transformers
    assert len(counted) == 3
    _build(saved, "other")
    _build(saved, runtime="hf")
    assert len(counted) == 3  # each identity measured once
    # the draft copied elsewhere, then a file of the copy rewritten: its content is what counts
    copy = tmp_path / "copy" / "draft"
    shutil.copytree(saved / "draft", copy)
    _build(saved, copy)
    assert len(counted) == 3  # the same files: the first measurement
    config = json.loads((copy / "config.json").read_text())
    config["mask_token_id"] = 4
    (copy / "config.json").write_text(json.dumps(config))
    _build(saved, copy)
    assert len(counted) == 4


def test_a_corrupt_or_foreign_cache_file_is_ignored_with_a_warning(saved, counted, caplog):
    first = _build(saved)
    (path,) = (check_cache.envs.cache_dir() / "draft-checks").glob("*.json")
    good = json.loads(path.read_text())
    for bad in (
        b"{ not json",
        b"\xff\xfe binary",
        json.dumps({"format": "dspark-cost-curve", "tokens": [1]}).encode(),  # another cache's file
        json.dumps({**good, "identity": {**good["identity"], "cpu": "elsewhere"}}).encode(),  # copied over
        json.dumps({**good, "accepted": [1, -2]}).encode(),
    ):
        path.write_bytes(bad)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="dspark"):
            again = _build(saved)
        warned = [m for m in _messages(caplog) if m.startswith("WARNING: ignoring draft check cache")]
        assert len(warned) == 1 and str(path) in warned[0], _messages(caplog)
        assert np.array_equal(again.prior.accepted, first.prior.accepted)  # measured again, the same text
        assert json.loads(path.read_text())["accepted"] == good["accepted"]  # and rewritten
    assert len(counted) == 6


def test_big_files_are_hashed_once_per_path_size_and_mtime(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(check_cache, "HASH_MEMO_BYTES", 8)
    big, small = tmp_path / "model.safetensors", tmp_path / "config.json"
    big.write_bytes(b"0123456789" * 10)
    small.write_bytes(b"{}")
    first = check_cache.file_digest(big)
    hashed = []
    real = check_cache._sha256
    monkeypatch.setattr(check_cache, "_sha256", lambda p: hashed.append(p.name) or real(p))
    assert check_cache.file_digest(big) == first and hashed == []  # the memo, not the content
    assert check_cache.directory_digests(tmp_path) == {"config.json": real(small), "model.safetensors": first}
    assert hashed == ["config.json"]  # small files are simply hashed
    big.write_bytes(b"9876543210" * 10)  # the same size
    os.utime(big, ns=(big.stat().st_atime_ns, big.stat().st_mtime_ns + 10**9))
    assert check_cache.file_digest(big) != first and hashed[-1] == "model.safetensors"
    (memo,) = (tmp_path / "cache" / "file-hashes").glob("*.json")
    memo.write_text("[]")
    with caplog.at_level(logging.WARNING, logger="dspark"):
        assert check_cache.file_digest(big) == real(big)
    assert any(str(memo) in r.getMessage() for r in caplog.records)


def test_start_up_steps_say_when_they_start_and_end(saved, counted, caplog):
    heard = []  # what dspark serve's /health reason follows while it loads
    with caplog.at_level(logging.INFO, logger="dspark"), progress.listening(heard.append):
        _build(saved)
    said, target = _messages(caplog), str(saved / "target")
    assert [h.split(" (")[0] for h in heard] == [
        f"loading target {target}",
        "profiling the verify cost curve",  # a fresh DSPARK_CACHE: the curve is measured
        "checking the draft at load time",
    ]
    assert [f"{h} ..." for h in heard] == [m for m in said if m.endswith(" ...")]
    starts = [m for m in said if m.startswith(f"loading target {target} (") and m.endswith(" ...")]
    ends = [m for m in said if m.startswith(f"loaded target {target} in ")]
    assert len(starts) == 1 and len(ends) == 1, said
    assert " s (read " in ends[0] and "packed" in ends[0] and ends[0].endswith("fp32 weights)")
    assert said.index(starts[0]) < said.index(ends[0])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dspark"):
        _build(saved, runtime="hf")
    said = [m for m in _messages(caplog) if m.startswith(("loading target", "loaded target"))]
    assert len(said) == 2 and said[0] == f"loading target {target} (transformers runtime) ..."
    assert said[1].startswith(f"loaded target {target} in ") and said[1].endswith(" s")


def test_the_command_line_prints_the_librarys_info_lines(monkeypatch, capsys):
    """Python prints a library's warnings only; dspark's commands print its INFO lines too, plain,
    on stderr, unless logging was configured (serve's --log-level: then by the root's handlers)."""
    log = logging.getLogger("dspark")
    monkeypatch.setattr(log, "handlers", [])
    monkeypatch.setattr(log, "level", logging.NOTSET)
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # as outside pytest: nothing configured
    show_library_log()
    show_library_log()  # once a process, however many commands main() runs
    log.info("loaded target x in 1.0 s")
    assert capsys.readouterr().err == "loaded target x in 1.0 s\n"
    monkeypatch.setattr(logging.getLogger(), "handlers", [logging.StreamHandler(sys.stdout)])
    log.info("said by the root's handler")
    out = capsys.readouterr()
    assert out.err == "" and out.out == "said by the root's handler\n"
