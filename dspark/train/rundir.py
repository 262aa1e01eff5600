"""The run directory of `dspark train fit`: what lives where, read back by resume and by export.

train_config.json  the TrainConfig of the run (a resume must match its locked settings)
state.pt           fp32 draft weights, optimizer, scheduler, step, tap scale, data digest
metrics.jsonl      one record per step, plus one per held-out evaluation
draft/             the latest checkpoint exported in bf16 (read by `dspark inspect` and the engine)
best/, best.json   the checkpoint with the best held-out greedy acceptance so far, and its figures
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dspark.train.config import TrainConfig
from dspark.train.errors import TrainError

CONFIG, STATE, METRICS, DRAFT, BEST = "train_config.json", "state.pt", "metrics.jsonl", "draft", "best"


def read_run_config(run_dir: Path) -> TrainConfig:
    path = Path(run_dir) / CONFIG
    if not path.exists():
        raise TrainError(f"{run_dir} is not a training run directory (no {CONFIG})")
    return TrainConfig.from_json(json.loads(path.read_text()))


def load_state(run_dir: Path) -> dict:
    path = Path(run_dir) / STATE
    if not path.exists():
        raise TrainError(f"{run_dir} has no checkpoint ({STATE}) yet")
    return torch.load(path, map_location="cpu", weights_only=True)
