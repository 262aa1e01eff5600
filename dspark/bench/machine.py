"""What a benchmark ran on: recorded with every result, so numbers are never read without it."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import torch
import transformers


def machine_info(device: str) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": device,
        "gpu": torch.cuda.get_device_name(0) if torch.device(device).type == "cuda" else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "load_average_start": load_average(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    return info


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None
