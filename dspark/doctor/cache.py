"""The load-time check (`quick.quick_check`), computed once per target, draft, runtime and machine.

The check costs about as much as decoding a few hundred tokens (~25 s on a slow CPU) and its
result depends only on what it reads: the target's and the draft's files, how they run (runtime,
weight formats, dtype and activations, dspark's kernels and the CPU class they were built for),
dspark's version and the doctor's own code. `load_time_check` keys a small JSON file under
`envs.cache_dir()` by all of these, the way `dspark.engine.costs` caches the cost curve
(`<draft>-<dtype>-<digest>.json`, the full identity inside and compared on reading, written
atomically), and measures only when no file matches. What `dspark.api.build_engine` reads from
the result is kept: the warnings and the drafts accepted at each anchor (`QuickCheck`). The
drafting phase's own timing is not cached: it takes milliseconds (a target step and two drafting
phases, ~0.4 s on a loaded 2-core VM), and it prices what the machine does now.

Not in the key: the thread count. dspark's kernels compute each row in an order that does not
depend on how rows are split (docs/DESIGN.md §10), and elsewhere a changed reduction order moves
the statistic by a near-tie at most; the result is a sample's statistic, not an exact figure.

Files are identified by their content (sha256). Hashing a large file takes a while (SmolLM2's fp32
copy: 540 MB), so the digest of a file over HASH_MEMO_BYTES is itself kept, by (path, size,
mtime), and read back while those three match.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

import dspark
from dspark import envs, kernels, progress
from dspark.doctor import quick
from dspark.doctor.quick import QuickCheck
from dspark.errors import DSparkError
from dspark.jsonfile import read_json, write_json
from dspark.model import fast as fast_draft
from dspark.target.load import cpu_bf16_feature, cpu_model_and_flags, resolve_target

log = logging.getLogger("dspark")

CHECK_FORMAT = "dspark-draft-check"
HASH_FORMAT = "dspark-file-hash"
# what a check file holds and how its identity is made; a change is a new identity (stale files unused)
CHECK_VERSION = 1
HASH_MEMO_BYTES = 1 << 20  # files larger than this have their digest kept (file_digest)
# the files of a model or draft directory the result can depend on: config, weights, tokenizer, template
MODEL_SUFFIXES = (".json", ".safetensors", ".bin", ".pt", ".pth", ".model", ".txt", ".jinja", ".tiktoken")
DOCTOR = Path(__file__).parent  # the doctor package, whose code is the check (source_digest)


@dataclass
class LoadTimeCheck:
    """The check's result, and where it came from: `seconds` is what measuring it took (then, when
    it was read from `cached`)."""

    check: QuickCheck
    seconds: float
    cached: Path | None = None  # the file it was read from; None: measured in this process

    def describe(self) -> str:
        """The start-up line that ends the step: what the check cost, or that it was cached."""
        how = (
            f"cached ({self.cached}; measured in {self.seconds:.1f} s)"
            if self.cached is not None
            else f"{self.seconds:.1f} s"
        )
        return f"load-time draft check: {how} (disable: --no-check, check=False)"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _memo_path(path: Path) -> Path:
    key = hashlib.sha256(str(path).encode()).hexdigest()[:20]
    return envs.cache_dir() / "file-hashes" / f"{re.sub(r'[^A-Za-z0-9._-]+', '_', path.name)[:60]}-{key}.json"


def file_digest(path: str | Path) -> str:
    """sha256 of a file's content. Over HASH_MEMO_BYTES the digest is kept under the cache folder
    and reused while the file's resolved path, size and modification time are those it was
    computed for (a memo that cannot be read is ignored with a warning, and rewritten)."""
    path = Path(path).resolve()
    st = path.stat()
    if st.st_size <= HASH_MEMO_BYTES:
        return _sha256(path)
    stamp = {"format": HASH_FORMAT, "path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    memo = _memo_path(path)
    if memo.exists():
        try:
            data = _read(memo, "file hash")
            if not isinstance(data, dict) or data.get("format") != HASH_FORMAT:
                raise DSparkError(f'not a file hash (expected "format": "{HASH_FORMAT}")')
            digest = data.get("sha256")
            if {k: data.get(k) for k in stamp} == stamp and isinstance(digest, str) and len(digest) == 64:
                return digest
        except DSparkError as exc:
            log.warning("WARNING: ignoring unreadable file hash cache %s: %s", memo, exc)
    digest = _sha256(path)
    _write(memo, {**stamp, "sha256": digest}, "file hash")
    return digest


def _read(path: Path, what: str):
    """A cache file's JSON; DSparkError for one that cannot be read (not JSON, not text, not a file)."""
    try:
        return read_json(path, what)
    except (OSError, UnicodeDecodeError) as exc:
        raise DSparkError(f"{what} file {path} cannot be read ({type(exc).__name__}: {exc})") from None


def _write(path: Path, data: dict, what: str) -> None:
    """A cache file written, or a warning: a cache folder that cannot be written costs time, not the start."""
    try:
        write_json(path, data)
    except OSError as exc:
        log.warning("WARNING: could not write the %s cache %s: %s", what, path, exc)


def directory_digests(path: str | Path) -> dict[str, str]:
    """{file name: sha256} for the files of a model or draft directory that its loading reads
    (MODEL_SUFFIXES, top level, hidden files skipped); symlinks are followed to their content."""
    path = Path(path)
    files = sorted(
        p for p in path.iterdir() if p.suffix in MODEL_SUFFIXES and not p.name.startswith(".") and p.is_file()
    )
    if not files:
        raise DSparkError(f"draft check cache: no model files in {path}")
    return {p.name: file_digest(p) for p in files}


def source_digest() -> str:
    """sha256 over the doctor's sources (this package: the statistic, its thresholds, the texts, the
    budget): a working tree's check changes without dspark's version. The rest of the code computes
    the model the check measures, which the files, formats, kernels and versions already name; a
    digest of all of it would make every edit anywhere cost a check at the next start."""
    h = hashlib.sha256()
    for p in sorted(DOCTOR.rglob("*.py")):
        h.update(str(p.relative_to(DOCTOR)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def cpu_class() -> dict:
    """What the CPU is, as far as the numbers computed on it go: its model name and the bf16
    feature that makes bf16 native (dspark's kernel build for it: `kernel_identity`)."""
    return {"cpu": cpu_model_and_flags()[0], "bf16_feature": cpu_bf16_feature()}


def kernel_identity(device: str) -> dict:
    """dspark's CPU kernels as they run for a CPU engine: the build (ISA, a hash of its sources
    and flags) and what its int4 / Q8_0 matmuls do with their activations. Not asked of other
    devices (asking would build the extension)."""
    if not device.startswith("cpu"):
        return {"isa": None, "kernels": None, "activations": None}
    return {"isa": kernels.extension_isa(), "kernels": kernels.build_tag(), "activations": kernels.q4_activations()}


def check_identity(engine) -> dict:
    """Everything the load-time check's result depends on (engine: built by dspark.api, with its
    resolved `config`): the files, how they run, the machine, the code."""
    config, target, draft = engine.config, engine.target, engine.draft
    if config is None or config.draft is None or draft is None:
        raise DSparkError("draft check cache: the engine has no resolved config with a draft")
    device = str(target.device)
    return {
        "format": CHECK_VERSION,
        # the names make the file's name and say what it is for; the files' content is what is checked
        "target": Path(config.target).name,
        "target_files": directory_digests(resolve_target(config.target)),
        "draft": Path(config.draft).name,
        "draft_files": directory_digests(config.draft),
        "layout": config.layout,  # a forced layout is another reading of the same files
        "runtime": type(target).__name__,
        "weights": getattr(target, "weights", None),
        "head": getattr(target, "head_format", None),
        "dtype": str(target.dtype).replace("torch.", ""),
        "device": device,
        "gpu": torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else None,
        "draft_weights": config.draft_weights,
        "draft_runs": fast_draft.describe(draft),  # how the drafting phase runs: kernels or modules, formats
        **kernel_identity(device),
        **cpu_class(),
        "dspark": dspark.__version__,
        "doctor_source": source_digest(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "budget": repr(quick.QUICK_BUDGET),
    }


def cache_path(identity: dict) -> Path:
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", identity["draft"] or "draft")[:60]
    return envs.cache_dir() / "draft-checks" / f"{name}-{identity['dtype']}-{digest}.json"


def to_json(check: QuickCheck, seconds: float, identity: dict) -> dict:
    accepted = None if check.accepted is None else [int(a) for a in check.accepted.tolist()]
    return {
        "format": CHECK_FORMAT,
        "identity": identity,
        "warnings": list(check.warnings),
        "accepted": accepted,
        "seconds": round(seconds, 3),
    }


def from_json(data, identity: dict) -> tuple[QuickCheck, float]:
    """-> (the check, the seconds measuring it took); DSparkError naming what is wrong for a file
    that is not a check of this identity."""
    if not isinstance(data, dict) or data.get("format") != CHECK_FORMAT:
        raise DSparkError(f'not a draft check file (expected "format": "{CHECK_FORMAT}")')
    if data.get("identity") != identity:
        raise DSparkError("it was written for another target, draft, runtime or machine (identity differs)")
    warnings, accepted, seconds = data.get("warnings"), data.get("accepted"), data.get("seconds")
    if not isinstance(warnings, list) or not all(isinstance(w, str) for w in warnings):
        raise DSparkError('"warnings" must be a list of strings')
    if accepted is not None and (
        not isinstance(accepted, list) or not accepted or not all(type(a) is int and a >= 0 for a in accepted)
    ):
        raise DSparkError('"accepted" must be null or a non-empty list of non-negative integers')
    if not isinstance(seconds, (int, float)) or seconds < 0:
        raise DSparkError('"seconds" must be a non-negative number')
    tensor = None if accepted is None else torch.tensor(accepted, dtype=torch.long)
    return QuickCheck(list(warnings), tensor), float(seconds)


def load_time_check(engine) -> LoadTimeCheck:
    """The load-time check of `engine`'s draft: read from the cache file of its identity
    (`check_identity`) when there is one, else measured (`quick.quick_check`, with a start-up line
    before it) and written there. A file that cannot be read, or holds another identity, is
    ignored with a warning naming it, and rewritten."""
    identity = check_identity(engine)
    path = cache_path(identity)
    if path.exists():
        try:
            check, seconds = from_json(_read(path, "draft check"), identity)
            return LoadTimeCheck(check, seconds, cached=path)
        except DSparkError as exc:
            log.warning("WARNING: ignoring draft check cache %s: %s", path, exc)
    # the end line, with the time, is build_engine's ("load-time draft check: 24.1 s ...")
    progress.started(
        "checking the draft at load time (once per target, draft and machine; about as long as decoding "
        "a few hundred tokens)"
    )
    t0 = time.perf_counter()
    check = quick.quick_check(engine)
    seconds = time.perf_counter() - t0
    _write(path, to_json(check, seconds, identity), "draft check")
    return LoadTimeCheck(check, seconds)
