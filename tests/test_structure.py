"""The shape of the house, read from the source (ast, nothing imported): no import circles
(function-level imports count too), the library never imports the command layer nor prints,
and every decoding command takes the shared engine flags."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from dspark.api import EngineConfig
from dspark.cli import build_parser
from dspark.cli.engine_flags import engine_config

ROOT = Path(__file__).resolve().parents[1] / "dspark"
CLI = "dspark.cli"
# Output a library may produce: progress bars its caller turns on (progress=True) go through
# tqdm; everything else is returned, raised, logged, or handed to a callback the caller passes.
PRINTING_CALLS = {"print", "pprint", "breakpoint"}
PRINTING_MODULES = {"rich", "pprint"}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def parse_package(root: Path = ROOT) -> dict[str, ast.Module]:
    return {module_name(p, root): ast.parse(p.read_text(encoding="utf-8"), str(p)) for p in sorted(root.rglob("*.py"))}


def imported_modules(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """Every dspark module `name` imports, at any depth of the file (functions included).
    `from pkg import mod` counts as importing pkg.mod when that is a module."""
    package = name if name in known and any(k.startswith(name + ".") for k in known) else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "dspark")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "dspark":
                continue
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in known)
    return {m for m in out if m in known and m != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None (depth-first search, white/grey/black)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def import_graph(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    """A package's __init__ runs before any of its modules: importing dspark.a.b imports dspark.a too."""
    known = set(trees)
    graph = {}
    for name, tree in trees.items():
        deps = imported_modules(name, tree, known)
        for d in list(deps):
            parts = d.split(".")
            deps.update(".".join(parts[:i]) for i in range(2, len(parts)) if ".".join(parts[:i]) in known)
        graph[name] = {d for d in deps if d != name}
    return graph


def library_problems(trees: dict[str, ast.Module]) -> list[str]:
    problems = []
    known = set(trees)
    for name, tree in trees.items():
        if name == CLI or name.startswith(CLI + ".") or name == "dspark.__main__":
            continue
        for dep in imported_modules(name, tree, known):
            if dep == CLI or dep.startswith(CLI + "."):
                problems.append(f"{name} imports the command layer ({dep})")
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in PRINTING_CALLS:
                problems.append(f"{name}:{node.lineno} calls {node.func.id}()")
            if (
                isinstance(node, ast.Attribute)
                and node.attr in ("stdout", "stderr")
                and isinstance(node.value, ast.Name)
                and node.value.id == "sys"
            ):
                problems.append(f"{name}:{node.lineno} writes to sys.{node.attr}")
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                mods = [node.module or ""]
            for m in mods:
                top = m.split(".")[0]
                if top in PRINTING_MODULES:
                    problems.append(f"{name}:{node.lineno} imports {m} (printing belongs to dspark.cli)")
                if top == "argparse":
                    problems.append(f"{name}:{node.lineno} imports argparse (flags belong to dspark.cli)")
    return problems


ENVS = "dspark.envs"


def environment_reads(trees: dict[str, ast.Module]) -> list[str]:
    """os.environ / os.getenv / os.putenv anywhere but dspark/envs.py: the one switchboard."""
    problems = []
    for name, tree in trees.items():
        if name == ENVS:
            continue
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in ("environ", "getenv", "putenv", "environb")
                and isinstance(node.value, ast.Name)
                and node.value.id == "os"
            ):
                problems.append(f"{name}:{node.lineno} reads os.{node.attr} (environment variables belong to {ENVS})")
            if (
                isinstance(node, ast.ImportFrom)
                and node.module == "os"
                and any(a.name in ("environ", "getenv", "putenv", "environb") for a in node.names)
            ):
                problems.append(f"{name}:{node.lineno} imports from os what belongs to {ENVS}")
    return problems


def session_citations(root: Path) -> list[str]:
    """Comments and docstrings that name a working session ("Session 17"): code keeps the why and
    cites the history by what an entry measured (docs/history/benchmarks.md, "8-bit activations ...")."""
    pattern = re.compile(r"\b[Ss]ession \d")
    return [
        f"{path.relative_to(root.parent)}:{n}"
        for path in sorted(root.rglob("*"))
        if path.suffix in (".py", ".cpp", ".h", ".sh")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]


REFERENCE = "dspark.reference"


def reference_imports(trees: dict[str, ast.Module]) -> list[str]:
    """Modules outside dspark.reference that import it: a reference is what tests compare a
    compiled path against, never a path the package runs."""
    known, found = set(trees), []
    for name, tree in sorted(trees.items()):
        if name == REFERENCE or name.startswith(REFERENCE + "."):
            continue
        refs = sorted(d for d in imported_modules(name, tree, known) if d == REFERENCE or d.startswith(REFERENCE + "."))
        if refs:
            found.append(f"{name} imports {', '.join(refs)}")
    return found


MAX_LINES = 500
# Files allowed over MAX_LINES while they wait to be split by job; the list names exactly the files
# still over, so a split that lands makes the check ask for its removal.
LONG_FILES: set[str] = set()


def long_files(root: Path, limit: int = MAX_LINES) -> dict[str, int]:
    """Every .py file under `root` longer than `limit` lines: {path from root's parent: lines}.
    A module that long does more than one job; split it into modules that each do one."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > limit:
            out[path.relative_to(root.parent).as_posix()] = n
    return out


# ---- the checks on the real package ------------------------------------------------------------


def test_the_package_has_no_import_circle():
    graph = import_graph(parse_package())
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_library_neither_imports_the_command_layer_nor_prints():
    assert library_problems(parse_package()) == []


def test_every_environment_variable_is_read_in_envs():
    assert environment_reads(parse_package()) == []


def test_no_module_is_over_500_lines_but_the_listed_ones():
    found = long_files(ROOT)
    assert set(found) - LONG_FILES == set(), f"split by job (at most {MAX_LINES} lines a file): {found}"
    assert LONG_FILES - set(found) == set(), "now within the limit: take it off LONG_FILES"


def test_an_over_long_file_is_found(tmp_path):
    pkg = tmp_path / "dspark"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n" * MAX_LINES)  # at the limit: fine
    (pkg / "engine" / "b.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (pkg / "notes.txt").write_text("x\n" * 1000)  # not Python
    assert long_files(pkg) == {"dspark/engine/b.py": MAX_LINES + 1}


def test_no_code_comment_cites_a_working_session():
    assert session_citations(ROOT) == []


def test_a_session_citation_is_found(tmp_path):
    (tmp_path / "dspark" / "csrc").mkdir(parents=True)
    (tmp_path / "dspark" / "csrc" / "k.cpp").write_text("// fast (Session 17)\nint x;\n")
    (tmp_path / "dspark" / "a.py").write_text('"""the session is over"""\n')
    assert session_citations(tmp_path / "dspark") == ["dspark/csrc/k.cpp:1"]


def test_no_decoding_module_imports_a_reference_implementation():
    trees = parse_package()
    assert any(n.startswith(REFERENCE + ".") for n in trees), "the reference package holds the kernels' loop"
    assert reference_imports(trees) == []


def test_a_reference_import_is_found(tmp_path):
    pkg = tmp_path / "dspark"
    (pkg / "reference").mkdir(parents=True)
    (pkg / "target").mkdir()
    for f in ("__init__.py", "reference/__init__.py", "reference/loop.py", "target/__init__.py"):
        (pkg / f).write_text("")
    (pkg / "reference" / "other.py").write_text("from dspark.reference import loop\n")  # inside: allowed
    (pkg / "target" / "native.py").write_text("def f():\n    from dspark.reference import loop\n")
    assert reference_imports(parse_package(pkg)) == [
        "dspark.target.native imports dspark.reference, dspark.reference.loop"
    ]


def test_below_the_api_nothing_imports_the_api():
    """Arrows point down: the api assembles engines from the packages, never the reverse."""
    trees = parse_package()
    graph = import_graph(trees)
    up = {n for n, deps in graph.items() if "dspark.api" in deps and not n.startswith(CLI)}
    assert up == set(), up


# ---- the checks can fail: the same functions on small packages with the faults in them ---------


def test_an_environment_read_outside_envs_is_found(tmp_path):
    trees = _write(
        tmp_path,
        {
            "__init__.py": "",
            "envs.py": "import os\nX = os.environ.get('A')\n",
            "a.py": "import os\nY = os.environ['B']\n",
            "b.py": "from os import getenv\n",
            "c.py": "import os\nZ = os.getenv('C')\n",
        },
    )
    found = environment_reads(trees)
    assert [f.split(" ")[0] for f in found] == ["dspark.a:2", "dspark.b:1", "dspark.c:2"]


def _write(root: Path, files: dict[str, str]) -> dict[str, ast.Module]:
    for rel, text in files.items():
        path = root / "dspark" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return parse_package(root / "dspark")


def test_a_circle_hidden_in_a_function_is_found(tmp_path):
    trees = _write(
        tmp_path,
        {
            "__init__.py": "",
            "api.py": "from dspark.bench import doctor\n",
            "bench/__init__.py": "",
            "bench/doctor.py": "def f():\n    from dspark.api import resolve_draft\n",
        },
    )
    assert find_cycle(import_graph(trees)) == ["dspark.api", "dspark.bench.doctor", "dspark.api"]


def test_a_circle_through_from_package_import_module_is_found(tmp_path):
    trees = _write(
        tmp_path,
        {
            "__init__.py": "",
            "train/__init__.py": "",
            "train/trainer.py": "from dspark.train import export\n",
            "train/export.py": "def g():\n    from dspark.train.trainer import load_state\n",
        },
    )
    assert find_cycle(import_graph(trees)) is not None


def test_printing_and_upward_imports_in_the_library_are_found(tmp_path):
    trees = _write(
        tmp_path,
        {
            "__init__.py": "",
            "cli/__init__.py": "print('fine here')\n",
            "engine/__init__.py": "",
            "engine/a.py": "import sys\nfrom dspark.cli import main\n"
            "def f():\n    print('x')\n    sys.stderr.write('y')\n",
            "engine/b.py": "def g():\n    from rich.console import Console\n    import argparse\n",
        },
    )
    found = library_problems(trees)
    assert any("imports the command layer" in p for p in found)
    assert any("calls print()" in p for p in found) and any("sys.stderr" in p for p in found)
    assert any("imports rich" in p for p in found) and any("imports argparse" in p for p in found)
    assert not any(p.startswith("dspark.cli") for p in found)


# ---- scripts/ -----------------------------------------------------------------------------------
# The package's checks that hold for scripts/ too, and why:
# - no comment cites a working session: a script is code, and keeps the why as the package does;
# - no script imports dspark.reference: a script runs or measures what the package runs, and the
#   reference is only what tests compare the compiled path against;
# - no environment read outside dspark/envs.py: a script's child processes get their environment
#   from envs.child_env, so every variable dspark reads or sets is listed in one place.
# Not: printing and argparse (a script is a command-line program, as dspark.cli is), import
# circles and the layering (nothing imports a script), the line limit (a script is one runnable
# file, `python scripts/x.py`; split, it would need a package of its own).

SCRIPTS = ROOT.parent / "scripts"


def test_no_script_cites_a_working_session():
    assert session_citations(SCRIPTS) == []


def test_no_script_imports_a_reference_implementation():
    found = reference_imports({**parse_package(), **parse_package(SCRIPTS)})
    assert [f for f in found if f.startswith("scripts.")] == []


def test_no_script_reads_the_environment_outside_envs():
    assert environment_reads(parse_package(SCRIPTS)) == []


def test_the_checks_find_a_scripts_faults(tmp_path):
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "setup.sh").write_text("# as measured in Session 12\n")
    (scripts / "run.py").write_text("import os\nfrom dspark.reference import loop\nX = os.environ['A']\n")
    pkg = _write(tmp_path, {"__init__.py": "", "reference/__init__.py": "", "reference/loop.py": ""})
    assert session_citations(scripts) == ["scripts/setup.sh:1"]
    assert reference_imports({**pkg, **parse_package(scripts)}) == [
        "scripts.run imports dspark.reference, dspark.reference.loop"
    ]
    assert [f.split(" ")[0] for f in environment_reads(parse_package(scripts))] == ["scripts.run:3"]


# ---- every decoding command takes the shared engine flags ---------------------------------------

DECODING = {
    "generate": ["--prompt", "hi"],
    "serve": [],
    "bench": ["--out", "o"],
    "bench-batch": [],
    "calibrate": ["--prompts", "p.jsonl", "--out", "c.json"],
    "doctor": [],
    "train eval": [],
}
ENGINE_FLAGS = [
    "--target",
    "T",
    "--draft",
    "D",
    "--no-spec",
    "--dtype",
    "float32",
    "--device",
    "cpu",
    "--runtime",
    "native",
    "--threads",
    "2",
    "--layout",
    "bonus_anchor",
    "--verify",
    "adaptive",
    "--threshold",
    "0.3",
    "--calibration",
    "cal.json",
    "--cost-curve",
    "curve.json",
    "--always-draft",
    "--max-batch",
    "3",
    "--no-check",
]
WANT = EngineConfig(
    target="T",
    draft="D",
    no_spec=True,
    dtype="float32",
    device="cpu",
    runtime="native",
    threads=2,
    layout="bonus_anchor",
    verify="adaptive",
    threshold=0.3,
    calibration="cal.json",
    cost_curve="curve.json",
    always_draft=True,
    max_batch=3,
    check=False,
)


@pytest.mark.parametrize("command", list(DECODING))
def test_every_decoding_command_parses_the_engine_flags(command):
    words = command.split()
    args = build_parser(words[0]).parse_args(words + DECODING[command] + ENGINE_FLAGS)
    assert engine_config(args) == WANT


@pytest.mark.parametrize("command", list(DECODING))
def test_engine_flag_defaults_are_the_engine_config_defaults(command):
    words = command.split()
    args = build_parser(words[0]).parse_args(words + DECODING[command])
    assert engine_config(args) == EngineConfig()


@pytest.mark.parametrize("dtype", ["auto", "bf16", "bfloat16", "fp32", "float32"])
def test_dtype_spellings_are_accepted_and_float16_is_not(dtype, capsys):
    assert build_parser("generate").parse_args(["generate", "--prompt", "x", "--dtype", dtype]).dtype == dtype
    with pytest.raises(SystemExit):
        build_parser("generate").parse_args(["generate", "--prompt", "x", "--dtype", "float16"])


@pytest.mark.parametrize(
    "command,extra,message",
    [
        ("bench", ["--out", "o", "--max-batch", "4"], "drop --max-batch"),
        ("bench", ["--out", "o", "--verify", "threshold"], "add threshold to --arms"),
        ("bench-batch", ["--max-batch", "4"], "drop --max-batch"),
        ("bench-batch", ["--verify", "adaptive"], "--arms plain,adaptive"),
        ("calibrate", ["--prompts", "p", "--out", "o", "--max-batch", "4"], "drop --max-batch"),
        ("doctor", ["--no-spec"], "drop --no-spec"),
    ],
)
def test_a_flag_a_command_cannot_honour_is_refused_before_loading(command, extra, message, capsys):
    from dspark.cli import main

    assert main([command, "--target", "/nonexistent", *extra]) == 2
    assert message in capsys.readouterr().err


# ---- the C++ kernels: separate translation units that share only their headers ------------------

CSRC = ROOT / "csrc"


def test_every_kernel_file_is_in_a_build_and_every_header_is_used():
    """Each .cpp of dspark/csrc is compiled by a build (an ISA's matmul file, or one every build
    compiles), and each header is included by some file: nothing there is dead or left out."""
    from dspark import kernels

    built = {f.name for isa in kernels.ISAS for f in kernels.sources(isa)}
    assert {p.name for p in CSRC.glob("*.cpp")} == built
    texts = {p.name: p.read_text() for p in [*CSRC.glob("*.cpp"), *CSRC.glob("*.h")]}
    for header in CSRC.glob("*.h"):
        assert any(f'#include "{header.name}"' in t for n, t in texts.items() if n != header.name), header.name


def test_no_kernel_file_includes_another_kernel_file():
    """Files meet only through headers: a .cpp that includes a .cpp is one translation unit posing as
    two (the extension was once all files pasted into one string)."""
    for p in [*CSRC.glob("*.cpp"), *CSRC.glob("*.h")]:
        assert not re.search(r'#include\s+"[^"]+\.cpp"', p.read_text()), p.name


def test_the_built_extension_compiled_each_file_alone():
    """The build on this machine compiled each of its sources as its own object (so each includes
    what it uses) and linked them."""
    from dspark import kernels

    ext = kernels.extension()
    if ext is None:
        pytest.skip(f"dspark's extension does not run here: {kernels.why_unavailable()}")
    isa = kernels._build["isa"]
    folder = Path(ext.__file__).parent
    ninja = (folder / "build.ninja").read_text()
    for f in kernels.sources(isa):
        assert f"{f.stem}.o" in ninja and (folder / f"{f.stem}.o").exists(), f.name


# kernel files that still hold an ISA's own code: the prefill's attention tiles (AMX-BF16, and their
# vdpbf16ps form on other AVX512-BF16 CPUs), built into every build and run where the CPU has them
ISA_KERNELS = {"attn_prefill.cpp"}


def test_kernels_other_than_an_isas_own_are_written_against_the_shared_headers():
    """Outside each ISA's matmul files (kernels.ISAS) and ISA_KERNELS, a kernel file holds no
    intrinsics and no branch on the ISA: its vector code goes through csrc/simd.h (8 lanes) and
    csrc/vec.h (the build's width), where each ISA's instructions are, once."""
    from dspark import kernels

    own = {f for isa in kernels.ISAS.values() for f in isa[2]} | ISA_KERNELS
    for path in CSRC.glob("*.cpp"):
        if path.name in own:
            continue
        text = path.read_text()
        assert not re.search(r"\b_mm\d*_\w+|\b__m\d+[a-z]*\b", text), f"{path.name}: intrinsics outside simd.h / vec.h"
        assert not re.search(r"#\s*if.*__(AVX|AMX|FMA|F16C)", text), f"{path.name}: a branch on the ISA"


SIMD_PROBE = r"""
#include "simd.h"
#include <cstdio>
#include <cstring>
#include <cmath>
#include <cstdint>
#include <limits>
// every F8 operation on values that reach each rounding case, printed as bits
int main() {
  const float base[16] = {1.0f, -2.5f, 3.14159f, 1e-30f, -0.0f, 65504.f, 1.00390625f, 1.01171875f,
                          std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(), -7.75f,
                          0.333333f, 1e30f, -1e-3f, 2.0f, 0.5f};
  uint16_t h[16];
  for (int i = 0; i < 16; ++i) {
    uint32_t u;
    std::memcpy(&u, &base[i], 4);
    h[i] = static_cast<uint16_t>(u >> 16);
  }
  using namespace simd;
  for (int r = 0; r < 2; ++r) {
    const float* a = base + 8 * r;
    float f[8], g[8];
    for (int i = 0; i < 8; ++i) f[i] = a[i], g[i] = a[7 - i] == 0.f ? 0.625f : 1.0f / a[7 - i];
    F8 x, y;
    std::memcpy(&x, f, sizeof f);
    std::memcpy(&y, g, sizeof g);
    const F8 outs[] = {add8(x, y), mul8(x, y), fma8(x, y, set8(0.3f)), neg8(x), round_bf16(x), load_bf16(h + 8 * r),
                       zero8()};
    for (const F8& o : outs) {
      float v[8];
      store8(v, o);
      for (float z : v) {
        uint32_t u;
        std::memcpy(&u, &z, 4);
        std::printf("%08x ", u);
      }
    }
    uint16_t st[8];
    store_bf16(st, x);
    for (uint16_t z : st) std::printf("%04x ", z);
  }
  std::printf("\n");
}
"""


def test_the_8_lane_header_gives_the_same_bits_with_and_without_avx2(tmp_path):
    """csrc/simd.h's F8 is AVX2 + FMA registers on x86 builds and an array of 8 floats anywhere else:
    both run every operation (add, multiply, fused multiply-add, negation, bf16 rounding, loads
    and stores) to the same bits, NaN and infinity included."""
    import shutil
    import subprocess

    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler here")
    from dspark import kernels

    if not all(f in kernels.cpu_flags() for f in ("avx2", "fma")):
        pytest.skip("this CPU cannot run the AVX2 side of the comparison")
    src = tmp_path / "probe.cpp"
    src.write_text(SIMD_PROBE)
    outs = []
    for flags in ([], ["-mavx2", "-mfma"]):
        exe = tmp_path / ("probe" + "".join(flags))
        cmd = [cxx, "-std=c++17", "-O2", "-ffp-contract=off", *flags, f"-I{CSRC}", str(src), "-o", str(exe)]
        built = subprocess.run(cmd, capture_output=True, text=True)
        assert built.returncode == 0, built.stderr[-3000:]
        outs.append(subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout)
    assert outs[0] == outs[1] and len(outs[0].split()) == 2 * (7 * 8 + 8)


@pytest.mark.parametrize("isa", ["avx2", "avx512", "generic"])
@pytest.mark.parametrize("header", sorted(p.name for p in CSRC.glob("*.h")))
def test_each_kernel_header_compiles_alone(header, isa, tmp_path):
    """A header includes what it uses: compiled alone (syntax only, each build's flags: the AVX-512
    one's include the AMX code, the generic one's none), it has no error."""
    import shutil
    import subprocess

    from dspark import kernels
    from torch.utils.cpp_extension import include_paths

    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler here")
    flags = [f for f in kernels.ISAS[isa][1] if f != "-O3"]
    cmd = [cxx, "-std=c++17", "-fsyntax-only", "-x", "c++", *flags, f"-I{CSRC}"]
    cmd += [f"-I{p}" for p in include_paths()] + [str(CSRC / header)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
