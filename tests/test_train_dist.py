"""Data parallelism: 2 processes under torchrun (gloo, 127.0.0.1) train what 1 process trains."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
from dspark.cli import main
from dspark.train.trainer import load_state

from tests.test_train_fixtures import save_tiny_target, synthetic_shard

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one(tmp_path):
    target = save_tiny_target(tmp_path / "target")
    data, held = synthetic_shard(tmp_path / "d.jsonl", 10), synthetic_shard(tmp_path / "h.jsonl", 2, seed=3)
    # batch 5 over 2 processes: uneven shares (3 + 2 sequences) must still give the 1-process gradient
    args = [
        "train",
        "fit",
        "--target",
        str(target),
        "--dtype",
        "fp32",
        "--data",
        str(data),
        "--heldout",
        str(held),
        "--gamma",
        "3",
        "--layers",
        "1",
        "--markov-rank",
        "8",
        "--n-taps",
        "2",
        "--mask-token-id",
        "3",
        "--steps",
        "4",
        "--batch-size",
        "5",
        "--lr",
        "3e-3",
        "--max-anchors",
        "8",
        "--eval-every",
        "4",
        "--ckpt-every",
        "2",
        "--quiet",
    ]
    assert main(args + ["--out", str(tmp_path / "one")]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "dspark",
        *args,
        "--out",
        str(tmp_path / "two"),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    one, two = load_state(tmp_path / "one"), load_state(tmp_path / "two")
    assert two["step"] == one["step"] == 4
    for k, v in one["draft"].items():
        assert torch.allclose(v, two["draft"][k], atol=2e-5, rtol=1e-4), k
    losses = [
        [
            json.loads(x)["loss"]
            for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in x and '"eval"' not in x
        ]
        for d in ("one", "two")
    ]
    assert len(losses[0]) == 4 and all(abs(a - b) < 1e-5 for a, b in zip(*losses))
    assert (tmp_path / "two" / "draft" / "model.safetensors").exists()
