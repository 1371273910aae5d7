"""The overhead A/B benchmark reads a run's share of time outside the model passes the same way
from ``bench_decode.py --json`` (no files) as from its ``--out`` directory."""

from __future__ import annotations

import contextlib
import io

import pytest

from bench_helpers import BENCHMARKS, bench_module


def test_the_json_and_the_run_directory_give_the_same_shares(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))            # bench_decode.py imports its neighbour busy.py
    overhead, decode = bench_module("bench_overhead"), bench_module("bench_decode")
    monkeypatch.chdir(tmp_path)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        decode.main(["--policies", "ar,specfit", "--no-warmup", "--max-new-tokens", "6", "--json",
                     "--out", str(tmp_path / "run"), "--profile", "pcie4"])
    from_json, from_files = overhead.from_json(printed.getvalue()), overhead.outside_models(tmp_path / "run")
    assert set(from_json) == set(from_files) == {"ar", "specfit"}
    for policy, (share, tokens_per_s) in from_json.items():
        assert 0.0 < share < 1.0 and tokens_per_s > 0
        assert share == pytest.approx(from_files[policy][0], rel=1e-9)
        # the summary's tokens/s (over the cycles' measured time) and the records' (over the decode's
        # wall time, which also holds the time between the cycles' measured parts) agree to ~1 % on
        # a quiet machine; the bound leaves room for a busy one (a rate of another quantity, the
        # prefill's or a whole prompt's, would be off by far more)
        assert tokens_per_s == pytest.approx(from_files[policy][1], rel=0.1)
