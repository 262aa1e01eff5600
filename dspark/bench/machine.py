"""What a benchmark ran on: recorded with every result, so numbers are never read without it."""

from __future__ import annotations

import os
import platform
import time

import torch
import transformers

from dspark.target.load import cpu_model_and_flags


def machine_info(device: str) -> dict:
    cpu = cpu_model_and_flags()[0] or platform.processor() or platform.machine()
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
