"""Small JSON files the engine writes and reads back (cost curves, calibrations, profiles)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from dspark.errors import DSparkError


def write_json(path, data, indent: int = 1) -> Path:
    """Atomic: a concurrent reader (another process starting up) never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=indent) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_json(path, what: str):
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DSparkError(f"{what} file {path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise DSparkError(f"{what} file {path} is not JSON: {exc}") from None
