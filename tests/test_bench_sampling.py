"""The sampling walk's benchmark runs, and finds the checkout's walk and a revision's sampling the
same tokens from the same seed."""

from __future__ import annotations

import contextlib
import io
import subprocess

import pytest

from bench_helpers import BENCHMARKS, bench_module


def test_the_walk_benchmark_compares_with_a_revision(monkeypatch):
    if subprocess.run(["git", "-C", str(BENCHMARKS), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout: no revision to compare with")
    monkeypatch.syspath_prepend(str(BENCHMARKS))              # it imports its neighbour revision.py
    bench = bench_module("bench_sampling")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        bench.main(["--baseline", "HEAD", "--calls", "4", "--vocab", "50"])
    rows = [line for line in printed.getvalue().splitlines() if " nodes " in line]
    assert len(rows) == 4                                     # 2 trees x warm / cold
    assert all(line.rstrip(" │").endswith("yes") for line in rows)
