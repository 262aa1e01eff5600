"""Write a trained draft as a speculators or DeepSpec checkpoint (bf16, target weights left out).

Writing goes through dspark.formats.convert (the one writer of both families); the result is
read back with dspark.formats.load and must describe the draft that was trained (layout,
gamma, taps, mask token): an export that an engine would misread is an error here, not there.
embed_tokens / lm_head are the target's own and are borrowed at load time, never saved (a reduced
vocabulary's lm_head rows and d2t/t2d are saved: they cannot be borrowed).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TypedDict

import torch
from transformers import AutoConfig

from dspark.formats.convert import write_deepspec, write_speculators
from dspark.formats.load import load_spec
from dspark.target.load import resolve_target
from dspark.train.config import draft_spec
from dspark.train.errors import TrainError
from dspark.train.features import fold_tap_scale
from dspark.train.rundir import load_state, read_run_config
from dspark.train.vocab import t2d_mask

HUB_IDS = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}


class Verifier(TypedDict):
    """The verifier a speculators config records."""

    name_or_path: str
    architectures: list[str]


def default_verifier(target: str, target_config) -> Verifier:
    """The verifier recorded in speculators configs: hub id for bundled targets, else the path given."""
    if target in HUB_IDS:
        name = HUB_IDS[target]
    elif Path(target).exists():
        name = str(Path(target).resolve())
    else:
        name = target
    return {"name_or_path": name, "architectures": list(getattr(target_config, "architectures", None) or [])}


def checkpoint_tensors(
    state: dict[str, torch.Tensor], vocab_size: int, tap_scale: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Trained weights -> the file's tensors: bf16 floats; fc reading raw taps when training read
    taps / tap_scale (features.tap_scale); a reduced vocabulary's d2t with its t2d mask, as
    speculators/EAGLE-3 files carry both."""
    state = dict(state)
    if tap_scale is not None:
        state["fc.weight"] = fold_tap_scale(state["fc.weight"].detach().cpu(), tap_scale)
    out = {
        k: v.detach().to("cpu", torch.bfloat16 if v.is_floating_point() else v.dtype).contiguous()
        for k, v in state.items()
    }
    if "d2t" in out:
        d2t = out["d2t"]
        out["t2d"] = t2d_mask(d2t + torch.arange(d2t.numel()), vocab_size)
    return out


def write_draft(spec, tensors: dict, dst, fmt: str, verifier=None, *, replace: bool = False) -> Path:
    """Write to `dst` through a temporary sibling; `replace` lets a run refresh its own export."""
    if fmt == "deepspec" and spec.layout != "anchor_first":
        raise TrainError(f"a {spec.layout} draft cannot be written as DeepSpec (anchor-first only): use speculators")
    dst = Path(dst)
    if dst.exists() and not replace and (not dst.is_dir() or any(dst.iterdir())):
        raise TrainError(f"{dst} exists and is not empty: choose another --out")
    tmp = dst.with_name(dst.name + ".writing")
    shutil.rmtree(tmp, ignore_errors=True)
    if fmt == "speculators":
        write_speculators(spec, tensors, tmp, verifier=verifier)
    elif fmt == "deepspec":
        write_deepspec(spec, tensors, tmp)
    else:
        raise TrainError(f"export format must be speculators or deepspec, got {fmt!r}")
    check_written(spec, tmp, fmt)
    if dst.exists():
        shutil.rmtree(dst)
    tmp.rename(dst)
    return dst


def check_written(spec, path: Path, fmt: str) -> None:
    back = load_spec(path)
    for name in (
        "layout",
        "gamma",
        "query_slots",
        "hidden_state_indices",
        "mask_token_id",
        "markov_rank",
        "markov_head_type",
        "confidence_head",
        "num_layers",
    ):
        if getattr(back, name) != getattr(spec, name):
            raise TrainError(
                f"exported {fmt} draft reads back with {name}={getattr(back, name)!r}, trained {getattr(spec, name)!r}"
            )
    if fmt == "speculators":
        cfg = json.loads((path / "config.json").read_text())
        methods = cfg["speculators_config"]["proposal_methods"]
        if not isinstance(cfg.get("sample_from_anchor"), bool) or methods[0]["speculative_tokens"] != spec.gamma:
            raise TrainError(
                "exported speculators config lacks an explicit sample_from_anchor or has wrong speculative_tokens"
            )


def size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors")) / 2**20


def export_run(run_dir, dst, fmt: str | None = None, verifier: str | None = None) -> Path:
    """Export the latest checkpoint of a training run directory."""
    run_dir = Path(run_dir)
    cfg = read_run_config(run_dir)
    state = load_state(run_dir)
    target_config = AutoConfig.from_pretrained(resolve_target(cfg.target))
    ver: Verifier = (
        {"name_or_path": verifier, "architectures": list(target_config.architectures or [])}
        if verifier
        else default_verifier(cfg.target, target_config)
    )
    spec = draft_spec(cfg, target_config, verifier=ver["name_or_path"])
    tensors = checkpoint_tensors(state["draft"], spec.vocab_size, state.get("tap_scale"))
    return write_draft(spec, tensors, dst, fmt or cfg.export_format, ver)
