"""The loading benchmark's pieces: the head it writes is a valid drafter, and what its fresh
processes report is what the code they time returns."""

from __future__ import annotations

import os

import numpy as np
import pytest

from bench_helpers import bench_module
from specfit.traces.format import read_trace
from trace_helpers import SAMPLE_OLMOE

bench = bench_module("bench_load")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
SMALL_HEAD = {**bench.LLAMA_8B_HEAD, "hidden_size": 64, "target_hidden_size": 64, "vocab_size": 512,
              "draft_vocab_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "intermediate_size": 128}


def test_the_written_head_loads_as_a_drafter_with_its_draft_vocabulary(tmp_path):
    import torch

    from specfit.runtime.eagle3 import Eagle3Drafter

    bench.write_head(tmp_path / "head", SMALL_HEAD)
    embed = torch.ones(SMALL_HEAD["vocab_size"], SMALL_HEAD["hidden_size"], dtype=torch.bfloat16)
    drafter = Eagle3Drafter.from_pretrained(tmp_path / "head", target_embed=embed)
    assert drafter.draft_ids.tolist() == list(range(0, 4 * 96, 4))
    assert {p.dtype for p in drafter.parameters()} == {torch.bfloat16}
    got = bench.run(bench.REPO, ["-c", bench.DRAFTER, str(tmp_path / "head"), "512", "64"], ENV)
    assert got["s"] > 0 and got["peak_mb"] >= 0


def test_the_trace_and_target_processes_report_what_they_timed():
    got = bench.run(bench.REPO, ["-c", bench.TRACE, str(SAMPLE_OLMOE)], ENV)
    trace = read_trace(SAMPLE_OLMOE)
    arrays = sum(v.nbytes for v in vars(trace).values() if isinstance(v, np.ndarray))
    assert got["arrays_mb"] == pytest.approx(arrays / 2**20) and got["s"] > 0 and got["peak_mb"] >= 0
    got = bench.run(bench.REPO, ["-c", bench.TARGET], ENV)
    assert got["s"] > 0 and got["dynamo"] is False


def test_an_unknown_baseline_is_one_error_naming_it():
    with pytest.raises(SystemExit, match="bench_load: --baseline no-such-revision"):
        bench.main(["--baseline", "no-such-revision", "--head", "tiny"])
