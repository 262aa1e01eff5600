"""CPU matmul kernels chosen by measurement (docs/history/benchmarks.md, "Target runtimes").

bf16 weights on a CPU run through a packed linear instead of `F.linear`: oneDNN's prepacked one
(measured on Zen 4, AVX512-BF16: 1.3-1.8x faster at 1-8 rows on SmolLM2's shapes, the same numbers
bit for bit there), and where dspark's extension is built, its own kernel for all but the largest
weights (`BF16_KERNEL_MAX`: another 2-5x at the row counts of decoding). The target's native runtime
and the draft (inference only) both use it.

Greedy choices (`argmax`) widen bf16 logits to fp32 first: exact (every bf16 value is an fp32
value, and ties still go to the first index), and torch's CPU argmax runs 3-4x faster on fp32
(measured on Zen 4, one thread: 214 -> 50 us over SmolLM2's 49 152 logits, 1.4 -> 0.44 ms for an
8-token verify, 61 -> 19 us over the draft's 16 384). The AVX-512 build's own argmax (two vector
passes: the maximum, then its first index; the first NaN where there is one, as torch) takes
21 us for 3 x 49 152 fp32 logits against torch's 150 (2 threads), and reads bf16 logits as they
are (a greedy plain step's head output, argmax'd in the layer stack's own call: docs/history/benchmarks.md
"a greedy plain step in one call").

int4 weights on a CPU with AVX512-BF16 or AVX2 run through dspark's own kernel (`csrc/q4_avx512.cpp`,
`csrc/q4_avx2.cpp`), compiled on first use (~1-2 min, once per machine and source version, cached under
`~/.cache/dspark`): torch's `_weight_int4pack_mm_for_cpu` unpacks every weight once per row, so
an 8-token verify costs 3.4-4x a 1-token step; the dspark kernel unpacks once per call
(docs/history/benchmarks.md "dspark's own int4 kernel"; its AVX2 variant, 8 fp32 lanes and FMAs:
"a matmul tile for AVX2 CPUs"; there int4 and Q8_0 weights take 8-bit activations, `q4_activations`,
"8-bit activations for the AVX2 build's int4 and Q8_0 matmuls"). Group scales and minimums that
are all fp16 numbers (GGUF's: "group scales in fp16") are held in fp16. The same
extension fuses the native runtime's RMSNorms (and the residual add before each) for bf16
activations, with torch's bits (`csrc/norm.cpp`), and runs attention by position
(`csrc/attn.cpp`). Anywhere else, or if it cannot be compiled, torch's ops run and `q4_status()`
says why.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import mmap
import time
from pathlib import Path

import torch

from dspark import envs
from dspark.errors import DSparkError
from dspark.outlock import shared_build

log = logging.getLogger("dspark")


# bf16 weights up to this many elements run on dspark's kernel (csrc/q4_avx*.cpp `bf16_mm`) where it is
# built: 2-5x faster than oneDNN's packed matmul at 1-8 rows on SmolLM2's layer and draft shapes (Zen 4,
# 2 threads: 576x576 at 7 rows 20 against 44 us). Larger ones (an LM head over the vocabulary) stay on
# oneDNN: at 8 rows it is ahead there (49 152 x 576: 3.1 against 3.8 ms), while the tile is ahead at
# 1-3 rows (2.4 against 2.7-3.3 ms); a bf16 head is rare (a float target head; the draft's is Q8_0).
BF16_KERNEL_MAX = 1 << 22
HUGE = 2 << 20  # a transparent huge page (x86-64)


def _huge_buffer(nbytes: int) -> torch.Tensor | None:
    """nbytes of zeros (uint8) in an anonymous mapping asked to be backed by 2 MB pages (madvise
    MADV_HUGEPAGE: Linux with transparent huge pages in `madvise` or `always` mode), starting on
    a huge page boundary; None where it cannot be had (the caller allocates as usual)."""
    if not (envs.huge_pages() and hasattr(mmap, "MADV_HUGEPAGE")):
        return None
    try:
        mm = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mm.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return None
    arena = torch.frombuffer(mm, dtype=torch.uint8)  # its views keep the mapping alive
    at = (-arena.data_ptr()) % HUGE
    return arena[at : at + nbytes]


def huge_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype) on the CPU, in 2 MB pages where the OS gives them (a KV cache
    that attention reads every step: -0.18 ms a step at 900 cached tokens, BENCHMARKS.md)."""
    n = 1
    for d in shape:
        n *= d
    buf = _huge_buffer(n * torch.empty(0, dtype=dtype).element_size()) if n else None
    return torch.zeros(shape, dtype=dtype) if buf is None else buf.view(dtype).view(shape)


def into_huge_pages(holders) -> int:
    """Move the weights held at obj.field (a tensor or a tuple of tensors; (obj, field) pairs) into
    one mapping in 2 MB pages (`_huge_buffer`), in place; -> the bytes moved (0 where it cannot:
    the tensors then stay as they are).

    A decode step streams every weight once (SmolLM2: ~114 MB); in 4 KB pages that is ~28 000
    TLB misses a step, and the matmuls stream measurably slower than in 2 MB pages
    (docs/history/benchmarks.md, "... huge pages, ..."). Only plain CPU tensors move (not oneDNN's packed ones)."""

    def held(obj, field):
        val = getattr(obj, field)
        return val if isinstance(val, tuple) else (val,)

    # each movable tensor once, however many holders share it
    tensors = {
        id(t): t
        for obj, field in holders
        for t in held(obj, field)
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided and t.numel() > 0
    }
    sizes = [-(-t.numel() * t.element_size() // 64) * 64 for t in tensors.values()]
    arena = _huge_buffer(sum(sizes)) if tensors else None
    if arena is None:
        return 0
    moved, at = {}, 0
    for (key, t), n in zip(tensors.items(), sizes):
        moved[key] = arena[at : at + t.numel() * t.element_size()].view(t.dtype).view(t.shape).copy_(t)
        at += n
    for obj, field in holders:
        val = getattr(obj, field)
        if isinstance(val, tuple):
            setattr(obj, field, tuple(moved.get(id(t), t) for t in val))
        elif id(val) in moved:
            setattr(obj, field, moved[id(val)])
    return sum(sizes)


# "no tensor" for the extension's optional arguments (rope_cache_bf16's values inside qk,
# add_rms_bf16's taps): pybind passes no None to a Tensor argument
NO_TENSOR = torch.empty(0, dtype=torch.bfloat16)


def pack_bf16(w: torch.Tensor):
    """w [N, K] on a CPU -> its packed bf16 weight for `packed_linear` (dspark's layout, or oneDNN's
    prepacked one); None where neither applies (another device, packing turned off, a torch build
    without oneDNN) or where plain F.linear is faster: fewer than 16 outputs (the draft's
    confidence head, one output: oneDNN's packed call took 24 us warm, 85 us cold in a drafting
    step, against F.linear's 5 us)."""
    if not envs.pack_bf16() or w.device.type != "cpu" or w.shape[0] < 16:
        return None
    N, K = w.shape
    if N * K <= BF16_KERNEL_MAX and tile_applies(N, K):
        G = K // 32  # [N/16, K/32, 16 input pairs, 16 columns x 2]: csrc/q4_avx512.cpp's bf16_mm layout
        P = w.detach().to(torch.bfloat16).reshape(N // 16, 16, G, 16, 2).permute(0, 2, 3, 1, 4)
        return P.reshape(N // 16, G, 16, 32).contiguous(), torch.ones(N // 16, G, 16)
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w.detach().to(torch.bfloat16).contiguous())
    except (RuntimeError, AttributeError):
        return None


def fused_bias(*linears) -> torch.Tensor | None:
    """The bias of linears whose weights are concatenated into one matmul (q/k/v, gate/up): theirs
    end to end, zeros for one without; None when none has one."""
    bs = [m.bias for m in linears]
    if all(b is None for b in bs):
        return None
    return torch.cat(
        [
            b.detach() if b is not None else torch.zeros(m.weight.shape[0], dtype=m.weight.dtype)
            for b, m in zip(bs, linears)
        ]
    )


def packed_linear(x: torch.Tensor, packed, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [..., K] bf16 @ packed.T (+ bias) -> [..., out_features]."""
    if isinstance(packed, tuple):  # dspark's tile takes x's own shape
        y = extension().bf16_mm(x, *packed)
        return y if bias is None else y + bias
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
    return y.reshape(*x.shape[:-1], out_features)


def silu_mul(gu: torch.Tensor, ext) -> torch.Tensor:
    """silu(gate) * up of a fused gate/up projection's output [..., 2I] (gate | up): one call of
    the extension `ext` where it is given and the width tiles (csrc/attn.cpp `silu_mul_bf16`,
    torch's rounding steps), torch's ops otherwise."""
    if ext is not None and gu.shape[-1] % 32 == 0:
        return ext.silu_mul_bf16(gu)
    g, u = gu.chunk(2, -1)
    return torch.nn.functional.silu(g) * u


def argmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """x.argmax(dim), with half-precision logits compared as their fp32 values (module docstring);
    over the last dimension of fp32 or bf16 on dspark's AVX-512 build (csrc/markov.cpp
    `argmax_last`: torch's choice, ~7x faster, bf16 widened in place), elsewhere torch's."""
    if (
        dim in (-1, x.dim() - 1)
        and x.dim() >= 1
        and x.dtype in (torch.float32, torch.bfloat16)
        and x.device.type == "cpu"
        and x.shape[-1] > 0
        and extension_isa() == "avx512"
    ):
        return extension().argmax_last(x)
    if x.dtype in (torch.bfloat16, torch.float16) and x.device.type == "cpu":
        x = x.float()
    return x.argmax(dim)


# ---- dspark's compiled CPU extension: int4 / Q8_0 matmuls, norms, attention -----------------
# switched off and forced to one ISA through dspark/envs.py (DSPARK_Q4_KERNEL, DSPARK_KERNEL_ISA)
# one extension of separate translation units (csrc/dspark.h declares what they share): the ISA's
# matmul files (ISAS) and these, which compile for either ISA; bindings.cpp is the Python module
CSRC = Path(__file__).parent / "csrc"
SOURCES = (
    "norm.cpp",
    "attn.cpp",
    "attn_prefill.cpp",
    "rope.cpp",
    "markov.cpp",
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
}
# what the AVX-512 build's 8-bit activations need beyond the build (csrc/q4_avx512_vnni.cpp: vpdpbusd),
# and the flags they add to it
INT8_AVX512 = ("avx512_vnni",), ("-mavx512vnni", "-DDSPARK_ACT8=1")


def sources(isa: str) -> list[Path]:
    """The files an ISA's build compiles, one translation unit each."""
    return [*(CSRC / f for f in ISAS[isa][2]), *(CSRC / f for f in SOURCES)]


_build: dict = {}  # "ext": the compiled module or None, "isa": its build, "why": what runs instead and why
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
    vpdpbusd make a 1-token SmolLM2 step ~1.45x faster, a 2-token verify ~1.1x a step instead of
    ~1.45x and prefill ~2.8x faster; on AMD Zen 4 they made the 1-token step 2-4 % slower, so bf16
    stays there (and on any class not measured)."""
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
    """The build this CPU takes ('avx512' | 'avx2' | None) and, when not the full one, why."""
    flags, forced = cpu_flags(), envs.kernel_isa()
    for isa, (need, _, _) in ISAS.items():
        if forced in (None, isa) and all(f in flags for f in need):
            lacking = [f for f in ISAS["avx512"][0] if f not in flags]
            why = f"this CPU lacks {', '.join(lacking)}" if lacking else f"DSPARK_KERNEL_ISA={forced}"
            return isa, "" if isa == "avx512" else why
    return None, f"this CPU lacks {', '.join(f for f in ISAS['avx2'][0] if f not in flags) or 'the asked-for ISA'}"


def _planned_build() -> tuple[str | None, str]:
    """The build `extension` makes here and, when not the full one, why (`_isa`, or none at all
    where DSPARK_Q4_KERNEL=0)."""
    return _isa() if envs.q4_kernel() else (None, "DSPARK_Q4_KERNEL=0")


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
        if isa == "avx2":
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
    return _build["ext"]


def build_tag() -> str | None:
    """The extension's build (its ISA and a hash of its sources), None where it does not run: a
    measurement of a forward (the cost curve) made with other kernels is stale."""
    ext = extension()
    return None if ext is None else ext.__name__


def why_unavailable() -> str:
    """Why the extension does not run here ('' where it does)."""
    extension()
    return _build["why"]


TILES = {"avx512": "dspark AVX512-BF16", "avx2": "dspark AVX2"}  # the matmul tile of each build


def tile_name() -> str | None:
    """The matmul tile that runs here ('dspark AVX512-BF16' | 'dspark AVX2'), None without one."""
    extension()
    return TILES.get(_build["isa"])


def q4_activations() -> str | None:
    """What dspark's int4 and Q8_0 matmuls do with their bf16 activations here: 'bf16' (take them
    as they are) or 'int8' (quantise them per group of 32); None without the tile.

    By build (docs/history/benchmarks.md "8-bit activations for the AVX2 build's int4 and Q8_0
    matmuls"). AVX2: each row's groups of 32 inputs quantised to
    8 bits (s = max|x| / 127, xq = round(x / s), the rule llama.cpp uses against Q4_1 and Q8_0
    weights) and summed exactly in integers: the SmolLM2 layer stack 1.6x faster at 1 row and 1.7x
    at 8 than on bf16 activations (FMAs, one broadcast each); `activations="bf16"` (`choose_activations`) builds it
    with bf16 ones (its own cached build), closer to the Q4_1 model (KL 0.0011 against 0.003 a
    token) at the speed the AVX2 tile had before. AVX-512: bf16 unless asked otherwise. There
    `activations="int8"`, on a CPU with AVX512-VNNI, builds the same 8-bit scheme on vpdpbusd
    (csrc/q4_avx512_vnni.cpp, 64 multiply-adds an instruction against vdpbf16ps's 32; its own cached
    build, the AVX2 build's rule and steps): it makes verifies of 4-8 tokens cheaper, where the bf16 dot
    products bound the tile, but not a 1- or 2-token step, which streams its weights (docs/BENCHMARKS.md,
    Zen 4; docs/history/benchmarks.md "the floors, measured"), and 1 row is what plain decoding runs;
    so `auto` keeps bf16 there, the model nearer the fp32 one. On Intel Xeon with AMX (Sapphire / Emerald
    Rapids) the same 8-bit tile is faster at every row count, one included, so `auto` takes it there
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


def tile_applies(n: int, k: int) -> bool:
    """Can dspark's matmul tile (int4, Q8_0 and bf16 weights; AVX512-BF16 or AVX2 builds) hold an
    [n, k] weight (blocks of 16 output columns, groups of 32 inputs)?"""
    return n % 16 == 0 and k % 32 == 0 and tile_name() is not None


def _group_scales(d: torch.Tensor, lo: torch.Tensor | None, N: int, G: int) -> tuple[torch.Tensor, ...]:
    """Per-group scales (and minimums) [N, G] -> csrc/q4.h's [N/16, G, 16] `Scales`: fp16 where
    every value is an fp16 number (GGUF stores Q4_1's and Q8_0's so: the kernels widen them to the
    same fp32 values, and a 1-row int4 matmul streams a sixth fewer bytes), fp32 otherwise."""
    ts = [t.float() for t in (d, lo) if t is not None]
    dtype = torch.float16 if all(torch.equal(t.half().float(), t) for t in ts) else torch.float32
    return tuple(t.reshape(N // 16, 16, G).permute(0, 2, 1).to(dtype).contiguous() for t in ts)


def pack_q4(q: torch.Tensor, d: torch.Tensor, lo: torch.Tensor):
    """q [N, K] in 0..15, d / lo [N, K/32] (w = q * d + lo) -> (P, D, L) in the layout of the
    extension's build (csrc/q4_avx512.cpp's header: the AVX2 build reads 8-input octets; D, L:
    `_group_scales`). Packed weights are made where they run and never stored."""
    N, K = q.shape
    G = K // 32
    qi = q.to(torch.int32)
    if _octets():
        qb = qi.reshape(N // 16, 16, G, 4, 4, 2)  # [N/16, column, G, octet, nibble j, word i]: input 8o + 2j + i
        b0 = qb[..., 0, :] | (qb[..., 1, :] << 4)
        b1 = qb[..., 2, :] | (qb[..., 3, :] << 4)  # [N/16, column, G, octet, i]: a word's two bytes
        P = torch.stack([b0, b1], -1).permute(0, 2, 3, 1, 4, 5)  # [N/16, G, octet, column, i, byte]
    else:
        qb = qi.reshape(N // 16, 16, G, 8, 4).permute(0, 2, 3, 1, 4)  # [N/16, G, step, column, 4]
        P = torch.stack([qb[..., 0] | (qb[..., 2] << 4), qb[..., 1] | (qb[..., 3] << 4)], -1)
    return (P.reshape(N // 16, G, 8, 32).to(torch.uint8).contiguous(), *_group_scales(d, lo, N, G))


def _octets() -> bool:
    """Does this build's int4 tile read the octet layout (`pack_q4`)? The AVX2 build's, either
    activations, and the AVX-512 build's 8-bit one (csrc/q4_avx512_vnni.cpp)."""
    return extension_isa() == "avx2" or (extension_isa() == "avx512" and q4_activations() == "int8")


def q4_linear(x: torch.Tensor, packed) -> torch.Tensor:
    """x [..., K] bf16 @ W.T -> [..., N] bf16, W packed by `pack_q4`."""
    return extension().q4_mm(x, *packed)


def q8_groups(w: torch.Tensor, group: int = 32):
    """Symmetric 8-bit quantisation per `group` inputs (the GGUF Q8_0 rule: d = max|w| / 127).
    w [N, K] -> (q [N, K] in -127..127, d [N, K/group]); a Q8_0 weight gets its exact values back."""
    N, K = w.shape
    g = w.float().reshape(N, K // group, group)
    d = g.abs().amax(-1) / 127
    q = (g / torch.where(d > 0, d, 1.0)[..., None]).round().clamp(-127, 127)
    return q.reshape(N, K).to(torch.int8), d


def pack_q8(q: torch.Tensor, d: torch.Tensor):
    """q [N, K] int8 values, d [N, K/32] (w = q * d, GGUF Q8_0) -> (P, D), csrc/q4_avx512.cpp's q8 layout,
    or on the AVX-512 build with 8-bit activations csrc/q4_avx512_vnni.cpp's (4 inputs a column's
    dword in the rows' byte order, q + 128: vpdpbusd's unsigned operand); D: `_group_scales`."""
    N, K = q.shape
    G = K // 32
    if extension_isa() == "avx512" and q4_activations() == "int8":
        order = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])  # each octet's inputs in the rows' byte order
        qo = q.to(torch.int16).reshape(N // 16, 16, G, 4, 8)[..., order] + 128  # [N/16, column, G, octet, 8]
        qs = qo.reshape(N // 16, 16, G, 8, 4).permute(0, 2, 3, 1, 4)  # [N/16, G, step, column, 4]
        return (
            qs.to(torch.uint8).view(torch.int8).reshape(N // 16, G, 16, 32).contiguous(),
            *_group_scales(d, None, N, G),
        )
    qb = q.to(torch.int8).reshape(N // 16, 16, G, 16, 2).permute(0, 2, 3, 1, 4)  # [N/16, G, pair, column, 2]
    return (qb.reshape(N // 16, G, 16, 32).contiguous(), *_group_scales(d, None, N, G))


def q8_linear(x: torch.Tensor, packed) -> torch.Tensor:
    """x [..., K] bf16 @ W.T -> [..., N] bf16, W packed by `pack_q8`."""
    return extension().q8_mm(x, *packed)


def markov_walk(
    base: torch.Tensor, w1: torch.Tensor, w2t: torch.Tensor, d2t: torch.Tensor | None, anchors: torch.Tensor
) -> torch.Tensor | None:
    """The vanilla Markov head's greedy walk in one call (csrc/markov.cpp): base [B, g, Vd] draft-head
    logits, w1 [V, r], w2t [r, Vd] (W2 transposed), all bf16 or all fp32, d2t [Vd] or None, anchors
    [B] -> target ids [B, g]; None where the extension does not run (a CPU without it, another
    device or dtype): the caller walks in torch."""
    if base.device.type != "cpu" or {base.dtype, w1.dtype, w2t.dtype} not in ({torch.bfloat16}, {torch.float32}):
        return None
    ext = extension()
    if ext is None:
        return None
    return ext.markov_walk(base, w1, w2t, torch.zeros(0, dtype=torch.long) if d2t is None else d2t, anchors)
