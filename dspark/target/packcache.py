"""The native runtime's packed weights, kept on disk: computed once per target, request and code.

Packing a target for dspark's kernels recomputes, on every start, what depends only on its files:
the screens that decide its weight format (`quant.resolve_weights`: are the layers exact 4-bit
groups? is the head Q8_0?) and each matrix's packed form (`quant.Linear`: int4 groups recovered
from the float weights, checked exact, packed for the kernel's tile). For SmolLM2 that was 17-21 s
of a warm start on a loaded 2-core VM (docs/BENCHMARKS.md); reading the packed tensors back is one
read of ~100 MB (0.1 s). `PackStore` answers NativeTarget's questions ("this matrix in this format",
"this screen") from one safetensors file under `envs.cache_dir() / "packed"` and computes only what
the file lacks, then rewrites it.

One file per target directory, device and request (weights, dtype), named by their digest; inside,
in the safetensors metadata, the full identity, compared on reading: the target's files (their
sha256, `dspark.doctor.cache.file_digest`, remembered by path, size and mtime), dspark's version,
the packing code's source (`CODE`), torch, transformers and the CPU class. A matrix packed for
dspark's tile is keyed by the kernel build and its activation format as well (`kernels.build_tag`,
`kernels.q4_activations`): a rebuilt extension repacks. A file of other code, kernels or files
is stale (repacked, said at INFO); one that cannot be read, or is another target's, is ignored
with a warning naming it; either is rewritten (atomically).
Float formats are not stored: they are the model's own tensors, converted.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import logging
import os
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
import transformers
from safetensors import SafetensorError
from safetensors.torch import save_file

import dspark
from dspark import envs, kernels, packing
from dspark.doctor.cache import cpu_class, directory_digests
from dspark.errors import DSparkError
from dspark.target import checkpoint, dense, native, quant
from dspark.target.load import resolve_target
from dspark.target.quant import Linear

log = logging.getLogger("dspark")

PACK_FORMAT = "dspark-packed-weights"
PACK_VERSION = 1  # what a file holds and how it is keyed; a change makes every file stale
STORED = ("int4", "int8", "q8_0")  # the formats whose Linear is computed; float ones are converted
# the code whose output is stored: the formats (quant.py), the layers they are fused into and the
# head's choice (NativeTarget's construction), the weights it reads (dense.py, checkpoint.py), the
# tile's layouts (dspark/packing.py's functions, not the whole file: its kernels are named by their
# build) and this file's layout
CODE = (
    Path(__file__).resolve(),
    Path(quant.__file__).resolve(),
    native.NativeTarget.__init__,
    native.NativeTarget._build,
    native.NativeTarget._linear,
    native.NativeTarget._fact,
    dense.fused_weight,
    dense.fused_bias,
    checkpoint.Checkpoint.head,
    packing.pack_bf16,
    packing._group_scales,
    packing.pack_q4,
    packing._octets,
    packing.q8_groups,
    packing.pack_q8,
)
T = TypeVar("T")


# safetensors' dtype names (the ones a Linear holds)
DTYPES = {
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
}


def read_safetensors(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """A safetensors file -> (its metadata, its tensors): one read into one buffer, the tensors
    views of it (64-byte aligned, as torch allocates, or copied to be). DSparkError for a file that
    is not a whole safetensors file (the layout: an 8-byte header length, the JSON header with each
    tensor's dtype, shape and byte range, then the bytes)."""
    size = path.stat().st_size
    buf = torch.empty(size, dtype=torch.uint8)
    with open(path, "rb") as f:
        # into torch's own allocation (64-byte aligned); numpy's view of it is the buffer
        if size < 8 or f.readinto(buf.numpy()) != size:  # type: ignore[arg-type]  # ndarray is a buffer
            raise DSparkError("shorter than its header")
    (n,) = struct.unpack("<Q", buf[:8].numpy().tobytes())
    if 8 + n > size:
        raise DSparkError(f"header of {n} bytes in a file of {size}")
    try:
        header = json.loads(buf[8 : 8 + n].numpy().tobytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DSparkError(f"header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise DSparkError("header is not an object")
    meta, tensors, start = header.pop("__metadata__", None) or {}, {}, 8 + n
    for name, info in header.items():
        try:
            dtype, shape, (a, b) = DTYPES[info["dtype"]], [int(d) for d in info["shape"]], info["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise DSparkError(f"tensor {name!r}: no dtype, shape and byte range ({exc!r})") from None
        item = torch.empty(0, dtype=dtype).element_size()
        nbytes = item
        for d in shape:
            nbytes *= d
        if not (0 <= a <= b <= size - start and b - a == nbytes and (start + a) % item == 0):
            raise DSparkError(f"tensor {name!r}: bytes {a}..{b} do not hold {info['dtype']} {shape}")
        t = buf[start + a : start + b].view(dtype).view(shape)
        tensors[name] = t if t.data_ptr() % 64 == 0 else t.clone()
    return meta, tensors


def source_digest() -> str:
    """sha256 over CODE: files whole, functions by their source."""
    h = hashlib.sha256()
    for c in CODE:
        name, text = (c.name, c.read_text()) if isinstance(c, Path) else (c.__qualname__, inspect.getsource(c))
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()


def _linear_state(lin: Linear) -> tuple[dict, dict[str, torch.Tensor]] | None:
    """A Linear's attributes -> (plain values and tensor names, tensors); None for one holding
    anything else (oneDNN's packed weights: not stored)."""
    attrs: dict = {}
    tensors: dict[str, torch.Tensor] = {}
    for k, v in vars(lin).items():
        if v is None or isinstance(v, (bool, int, float, str)):
            attrs[k] = v
        elif isinstance(v, torch.Tensor) and v.layout == torch.strided and v.device.type == "cpu":
            tensors[k] = v
            attrs[k] = {"tensor": k}
        elif isinstance(v, tuple) and all(isinstance(t, torch.Tensor) and t.layout == torch.strided for t in v):
            names = [f"{k}.{i}" for i in range(len(v))]
            tensors.update(zip(names, v))
            attrs[k] = {"tuple": names}
        else:
            return None
    return attrs, tensors


def _linear_from(attrs: dict, tensor: Callable[[str], torch.Tensor]) -> Linear:
    lin = Linear.__new__(Linear)  # its state as packed, without packing it again
    for k, v in attrs.items():
        if isinstance(v, dict) and "tensor" in v:
            v = tensor(v["tensor"])
        elif isinstance(v, dict) and "tuple" in v:
            v = tuple(tensor(n) for n in v["tuple"])
        elif isinstance(v, (dict, list)):
            raise DSparkError(f"entry attribute {k!r}: {v!r} is neither a value nor a tensor")
        setattr(lin, k, v)
    return lin


class PackStore:
    """What NativeTarget derives from a target's files, answered from the cache file where it holds
    it (`fact`, `linear`), computed and remembered otherwise; `save` rewrites the file when
    anything was computed. One store serves one load (open_target), then is dropped."""

    def __init__(self, target: str, device: str, request: dict):
        self.target, self.device, self.request = target, device, request
        self._identity: dict | None = None
        self._facts: dict[str, object] = {}  # from the file
        self._entries: dict[str, dict] = {}  # key -> a Linear's attributes (tensor names: the file's)
        self._tensors: dict[str, torch.Tensor] = {}  # the file's
        self._used: dict[str, object] = {}  # what this load asked: facts and Linears, in order
        self.read = self.computed = 0

    @property
    def path(self) -> Path:
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(self.target).name or "target")[:60]
        where = {"target": str(resolve_target(self.target).resolve()), "device": self.device, **self.request}
        digest = hashlib.sha256(json.dumps(where, sort_keys=True).encode()).hexdigest()[:20]
        return envs.cache_dir() / "packed" / f"{name}-{self.request.get('weights')}-{digest}.safetensors"

    def identity(self) -> dict:
        if self._identity is None:
            self._identity = {
                "format": PACK_VERSION,
                "target_files": directory_digests(resolve_target(self.target)),
                "device": self.device,
                "request": self.request,
                **cpu_class(),
                "dspark": dspark.__version__,
                "source": source_digest(),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
            }
            self._load()
        return self._identity

    def _load(self) -> None:
        path = self.path
        if not path.exists():
            return
        try:
            header, tensors = read_safetensors(path)
            meta = json.loads(header.get(PACK_FORMAT, "null"))
            if not isinstance(meta, dict) or meta.get("format") != PACK_FORMAT:
                raise DSparkError(f'not a packed-weights file (no "{PACK_FORMAT}" metadata)')
            facts, entries, identity = meta.get("facts"), meta.get("entries"), meta.get("identity")
            if not isinstance(facts, dict) or not isinstance(entries, dict) or not isinstance(identity, dict):
                raise DSparkError('"facts", "entries" and "identity" must be objects')
            names = set(tensors)
            for key, attrs in entries.items():
                held = [v for v in attrs.values() if isinstance(v, dict)] if isinstance(attrs, dict) else None
                if held is None or not all(n in names for v in held for n in v.get("tuple", [v.get("tensor")])):
                    raise DSparkError(f"entry {key!r} names tensors the file does not hold")
        except Exception as exc:  # not safetensors, truncated, not our layout: the start goes on without it
            log.warning("WARNING: ignoring unreadable packed-weights cache %s: %s", path, exc)
            return
        mine = self._identity
        assert mine is not None
        if identity.get("request") != mine["request"] or identity.get("device") != mine["device"]:
            log.warning("WARNING: ignoring packed-weights cache %s: it was written for another target or request", path)
            return
        if identity != mine:
            stale = ", ".join(k for k in sorted(set(identity) | set(mine)) if identity.get(k) != mine.get(k))
            log.info("packed weights in %s are stale (%s changed): packing again", path, stale)
            return
        self._facts, self._entries, self._tensors = facts, entries, tensors

    def fact(self, key: str, compute: Callable[[], T]) -> T:
        """A screen's JSON-able result (a weight format, a bool) of this target's files."""
        self.identity()
        if key in self._facts:
            value = self._facts[key]
        else:
            value = compute()
            self.computed += 1
        self._used[f"fact:{key}"] = value
        return value  # type: ignore[return-value]  # what `compute` returned for this key, then or now

    def linear(self, name: str, fmt: str, act: torch.dtype, ops: str, compute: Callable[[], Linear]) -> Linear:
        """The Linear of matrix `name` in `fmt` for `act` activations (ops: quant.Linear's)."""
        if fmt not in STORED:
            return compute()
        self.identity()
        # a matrix on dspark's tile is the extension's layout: its build and activations name it
        tile = act == torch.bfloat16 and ops == "auto" and self.device.startswith("cpu")
        kern = f"{kernels.build_tag()}/{kernels.q4_activations()}" if tile else "-"
        key = f"{name}|{fmt}|{str(act).removeprefix('torch.')}|{ops}|{kern}"
        lin = None
        if key in self._entries:
            try:
                lin = _linear_from(self._entries[key], self._tensors.__getitem__)
                self.read += 1
            except Exception as exc:
                log.warning("WARNING: ignoring packed-weights cache %s entry %s: %s", self.path, key, exc)
        if lin is None:
            lin = compute()
            self.computed += 1
        self._used[key] = lin
        return lin

    def describe(self) -> str:
        """How the packing went, for the load line."""
        if self.read and not self.computed:
            return f"cached: {self.read} matrices read"
        return f"{self.computed} computed, {self.read} read from the cache" if self.read else ""

    def save(self) -> None:
        """Rewrite the file with what this load used, where anything was computed (or a stored
        Linear could not be); a cache folder that cannot be written costs time, not the start."""
        if not self.computed or self._identity is None:
            self._used.clear()
            self._tensors.clear()
            return
        facts: dict[str, object] = {}
        entries: dict[str, dict] = {}
        tensors: dict[str, torch.Tensor] = {}
        for key, value in self._used.items():
            if key.startswith("fact:"):
                facts[key.removeprefix("fact:")] = value
                continue
            assert isinstance(value, Linear)
            state = _linear_state(value)
            if state is None:
                continue
            attrs, held = state
            prefix = f"e{len(entries)}."
            entries[key] = {
                k: {"tensor": prefix + v["tensor"]}
                if isinstance(v, dict) and "tensor" in v
                else {"tuple": [prefix + n for n in v["tuple"]]}
                if isinstance(v, dict)
                else v
                for k, v in attrs.items()
            }
            tensors.update({prefix + n: t.contiguous() for n, t in held.items()})
        meta = {"format": PACK_FORMAT, "identity": self._identity, "facts": facts, "entries": entries}
        path = self.path
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(tmp), metadata={PACK_FORMAT: json.dumps(meta)})
            os.replace(tmp, path)
        except (OSError, RuntimeError, ValueError, SafetensorError) as exc:
            log.warning("WARNING: could not write the packed-weights cache %s: %s", path, exc)
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
        finally:
            self._used.clear()
            self._tensors.clear()
