"""Seconds per `dspark train fit` step on a feature cache, one thread: the steps' first visit
(cold) and the same steps again (warm: the target head's whole-vocabulary normaliser is kept).

    python scripts/train_step_cost.py --features runs/feat300k --data-tokens 300000 --seed 3 [--kv-heads 9]

The cache is one `train fit --features DIR` built with the same data flags (taps 2,15,30 here).
To compare with another version of the trainer, run the same command from a worktree of it
(`git worktree add /tmp/old COMMIT`, then `PYTHONPATH=/tmp/old python scripts/train_step_cost.py ...`),
alternating the two.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch
from dspark.train import distributed, trainer
from dspark.train.config import DraftOptions, TrainConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--features", required=True)
    p.add_argument("--data", default="data/smollm2/selfdistill-v1,data/smollm2/trainprompts-v1")
    p.add_argument("--data-tokens", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    torch.set_num_threads(1)
    opts = dict(gamma=3, num_layers=1, taps=(2, 15, 30), draft_vocab=16384)
    if args.kv_heads:
        opts["kv_heads"] = args.kv_heads
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(
            target="smollm2",
            data=args.data,
            out=out,
            features=args.features,
            data_tokens=args.data_tokens,
            seed=args.seed,
            max_seq_len=640,
            draft=DraftOptions(**opts),
            batch_size=8,
            max_anchors=32,
            steps=1000,
        )
        cfg.check()
        run = trainer.Run(cfg, distributed.setup(), False)
        for i in range(2):
            run.train_step(i)

        def timed() -> float:
            t = time.perf_counter()
            for i in range(2, 2 + args.steps):
                run.train_step(i)
            return (time.perf_counter() - t) / args.steps

        cold = timed()
        warm = timed() if hasattr(run, "target_head") else None
    print(json.dumps({"cold_s": round(cold, 3), "warm_s": None if warm is None else round(warm, 3)}))


if __name__ == "__main__":
    main()
