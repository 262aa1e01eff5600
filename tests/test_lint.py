"""The linter, formatter and type checker the project is configured with (pyproject.toml
[tool.ruff], [tool.mypy]) find nothing: an unused import, an undefined name, a syntax error, a line
over the limit, code laid out otherwise than `ruff format` lays it out or a type error in the
package fails the suite, as a failing test does (`ruff format dspark tests scripts` fixes the
layout; `mypy` names each type error)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool(name: str) -> str:
    """A pinned lint tool, on PATH or beside this Python; the suite fails (never skips) without it."""
    tool = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if tool is None:
        pytest.fail(f"{name} is not installed: `bash scripts/setup.sh --test` installs the pinned version")
    return tool


def _ruff() -> str:
    return _tool("ruff")


def _mypy() -> str:
    return _tool("mypy")


def test_ruff_finds_nothing():
    out = subprocess.run(
        [_ruff(), "check", "--no-cache", "dspark", "tests", "scripts"], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_tree_is_laid_out_as_ruff_format_lays_it_out():
    out = subprocess.run(
        [_ruff(), "format", "--check", "--no-cache", "dspark", "tests", "scripts"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_format_would_find_a_line_laid_out_otherwise(tmp_path):
    (tmp_path / "bad.py").write_text("x = {  'a':1 }\n")
    out = subprocess.run(
        [
            _ruff(),
            "format",
            "--check",
            "--no-cache",
            "--config",
            str(ROOT / "pyproject.toml"),
            str(tmp_path / "bad.py"),
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1 and "bad.py" in out.stdout


def test_ruff_would_find_an_unused_import(tmp_path):
    (tmp_path / "bad.py").write_text("import os\n")
    out = subprocess.run(
        [_ruff(), "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), str(tmp_path / "bad.py")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1 and "F401" in out.stdout


def test_mypy_finds_nothing():
    """The package as pyproject.toml [tool.mypy] checks it (files, python_version, the untyped
    third-party modules it names)."""
    out = subprocess.run([_mypy()], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_would_find_a_type_error(tmp_path):
    (tmp_path / "bad.py").write_text('x: int = "a"\n')
    out = subprocess.run(
        [
            _mypy(),
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "--no-incremental",
            "--cache-dir",
            str(tmp_path / ".mypy_cache"),
            str(tmp_path / "bad.py"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1 and "bad.py:1" in out.stdout and "[assignment]" in out.stdout, out.stdout + out.stderr


def test_the_kernels_are_laid_out_as_clang_format_lays_them_out():
    """dspark/csrc as the repository's .clang-format lays it out (`clang-format -i dspark/csrc/*.cpp dspark/csrc/*.h`
    fixes it)."""
    tool = _tool("clang-format")
    csrc = ROOT / "dspark" / "csrc"
    sources = sorted(str(p) for p in [*csrc.glob("*.cpp"), *csrc.glob("*.h")])
    out = subprocess.run([tool, "--dry-run", "--Werror", *sources], cwd=ROOT, capture_output=True, text=True)
    assert sources and out.returncode == 0, out.stderr[-3000:]
