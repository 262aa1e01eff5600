"""Issue 55: one writer per output. `dspark train data|fit|features|pack` and `dspark convert` lock
their output; a second run refuses at once naming the holder's pid; a killed holder never blocks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from dspark.cli import main
from dspark.errors import DSparkError
from dspark.formats.convert import write_speculators
from dspark.outlock import lock_path, output_lock

from tests.tiny import tiny_draft, tiny_target

ROOT = Path(__file__).resolve().parents[1]
HOLD = """
import sys, time
from dspark.outlock import output_lock
with output_lock(sys.argv[1], "the test's holder"):
    print("locked", flush=True)
    time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path):
    """Another process holding the lock of an output, until the test kills it."""
    procs = []

    def hold(out: Path) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout.readline().strip() == "locked"
        return proc

    yield hold
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)  # no clean-up of its own: the lock file stays behind
    proc.wait()


def _refused(argv: list[str], pid: int, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"pid {pid}" in err and "being written by another process" in err, err
    return err


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    model = tiny_target(layers=2)
    draft = tiny_draft(model, gamma=3)
    path = tmp_path_factory.mktemp("outlock") / "draft"
    write_speculators(draft.spec, draft.own_state_dict(), path)
    return path


def test_a_second_convert_refuses_then_a_killed_holders_lock_never_blocks(tmp_path, holder, draft_dir, capsys):
    dst = tmp_path / "converted"
    first = holder(dst)
    err = _refused(["convert", str(draft_dir), str(dst), "--to", "deepspec"], first.pid, capsys)
    assert str(dst) in err and "the test's holder" in err
    assert not dst.exists()  # refused before writing anything
    _kill(first)
    assert lock_path(dst).exists()  # the killed run's lock file is still there ...
    assert main(["convert", str(draft_dir), str(dst), "--to", "deepspec"]) == 0  # ... and blocks nothing
    assert (dst / "model.safetensors").is_file()


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "data", "--out", "{out}", "--target", "/nonexistent"],
        ["train", "fit", "--data", "/nonexistent.jsonl", "--out", "{out}"],
        ["train", "features", "--data", "/nonexistent.jsonl", "--out", "{out}"],
        ["train", "pack", "/nonexistent.jsonl", "--out", "{out}"],
    ],
    ids=lambda argv: " ".join(argv[:2]),
)
def test_every_training_writer_refuses_a_locked_output_before_loading_anything(tmp_path, holder, argv, capsys):
    out = tmp_path / "out"
    first = holder(out)
    # the inputs do not exist: a command that did not check the lock first would fail on them instead
    _refused([a.format(out=out) for a in argv], first.pid, capsys)
    _kill(first)
    assert main([a.format(out=out) for a in argv]) == 2
    assert "being written by another process" not in capsys.readouterr().err  # past the lock: the inputs fail


def test_one_process_may_not_hold_an_output_twice_and_spellings_of_a_path_meet(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with output_lock("runs/x", "first"):
        with pytest.raises(DSparkError, match=f"pid {os.getpid()}, first"):
            with output_lock(tmp_path / "runs" / "x", "second"):
                pass
        assert lock_path("./runs/x/") == lock_path(tmp_path / "runs" / "x") == tmp_path / "runs" / ".x.lock"
    with output_lock("runs/x", "again"):  # released with the block
        pass


def test_a_build_stopped_midway_leaves_no_lock_that_hangs_the_next(tmp_path, caplog):
    """torch's cpp_extension takes its build lock by creating `lock` in the build folder and drops it
    by deleting it; a build killed in between left it there and every later start waited forever.
    Under dspark's own build lock (an flock, gone with its holder) such a file is stale: removed."""
    import fcntl
    import logging

    from dspark.outlock import shared_build

    build = tmp_path / "dspark_avx512_0123"
    build.mkdir()
    (build / "lock").touch()
    with caplog.at_level(logging.WARNING, logger="dspark"), shared_build(build, "the kernels"):
        assert not (build / "lock").exists()
        other = os.open(tmp_path / f".{build.name}.build.lock", os.O_RDWR)
        try:  # while one process builds, another cannot take the lock (it waits in shared_build)
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(other)
    assert any("stopped midway" in r.getMessage() for r in caplog.records)
    with shared_build(build, "the kernels"):  # released at the block's end: taken again at once
        pass
