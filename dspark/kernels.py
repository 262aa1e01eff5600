"""dspark's compiled CPU extension: which build this CPU takes, compiling and loading it, and the
format of its matmuls' activations. The weights' layouts are in `dspark.packing`, the ops the
runtimes call in `dspark.ops`, huge pages in `dspark.hugepages`.

int4 weights on a CPU with AVX512-BF16 or AVX2 run through dspark's own kernel (`csrc/q4_avx512.cpp`,
`csrc/q4_avx2.cpp`; any other CPU: the generic build's plain C++, `csrc/q4_generic.cpp`), compiled
on first use (~1-2 min, once per machine and source version, cached
under `~/.cache/dspark`): torch's `_weight_int4pack_mm_for_cpu` unpacks every weight once per row;
the dspark kernel unpacks once per call (docs/history/benchmarks.md "dspark's own int4 kernel"; its
AVX2 variant, 8 fp32 lanes and FMAs: "a matmul tile for AVX2 CPUs"; there int4 and Q8_0 weights
take 8-bit activations, `q4_activations`, "8-bit activations for the AVX2 build's int4 and Q8_0
matmuls"). The same extension fuses the native runtime's RMSNorms (and the residual add before
each) for bf16 activations, with torch's bits (`csrc/norm.cpp`), and runs attention by position
(`csrc/attn.cpp`). Where it cannot be compiled, torch's ops run and `q4_status()` says why.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from pathlib import Path

import torch

from dspark import envs
from dspark.errors import DSparkError
from dspark.outlock import shared_build

log = logging.getLogger("dspark")


# ---- dspark's compiled CPU extension: int4 / Q8_0 matmuls, norms, attention -----------------
# which build runs (or none) is EngineConfig.kernels (choose_kernels), once a process
# one extension of separate translation units (csrc/dspark.h declares what they share): the ISA's
# matmul files (ISAS) and these, which compile for either ISA; bindings.cpp is the Python module
CSRC = Path(__file__).parent / "csrc"
SOURCES = (
    "norm.cpp",
    "attn.cpp",
    "attn_prefill.cpp",
    "rope.cpp",
    "markov.cpp",
    "sample.cpp",
    "layers.cpp",
    "draft.cpp",
    "bindings.cpp",
)
# what each build needs from /proc/cpuinfo, and its flags; at::parallel_for is OpenMP in torch's CPU
# builds, and an extension built without -fopenmp runs it on one thread
ISAS = {
    "avx512": (
        ("avx512f", "avx512bw", "avx512_bf16"),
        # -mamx-*: the prefill's attention tiles (csrc/amx.h), run only where CPUID and the OS allow them
        (
            "-O3",
            "-fopenmp",
            "-mavx512f",
            "-mavx512bw",
            "-mavx512vl",
            "-mavx512bf16",
            "-mfma",
            "-mamx-tile",
            "-mamx-bf16",
        ),
        ("q4_avx512.cpp", "q4_avx512_vnni.cpp"),  # the second holds code only in the int8 build
    ),
    "avx2": (
        ("avx2", "fma", "f16c"),
        ("-O3", "-fopenmp", "-mavx2", "-mfma", "-mf16c"),
        ("q4_avx2.cpp",),
    ),  # 8-lane matmuls, norms, attention
    # plain C++ (csrc/simd.h's and vec.h's arrays of 8 floats, the matmuls one value at a time): it
    # compiles for any CPU, with the AVX2 build's layouts and bits; run where asked for (--kernels
    # generic), since on a CPU without AVX2 it is not measured against torch's own kernels yet
    "generic": ((), ("-O3", "-fopenmp"), ("q4_generic.cpp",)),
}
# what the AVX-512 build's 8-bit activations need beyond the build (csrc/q4_avx512_vnni.cpp: vpdpbusd),
# and the flags they add to it
INT8_AVX512 = ("avx512_vnni",), ("-mavx512vnni", "-DDSPARK_ACT8=1")


def sources(isa: str) -> list[Path]:
    """The files an ISA's build compiles, one translation unit each."""
    return [*(CSRC / f for f in ISAS[isa][2]), *(CSRC / f for f in SOURCES)]


_build: dict = {}  # "ext": the compiled module or None, "isa": its build, "why": what runs instead and why
# which of dspark's kernels run (EngineConfig.kernels): auto (the best this CPU has), amx (the AVX-512
# build with its AMX tiles: a prefill's attention, and its matmuls of 64+ rows in bf16 through
# torch's oneDNN), avx512 (the same build, no AMX tiles), avx2 (the 8-lane build), generic (plain C++,
# any CPU), torch (none: torch's ops everywhere). Each computes its own numbers, so it is chosen once a
# process, before the extension loads (choose_kernels); the other names are there to compare and diagnose
KERNELS = ("auto", "amx", "avx512", "avx2", "generic", "torch")
# the ISAS build each named one runs
BUILD_OF = {"amx": "avx512", "avx512": "avx512", "avx2": "avx2", "generic": "generic"}
AMX_FLAGS = ("amx_bf16", "amx_tile")  # what the tiles need beyond the AVX-512 build (csrc/amx.h)
_kernels = "auto"
# the int4 / Q8_0 matmuls' activations (EngineConfig.activations): auto | int8 | bf16; a build's
# choice, so it is made once a process, before the extension loads (choose_activations)
ACTIVATIONS = ("auto", "int8", "bf16")
_activations = "auto"


# CPU flags that mark the class whose AVX-512 build runs faster on 8-bit activations than on bf16 at
# every row count (Intel Xeon, Sapphire / Emerald Rapids: its AMX is the marker, the tile used is
# AVX512-VNNI's vpdpbusd; docs/BENCHMARKS.md "Current results, per CPU class")
INT8_CLASS = ("amx_int8", "avx512_vnni")


def int8_by_default() -> bool:
    """Does `auto` give the AVX-512 build 8-bit activations on this CPU? Measured by class: on Intel
    Xeon with AMX (Sapphire / Emerald Rapids) vdpbf16ps is the slow path, and 8-bit activations on
    vpdpbusd make every forward faster there, the 1-token step, a verify and prefill alike; on AMD
    Zen 4 they made the 1-token step slower, so bf16 stays there (and on any class not measured;
    docs/BENCHMARKS.md, "Current results, per CPU class")."""
    flags = cpu_flags()
    return all(f in flags for f in INT8_CLASS)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's flags (/proc/cpuinfo, read once a process), empty where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _isa() -> tuple[str | None, str]:
    """The build this CPU takes ('avx512' | 'avx2' | 'generic' | None) and, when not the full one, why."""
    flags = cpu_flags()
    forced = BUILD_OF.get(_kernels)
    for isa, (need, _, _) in ISAS.items():
        if isa == "generic" and forced != "generic":
            continue  # asked for by name only: not measured against torch's own kernels where AVX2 is missing
        if forced in (None, isa) and all(f in flags for f in need):
            wanted = ISAS["avx512"][0] + (ISAS["avx2"][0] if isa == "generic" else ())
            lacking = [f for f in wanted if f not in flags]
            why = f"this CPU lacks {', '.join(lacking)}" if lacking else f"kernels {_kernels}"
            return isa, "" if isa == "avx512" else why
    return None, f"this CPU lacks {', '.join(f for f in ISAS['avx2'][0] if f not in flags) or 'the asked-for ISA'}"


def _planned_build() -> tuple[str | None, str]:
    """The build `extension` makes here and, when not the full one, why (`_isa`, or none at all
    where the kernels asked for are torch's)."""
    return (None, "kernels torch") if _kernels == "torch" else _isa()


def check_kernels(mode: str) -> None:
    """A name `choose_kernels` knows, or an error listing them."""
    if mode not in KERNELS:
        raise DSparkError(f"kernels must be one of {', '.join(KERNELS)}, got {mode!r}")


def chosen_kernels() -> str:
    """What runs here by `choose_kernels`' names: amx, avx512, avx2 or torch."""
    isa = extension_isa()
    if isa == "avx512" and amx_tiles():
        return "amx"
    return isa or "torch"


def choose_kernels(mode: str) -> None:
    """Which of dspark's kernels this process runs (KERNELS). The build and its AMX tiles are
    settled when the extension first loads, so the choice is made before; asking for another one
    after that, or for one this CPU cannot run, is an error naming what runs and why."""
    global _kernels
    check_kernels(mode)
    if mode == "auto":
        return
    if "ext" in _build:
        have = chosen_kernels()
        if have != mode:
            raise DSparkError(
                f"kernels {mode} asked for, but this process already runs {have}"
                + (f" ({_build['why']})" if _build["why"] else "")
                + ": dspark's kernels are chosen once a process, when they first load "
                "(start a new process for the other)"
            )
        return
    if mode in BUILD_OF:
        need = ISAS[BUILD_OF[mode]][0] + (AMX_FLAGS if mode == "amx" else ())
        lacking = [f for f in need if f not in cpu_flags()]
        if lacking:
            raise DSparkError(f"kernels {mode} need {', '.join(lacking)}, which this CPU lacks: pass --kernels auto")
    _kernels = mode
    if mode == "amx":  # the CPU has the tiles; whether the OS lets this process use them, the build says
        ext = extension()
        kind = ext.attn_prefill_kind() if ext is not None else f"no dspark kernel ({_build['why']})"
        if kind != "amx-bf16":
            raise DSparkError(f"kernels amx asked for, but this process cannot run AMX tiles: {kind}")


def extension():
    """dspark's compiled CPU extension (`q4_mm` and `q8_mm` on AVX512-BF16 builds, `rms_bf16`,
    `add_rms_bf16`, `attn_bf16`, `rope_cache_bf16`, `markov_walk`), or None where it cannot
    run here."""
    if "ext" in _build:
        return _build["ext"]
    isa, why = _planned_build()
    _build.update(ext=None, isa=isa, why=why)
    if isa is not None:
        # the int4 and Q8_0 matmuls' activations (q4_activations): the AVX2 build's are 8-bit unless
        # asked not to, the AVX-512 build's 8-bit where asked for (choose_activations checked the CPU)
        # or, left to auto, on the CPU class where they are the faster ones (`int8_by_default`)
        if isa == "generic":  # 8-bit activations only (its matmuls are the AVX2 build's default ones)
            int8 = True
        elif isa == "avx2":
            int8 = _activations != "bf16"
        else:
            int8 = _activations == "int8" or (_activations == "auto" and int8_by_default())
        cflags = ISAS[isa][1]
        if isa == "avx2" and not int8:
            cflags += ("-DDSPARK_ACT8=0",)
        elif isa == "avx512" and int8:
            cflags += INT8_AVX512[1]
        files = sources(isa)
        _build["int8"] = int8
        # every file the build reads, headers included, names it: a change to any is a new build
        text = [(f.name, f.read_text()) for f in sorted([*files, *CSRC.glob("*.h")])]
        tag = hashlib.sha1(repr((text, torch.__version__, cflags)).encode()).hexdigest()[:12]
        name = f"dspark_{isa}_{tag}"
        root = envs.kernel_cache_dir() / name
        fresh = not (root / f"{name}.so").exists()
        if fresh:
            log.warning("compiling dspark's CPU kernels (%s, once per machine, a minute or two)", isa)
        t0 = time.perf_counter()
        try:
            from torch.utils.cpp_extension import load

            root.mkdir(parents=True, exist_ok=True)
            with shared_build(root, "dspark's CPU kernels"):  # a build stopped midway never hangs the next
                _build["ext"] = load(
                    name,
                    sources=[str(f) for f in files],
                    extra_include_paths=[str(CSRC)],
                    build_directory=str(root),
                    extra_cflags=list(cflags),
                    extra_ldflags=["-fopenmp"],
                )
        except Exception as e:  # no compiler, no ninja, a failed build, no cache folder: torch's ops still work
            _build.update(
                isa=None,
                why=f"dspark's kernels did not compile ({type(e).__name__}: {str(e).strip().splitlines()[-1][:200]})",
            )
        else:
            if fresh:
                log.warning("dspark's CPU kernels compiled in %.0f s (cached in %s)", time.perf_counter() - t0, root)
            if isa == "avx512" and _amx_off():  # the build without its tiles, before any kernel runs
                _build["ext"].amx_off()
    return _build["ext"]


def build_tag() -> str | None:
    """The extension's build (its ISA and a hash of its sources; "-noamx" where the AVX-512 build runs
    without its AMX tiles), None where it does not run: a measurement of a forward (the cost curve)
    made with other kernels is stale."""
    ext = extension()
    if ext is None:
        return None
    return ext.__name__ + ("-noamx" if _amx_off() else "")


def _amx_off() -> bool:
    """Are the AVX-512 build's AMX tiles switched off here (`kernels avx512` on a CPU that has them)?"""
    return _kernels == "avx512" and AMX_FLAGS[0] in cpu_flags()


def amx_tiles() -> bool:
    """Does this process run AMX tiles (the AVX-512 build on a CPU with AMX-BF16, not switched off by
    `kernels avx512`)? The extension's own check (CPUID and the OS's permission) says whether they
    actually run: `attn_prefill_kind`."""
    return extension_isa() == "avx512" and AMX_FLAGS[0] in cpu_flags() and not _amx_off()


def why_unavailable() -> str:
    """Why the extension does not run here ('' where it does)."""
    extension()
    return _build["why"]


TILES = {"avx512": "dspark AVX512-BF16", "avx2": "dspark AVX2", "generic": "dspark generic C++"}  # each build's matmuls


def tile_name() -> str | None:
    """The matmul tile that runs here ('dspark AVX512-BF16' | 'dspark AVX2'), None without one."""
    extension()
    return TILES.get(_build["isa"])


def q4_activations() -> str | None:
    """What dspark's int4 and Q8_0 matmuls do with their bf16 activations here: 'bf16' (take them
    as they are) or 'int8' (quantise them per group of 32); None without the tile.

    By build (docs/history/benchmarks.md "8-bit activations for the AVX2 build's int4 and Q8_0
    matmuls"). AVX2: each row's groups of 32 inputs quantised to 8 bits (s = max|x| / 127, xq =
    round(x / s), the rule llama.cpp uses against Q4_1 and Q8_0 weights) and summed exactly in
    integers: faster at every row count than on bf16 activations (FMAs, one broadcast each);
    `activations="bf16"` (`choose_activations`) builds it with bf16 ones (its own cached build),
    closer to the Q4_1 model (a smaller KL a token) at the speed the AVX2 tile had before. AVX-512:
    bf16 unless asked otherwise. There `activations="int8"`, on a CPU with AVX512-VNNI, builds the
    same 8-bit scheme on vpdpbusd (csrc/q4_avx512_vnni.cpp, 64 multiply-adds an instruction against
    vdpbf16ps's 32; its own cached build, the AVX2 build's rule and steps): it makes verifies of 4-8
    tokens cheaper, where the bf16 dot products bound the tile, but not a 1- or 2-token step, which
    streams its weights (docs/BENCHMARKS.md, Zen 4; docs/history/benchmarks.md "the floors,
    measured"), and 1 row is what plain decoding runs; so `auto` keeps bf16 there, the model nearer
    the fp32 one. On Intel Xeon with AMX (Sapphire / Emerald Rapids) the same 8-bit tile is faster
    at every row count, one included, so `auto` takes it there
    (`int8_by_default`). Either is the target model of its build:
    verification is lossless against it, and its products are checked against the quantised model
    (tests/test_cpu_kernels.py). bf16 weights always take bf16 activations."""
    extension()
    return None if _build["isa"] is None else "int8" if _build.get("int8") else "bf16"


def check_activations(mode: str) -> None:
    """A name `choose_activations` knows, or an error listing them."""
    if mode not in ACTIVATIONS:
        raise DSparkError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {mode!r}")


def choose_activations(mode: str) -> None:
    """The activations dspark's int4 and Q8_0 matmuls take in this process (`q4_activations`):
    'auto' (the build's default: 8-bit on AVX2 and on Intel Xeon with AMX, bf16 on other AVX-512
    CPUs: `int8_by_default`), 'int8' (the AVX2 build, or the
    AVX-512 one where the CPU has AVX512-VNNI) or 'bf16'. The choice is
    the extension's build, so it is made before the kernels first load; asking for the other one
    after that, or for one this CPU's build does not have, is an error naming both."""
    global _activations
    check_activations(mode)
    if mode == "auto":
        return
    if "ext" in _build:
        have = q4_activations()
        if have != mode:
            raise DSparkError(
                f"activations {mode} asked for, but this process's kernels already run "
                f"{have or 'no dspark kernel (' + _build['why'] + ')'}: the activation format is chosen "
                "once a process, when the kernels first load (start a new process for the other)"
            )
        return
    isa, why = _planned_build()
    if mode == "int8" and isa is None:
        raise DSparkError(f"activations int8 name dspark's int4 / Q8_0 kernels, and none runs here ({why})")
    lacking = [f for f in INT8_AVX512[0] if f not in cpu_flags()]
    if mode == "int8" and isa == "avx512" and lacking:
        raise DSparkError(
            f"activations int8: the AVX-512 build's 8-bit matmuls need {', '.join(lacking)} (vpdpbusd), "
            "which this CPU lacks; it takes bf16 ones"
        )
    if mode == "bf16" and isa is None:
        raise DSparkError(f"activations bf16 name dspark's int4 / Q8_0 kernels, and none runs here ({why})")
    if mode == "bf16" and isa == "generic":
        raise DSparkError(
            "activations bf16: the generic build's int4 / Q8_0 matmuls take 8-bit activations only "
            f"({why or 'kernels generic'}); leave --activations at auto or int8"
        )
    _activations = mode


def q4_note() -> str:
    """', 8-bit activations' where dspark's int4 kernel quantises its inputs (q4_activations), else
    '': what a description of the runtime adds."""
    return ", 8-bit activations" if q4_activations() == "int8" else ""


def q4_status() -> str:
    """Which int4 kernel runs here, and why."""
    return tile_name() or f"torch ({_build['why']})"


def extension_isa() -> str | None:
    """The build of dspark's extension that runs here ('avx512' | 'avx2'), or None."""
    extension()
    return _build["isa"]
