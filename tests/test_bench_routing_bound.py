"""The routing-model bound benchmark: its traces are the shipped ones, rebuilt with the model that
drew their experts, and one setting runs end to end."""

from __future__ import annotations

import numpy as np
import pytest

from bench_helpers import bench_module


@pytest.fixture(scope="module")
def bench():
    return bench_module("bench_routing_bound")


def test_the_synthetic_sample_is_rebuilt_with_its_routing_model(bench):
    """traces/README.md's command, run through synthesize_and_model, gives the shipped trace, and
    the model's likely experts of its nodes are the ones the model would rank first."""
    trace, model = bench.with_model("qwen3-chat", 16)
    likely = model.likely_experts(trace.token)
    prefs = model.preferences(trace.token)
    certain = int(np.floor(model.token_prob_.min() * trace.top_k))
    assert certain >= 1 and np.array_equal(likely[:, :, :certain], prefs[:, :, :certain])


def test_one_setting_end_to_end(bench, capsys):
    bench.main(["--traces", "qwen3-chat", "--profiles", "pcie4", "--caches", "0"])
    out = capsys.readouterr().out
    assert "| pcie4 | 0 |" in out and "Over the 1 settings, / true experts: learned median" in out
