"""`dspark train {data,features,fit,vocab,export,eval,all}`: the training pipeline on the command line.

`dspark train all --target smollm2 --out runs/smollm2` runs every stage, each resumable:
rerunning the same command continues where it stopped. `train eval` decodes, so it takes the
engine flags of every decoding command and builds its engine through dspark.api.

This module dispatches the stages; one module beside it per job: train_flags.py the sub-parsers,
train_data.py the data engine's stages (prompts, data, pack, features), train_probe.py,
train_fit.py (fit, export), train_eval.py (eval), train_all.py (all).
"""

from __future__ import annotations

from dspark import envs
from dspark.cli.train_all import all_stage
from dspark.cli.train_data import data_stage, features_stage, pack_stage, prompts_stage
from dspark.cli.train_eval import eval_stage
from dspark.cli.train_fit import export_stage, fit_stage, vocab_stage
from dspark.cli.train_flags import add_arguments
from dspark.cli.train_probe import probe_stage
from dspark.outlock import output_lock
from dspark.train.errors import TrainError

__all__ = ["add_arguments", "run"]

STAGES = ("prompts", "data", "pack", "features", "fit", "vocab", "export", "eval", "all")
LOCKED_STAGES = ("prompts", "data", "pack", "features", "fit", "vocab", "export", "all")  # those whose --out they write


def run(args) -> int:
    if envs.world_size() > 1 and args.stage != "fit":
        raise TrainError(f"`dspark train {args.stage}` runs in one process; only `fit` is data-parallel under torchrun")
    # one writer per output (dspark/outlock.py); under torchrun the ranks of one fit share it: rank 0 holds it
    if args.stage not in LOCKED_STAGES or envs.rank() != 0:
        return _stage(args)
    with output_lock(args.out, f"dspark train {args.stage}"):
        return _stage(args)


def _stage(args) -> int:
    return {
        "prompts": prompts_stage,
        "pack": pack_stage,
        "data": data_stage,
        "features": features_stage,
        "fit": fit_stage,
        "vocab": vocab_stage,
        "export": export_stage,
        "eval": eval_stage,
        "probe": probe_stage,
        "all": all_stage,
    }[args.stage](args)
