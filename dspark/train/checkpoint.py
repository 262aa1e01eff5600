"""Checkpointing and resume of `dspark train fit`: what state.pt holds, written atomically with the
latest checkpoint exported beside it; a saved state checked against the run before the run goes on
from it (steps after it are replayed, so their old metrics records go); the checkpoint with the
best held-out greedy acceptance kept. Where each file lives: dspark.train.rundir. The loop that
calls these is dspark.train.trainer."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

from dspark.train.errors import TrainError
from dspark.train.export import checkpoint_tensors, write_draft
from dspark.train.rundir import BEST, METRICS, STATE


def pack_state(*, step: int, total: int, elapsed: float, data_digest, draft, tap_scale, opt, sched) -> dict:
    """What state.pt holds: the fp32 draft weights, optimizer, scheduler, step, tap scale, data digest."""
    return {
        "step": step,
        "total_steps": total,
        "elapsed": elapsed,
        "data_digest": data_digest,
        "draft": {k: v.detach().cpu().clone() for k, v in draft.own_state_dict().items()},
        "tap_scale": tap_scale,
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
    }


def write_state(run_dir: Path, state: dict) -> None:
    """state.pt, atomically: a crash while writing leaves the previous checkpoint whole."""
    tmp = Path(run_dir) / (STATE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, Path(run_dir) / STATE)


def export_checkpoint(dst: Path, spec, draft, tap_scale, export_format: str, verifier) -> Path:
    """The draft's weights as a bf16 checkpoint of `export_format` in dst (replacing what is there)."""
    tensors = checkpoint_tensors(draft.own_state_dict(), spec.vocab_size, tap_scale)
    return write_draft(spec, tensors, dst, export_format, verifier, replace=True)


def restore_state(
    state: dict, *, run_dir: Path, data: str, draft, opt, sched, total: int, data_digest
) -> tuple[int, float]:
    """Load a saved state into the draft, optimizer and scheduler once it fits this run (same weights,
    same planned steps, same data); returns (step, elapsed seconds)."""
    own = draft.own_state_dict()
    if set(state["draft"]) != set(own):
        raise TrainError(f"{run_dir}/{STATE} does not match this draft's weights (architecture changed?)")
    draft.load_state_dict(state["draft"], strict=False)
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    step, elapsed = int(state["step"]), float(state.get("elapsed", 0.0))
    if state.get("total_steps") != total:
        raise TrainError(f"checkpoint planned {state.get('total_steps')} steps, this run {total}")
    if state.get("data_digest") not in (None, data_digest):  # None: written before digests were kept
        raise TrainError(f"{data} holds other sequences than the checkpoint was trained on: choose another --out")
    return step, elapsed


def drop_replayed_records(run_dir: Path, step: int) -> None:
    """Steps after the checkpoint are replayed: drop their old records from metrics.jsonl."""
    log = Path(run_dir) / METRICS
    if log.exists():
        keep = [line for line in log.read_text().splitlines() if json.loads(line).get("step", 0) <= step]
        log.write_text("".join(line + "\n" for line in keep))


def keep_best(
    run_dir: Path, ev: dict | None, step: int, export: Callable[[Path], Path], answer_tokens: int = 0
) -> dict | None:
    """Keep the checkpoint with the best held-out greedy acceptance in <run_dir>/best: when `ev`
    beats best.json's figure, `export` writes the draft there. Returns the best record so far.

    The figure is the decoding walk's mean acceptance length (`walk_mal`) over the answers' first
    `answer_tokens` tokens where the evaluation walks, else `tau_greedy`. A best.json judged by
    another measure or window (an older run resumed with other evaluation settings) is replaced:
    figures of different measures do not compare."""
    if not ev or not ev.get("blocks"):
        return None
    measure = "walk_mal" if "walk_mal" in ev else "tau_greedy"
    window = answer_tokens if measure == "walk_mal" else 0
    path = Path(run_dir) / (BEST + ".json")
    best = json.loads(path.read_text()) if path.exists() else None
    if (
        best is not None
        and best.get("measure", "tau_greedy") == measure
        and best.get("answer_tokens", 0) == window
        and best[measure] >= ev[measure]
    ):
        return best
    export(Path(run_dir) / BEST)
    best = {
        "step": step,
        "measure": measure,
        "answer_tokens": window,
        "tau_greedy": ev["tau_greedy"],
        "greedy_conditional": ev["greedy_conditional"],
    }
    for key in ("walk_mal", "walk_first_slot"):
        if key in ev:
            best[key] = ev[key]
    path.write_text(json.dumps(best) + "\n")
    return best
