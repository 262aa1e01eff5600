"""The linter the project is configured with (pyproject.toml [tool.ruff]) finds nothing: an
unused import, an undefined name or a syntax error fails the suite, as a failing test does."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff") or shutil.which("ruff", path=str(Path(sys.executable).parent))
    if ruff is None:
        pytest.fail("ruff is not installed: `bash scripts/setup.sh --test` installs the pinned version")
    out = subprocess.run([ruff, "check", "--no-cache", "dspark", "tests", "scripts"], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_would_find_an_unused_import(tmp_path):
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    (tmp_path / "bad.py").write_text("import os\n")
    out = subprocess.run([ruff, "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), str(tmp_path / "bad.py")],
                         capture_output=True, text=True)
    assert out.returncode == 1 and "F401" in out.stdout
