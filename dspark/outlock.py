"""One writer per output: the commands that write a data set, a cache, a run or a draft
(`dspark train data|fit|features|pack|...`, `dspark convert`) lock it first.

Two runs on the same output interleave appended records, overwrite each other's checkpoints or
mix two caches, and nothing says so until training reads garbage. The lock is the OS's advisory
`flock` on a file beside the output (never inside it: `convert` wants an empty directory). The
kernel drops it when the process ends, however it ends, so a lock file left by a killed run
never blocks the next one; the file itself is left in place, since removing it would let two
processes lock two different files of the same name.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from dspark.errors import DSparkError

log = logging.getLogger("dspark")


def lock_path(out) -> Path:
    """`.NAME.lock` in the output's own directory: runs that name it differently ("runs/x",
    "./runs/x/", an absolute path) meet on the same file."""
    out = Path(os.path.abspath(out))
    return out.with_name(f".{out.name or 'root'}.lock")


@contextmanager
def output_lock(out, command: str) -> Iterator[Path]:
    """Hold the lock of `out` for the block; a second holder is refused at once, naming the pid of
    the first (a DSparkError: the command exits 2)."""
    path = lock_path(out)

    def refuse(fd: int) -> None:
        raise DSparkError(
            f"{out} is being written by another process ({_holder(fd)}; lock file {path}): two writers "
            "would corrupt it. Wait for that run to end or stop it, or choose another output"
        )

    with _flocked(path, command, refuse):
        yield path


@contextmanager
def _flocked(path: Path, who: str, busy: Callable[[int], None]) -> Iterator[None]:
    """An exclusive flock on `path` for the block, `who` written in it for a second comer (who gets
    busy(fd): a refusal, or a wait). The kernel drops it with the process, however it ends."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            taken = True
        except BlockingIOError:
            taken = False
        if not taken:  # outside the handler: a refusal raised here carries no BlockingIOError context
            busy(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {who}\n".encode())  # who holds it, for the second comer
        yield
    finally:
        os.close(fd)  # releases the lock


def _holder(fd: int) -> str:
    """'pid N (command)' from the lock file (written just after the holder took it)."""
    text = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
    pid, _, command = text.partition(" ")
    if not pid.isdigit():
        return "its pid is not written yet"
    return f"pid {pid}, {command}" if command else f"pid {pid}"


@contextmanager
def shared_build(directory: Path, what: str) -> Iterator[None]:
    """Hold `directory`'s build lock for the block, waiting (and saying so) while another process
    builds there. Under it, a lock file torch's cpp_extension left in the directory (`lock`,
    taken by creating the file and dropped by deleting it) is stale: its builder was stopped before
    it could delete it, and every later load would wait on it forever. It is removed, saying so."""

    def wait(fd: int) -> None:
        log.warning("waiting for another process building %s (%s) ...", what, _holder(fd))
        fcntl.flock(fd, fcntl.LOCK_EX)

    with _flocked(directory.with_name(f".{directory.name}.build.lock"), f"build {what}", wait):
        stale = directory / "lock"
        if stale.exists():
            log.warning("removing %s: a build of %s was stopped midway and left it behind", stale, what)
            stale.unlink(missing_ok=True)
        yield
