"""Entry points: read any DSpark draft into a checked DraftSpec, and its tensors under normalized names."""

from __future__ import annotations

import errno
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import TypeGuard

from dspark.errors import FormatError
from dspark.formats import deepseek_v4, deepspec, specforge, speculators
from dspark.formats.spec import DraftSpec, Layout, query_slots_for
from dspark.formats.weights import WeightsMeta, check_dtypes, check_finite, check_shapes, check_vocab_maps, iter_tensors

LAYOUTS = ("anchor_first", "bonus_anchor")


def is_layout(name: str) -> TypeGuard[Layout]:
    return name in LAYOUTS


# Most specific first; a file matching two of them is refused (its layout would be a guess).
READERS = (speculators, deepseek_v4, specforge, deepspec)


def load_spec(path, layout: str | None = None, *, check_values: bool = True) -> DraftSpec:
    """Describe the draft at `path` (a directory holding config.json, or a config.json file).

    `layout` overrides the layout decided from the file (experts only; reported as "forced").
    With weights present, tensor names and shapes are checked against the config and, unless
    `check_values` is false, every tensor is read once to refuse NaN/inf.
    """
    directory, config_path = locate(path)
    config = read_config(config_path)
    reader = pick_reader(config)
    weights = None if reader is deepseek_v4 else WeightsMeta.from_dir(directory)
    spec = reader.read(config, weights)
    warnings = list(spec.warnings)
    if weights is None:
        warnings.append(f"no model.safetensors in {directory}: weights not checked")
    else:
        check_shapes(spec, weights)
        if check_values:
            # with the values: `dspark doctor` reads with check_values=False and reports a dtype itself
            check_dtypes(weights)
            for name, tensor in iter_tensors(weights):
                _check_tensor(spec, name, tensor)
    spec = replace(spec, warnings=tuple(warnings), path=str(directory))
    return force_layout(spec, layout) if layout is not None else spec


def load_weights(spec_or_path) -> dict:
    """All draft tensors under the normalized names of docs/DESIGN.md §4 (no `model.` prefix).

    Target-owned copies (verifier_lm_head, verifier_norm) are dropped; NaN/inf and a non-float
    storage of a weight are a FormatError.
    """
    spec = spec_or_path if isinstance(spec_or_path, DraftSpec) else load_spec(spec_or_path, check_values=False)
    if spec.path is None:
        raise FormatError("the draft description has no path: nothing to load weights from")
    meta = WeightsMeta.from_dir(Path(spec.path))
    if meta is None:
        raise FormatError(f"no model.safetensors in {spec.path}")
    check_shapes(spec, meta)
    check_dtypes(meta)  # integer or float8 weights are quantised storage without its scales: never cast them
    tensors = {}
    for name, tensor in iter_tensors(meta):
        _check_tensor(spec, name, tensor)
        tensors[name] = tensor
    return tensors


def _check_tensor(spec: DraftSpec, name: str, tensor) -> None:
    check_finite(name, tensor)
    check_vocab_maps(spec, name, tensor)


# ---------------------------------------------------------------- pieces


def locate(path) -> tuple[Path, Path]:
    """(checkpoint directory, config file)."""
    p = Path(path)
    if p.is_dir():
        config = p / "config.json"
        if not config.is_file():
            raise FormatError(f"no config.json in {p}")
        return p, config
    if p.is_file():
        return p.parent, p
    raise FormatError(_missing(p))


def _missing(p: Path) -> str:
    """Why `p` is neither a directory nor a file, in words a user can act on: a symlink loop and a
    dangling link are not "does not exist" (the name is right there in `ls`)."""
    try:
        p.stat()
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return f"{p} is a symbolic link loop (it, or a link on its path, leads back to itself): fix the link"
        if p.is_symlink():
            return f"{p} is a symbolic link to {os.readlink(p)}, which does not exist"
        if exc.errno == errno.ENOENT:
            return f"{p} does not exist"
        return f"cannot read {p}: {exc.strerror}"
    return f"{p} is neither a directory nor a file"


def read_config(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise FormatError(f"cannot read {path}: {exc}") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FormatError(f"{path}: malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    if not isinstance(config, dict):
        raise FormatError(f"{path}: the top level must be a JSON object, got {type(config).__name__}")
    return config


def pick_reader(config: dict):
    matches = [r for r in READERS if r.detect(config)]
    if len(matches) > 1:
        names = " and ".join(r.FORMAT for r in matches)
        raise FormatError(f"config.json carries the keys of both {names} formats: its layout would be a guess")
    if matches:
        return matches[0]
    dc = config.get("dflash_config")
    if isinstance(dc, dict):
        raise FormatError(
            f"dflash_config.projector_type is {dc.get('projector_type')!r}, not 'dspark': a DFlash draft "
            "(no Markov head) or an unrecognized SpecForge export"
        )
    raise FormatError(
        "not a recognized DSpark draft: no speculators_model_type, no dspark_* keys, no "
        f"dflash_config.projector_type 'dspark', and architectures={config.get('architectures')!r} is not "
        "Qwen3DSparkModel/Gemma4DSparkModel"
    )


def force_layout(spec: DraftSpec, layout: str) -> DraftSpec:
    if not is_layout(layout):
        raise FormatError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    # The draft was built with block_size query rows; only which rows are read changes.
    gamma = spec.block_size if layout == "anchor_first" else spec.block_size - 1
    if gamma < 1:
        raise FormatError(f"layout {layout} with block_size {spec.block_size} proposes no token")
    note = (
        f"layout forced to {layout} (gamma {gamma}); the file reads as {spec.layout} "
        f"({spec.layout_source}): a wrong layout runs and accepts almost nothing"
    )
    return replace(
        spec,
        layout=layout,
        layout_source="forced",
        gamma=gamma,
        query_slots=query_slots_for(layout, gamma),
        warnings=(*spec.warnings, note),
    )
