"""Helpers for tests that run a benchmark script of ``benchmarks/`` in process."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def bench_module(name: str):
    """The benchmark script ``benchmarks/<name>.py`` as a module."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module            # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module
