"""Atomic file output: every file SpecFit writes appears whole or not at all."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Callable

__all__ = ["atomic_write", "write_text_atomic", "write_json_atomic", "write_jsonl_atomic"]


def atomic_write(path: str | Path, write: Callable[[str], None]) -> Path:
    """Call ``write(tmp_path)`` on a temporary file next to ``path``, then move it into place
    with ``os.replace``: readers never see a half-written file, and an interrupted run leaves the
    previous file (or none) rather than a truncated one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; a report is for others to read
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text_atomic(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def write_json_atomic(path: str | Path, obj, indent: int = 2) -> Path:
    return write_text_atomic(path, json.dumps(obj, indent=indent, sort_keys=False) + "\n")


def write_jsonl_atomic(path: str | Path, records) -> Path:
    return write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in records))
