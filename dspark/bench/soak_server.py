"""`dspark serve` as the soak's child process on 127.0.0.1: started, waited for, its memory sampled,
stopped with SIGTERM as a supervisor stops it."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from dspark import envs
from dspark.bench.soak_client import HOST, get_json
from dspark.errors import DSparkError


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ServerProcess:
    """`dspark serve ARGS --host 127.0.0.1 --port PORT` as a child process, its output in a file."""

    def __init__(self, serve_args: list[str], port: int, start_timeout: float):
        self.port = port
        self.log = tempfile.NamedTemporaryFile("w+b", prefix="dspark-soak-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "dspark", "serve", *serve_args, "--host", HOST, "--port", str(port)]
        # its own server on 127.0.0.1: a $DSPARK_API_KEY in the environment would make it ask for a key
        env = envs.child_env(drop=("DSPARK_API_KEY",))
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        try:
            self._wait_healthy(start_timeout)
        except BaseException:
            self.kill()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise DSparkError(f"dspark serve exited {self.proc.returncode} before answering:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise DSparkError(f"dspark serve did not answer /health within {timeout:.0f} s:\n{self.log_tail()}")
            try:
                if get_json(self.port, "/health", 2)[0] == 200:
                    return
            except (OSError, http.client.HTTPException, ValueError):
                pass
            time.sleep(0.25)

    def rss_bytes(self) -> int | None:
        return rss_bytes(self.proc.pid)

    def log_text(self) -> str:
        return Path(self.log.name).read_text(encoding="utf-8", errors="replace")

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, as a supervisor sends it; the exit code (None never: killed after `timeout`)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        self.kill()
        self.log.close()
        os.unlink(self.log.name)


def rss_bytes(pid: int) -> int | None:
    """Resident memory of a process: /proc on Linux, psutil elsewhere when it is installed."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil  # optional: not a dependency of dspark
    except ImportError:
        return None
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return None


class RssSampler:
    """The server's resident memory every `every` seconds while the load runs: its peak."""

    def __init__(self, server: ServerProcess, every: float = 0.5):
        self.server, self.every, self.peak = server, every, server.rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            rss = self.server.rss_bytes()
            if rss is not None:
                self.peak = max(self.peak or 0, rss)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
