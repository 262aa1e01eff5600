"""One clock for every measurement (decode-step time split, cost-curve profiling, benchmarks)."""

from __future__ import annotations

import time

import torch


def now(device) -> float:
    """perf_counter once the device's queued work is done: CUDA kernels run asynchronously, so an
    unsynchronised clock would charge a forward's time to whatever happens to wait for it next."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
