"""The ablation benchmark's helpers: the accepted paths' nodes, the slot precision on and off
them, the profiles it replays with, and a trace given by its path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench_helpers import bench_module
from specfit.calibrate.presets import resolve_profile
from specfit.calibrate.profile import ModelShape
from specfit.simulate.prepared import prepare
from specfit.traces.format import read_trace

SAMPLE = Path(__file__).resolve().parents[1] / "traces" / "olmoe-1b-7b-real-routing.parquet"


@pytest.fixture(scope="module")
def bench():
    return bench_module("bench_policy")


@pytest.fixture(scope="module")
def sample():
    return read_trace(SAMPLE)


def walked_paths(trace) -> np.ndarray:
    """bool [nodes]: each tree's accepted path walked from the root: the child whose token is the
    target's verdict at the node, while there is one (written from the definition)."""
    on = np.zeros(trace.n_nodes, dtype=bool)
    for c in range(trace.n_cycles):
        lo, hi = int(trace.offsets[c]), int(trace.offsets[c + 1])
        node = 0
        on[lo] = True
        while True:
            children = [v for v in range(1, hi - lo) if trace.parent[lo + v] == node
                        and trace.token[lo + v] == trace.verdict[lo + node]]
            if not children:
                break
            node = children[0]
            on[lo + node] = True
    return on


def test_the_accepted_paths_are_the_verdicts_followed_from_each_root(bench, sample):
    prep = prepare("sample", sample, sample.true_experts)
    on = bench.on_path_nodes(prep)
    assert np.array_equal(on, walked_paths(sample))
    assert on[sample.offsets[:-1]].all() and 0 < on.mean() < 0.5


def test_the_precision_on_and_off_the_paths_counts_each_side_apart(bench, sample):
    """Predictions right on every on-path slot and on none off the paths (experts shifted by one):
    the two columns say so, and an oracle is right on both."""
    on = walked_paths(sample)
    true = sample.true_experts.astype(np.int64)
    shifted = np.where(on[:, None, None], true, (true + 1) % sample.n_experts)
    # a shifted set can still name a true expert (ids next to each other): count those by hand
    off_right = np.mean([len(set(p) & set(t)) / t.size for p, t in
                         zip(shifted[~on].reshape(-1, sample.top_k), true[~on].reshape(-1, sample.top_k))])
    preps = {"oracle": prepare("sample", sample, sample.true_experts),
             "shifted": prepare("sample", sample, shifted.astype(sample.true_experts.dtype), predictor="shifted")}
    quality = bench.predictor_quality(preps, sample)
    assert quality["oracle"]["on_path_precision"] == quality["oracle"]["off_path_precision"] == 1.0
    assert quality["shifted"]["on_path_precision"] == 1.0
    assert quality["shifted"]["off_path_precision"] == pytest.approx(off_right)
    assert off_right < 0.5


def test_a_qwen3_scale_profile_is_the_demos_what_if_and_a_preset_is_the_traces_shape(bench, sample):
    from specfit.demo import whatif_scenarios

    shape = ModelShape.from_trace_meta(sample.model)
    assert bench.profile_cost("gh200-qwen3", sample, shape).params.tolist() == \
        whatif_scenarios(sample, ["gh200"])[0].cost.params.tolist()
    assert bench.profile_cost("pcie4", sample, shape).params.tolist() == \
        resolve_profile("pcie4", shape).cost.params.tolist()


def test_a_trace_is_read_from_its_path_and_a_missing_one_is_named(bench, tmp_path):
    (name, trace), = bench.load_traces([str(SAMPLE)], 16, "chat")
    assert name == SAMPLE.stem and trace.n_cycles == read_trace(SAMPLE).n_cycles
    missing = tmp_path / "absent.parquet"
    with pytest.raises(SystemExit, match="absent.parquet: no such trace file"):
        bench.load_traces([str(missing)], 16, "chat")
    with pytest.raises(SystemExit, match="unknown trace 'olmoe'"):
        bench.load_traces(["olmoe"], 16, "chat")


def test_the_noisy_rows_and_the_learned_predictors_attribution(bench, monkeypatch, capsys, tmp_path):
    """``--noisy 1`` adds a SpecFit row whose experts are the true ones: it equals ``specfit``
    in every setting; the attribution line divides the rows it names."""
    out = tmp_path / "rows.json"
    monkeypatch.setattr("sys.argv", ["bench_policy.py", "--traces", str(SAMPLE), "--profiles", "pcie4",
                                     "--caches", "0,0.25", "--variants", "+expected-stop,+expected-stop learned,"
                                     "specfit learned,+prefetch,+prefetch learned", "--noisy", "1", "--out", str(out)])
    bench.main()
    import json

    rows = json.loads(out.read_text())
    assert len(rows) == 2
    for r in rows:
        assert r["specfit noisy:1"] == r["specfit"]
        assert r["specfit noisy:1 nodes"] == r["specfit nodes"]
    text = capsys.readouterr().out
    assert "specfit noisy:1 / specfit (true experts): median 1.000, min 1.000" in text
    sel = np.median([r["+expected-stop learned"] / r["+expected-stop"] for r in rows])
    gain = rows[1]["specfit learned"] / rows[1]["+expected-stop learned"]
    assert f"selection alone (+expected-stop learned / +expected-stop) median {sel:.3f}" in text
    assert "with learned ones (medians)" in text and f"and {gain:.3f}x with learned" in text
    last = rows[1]
    pre = [last["+prefetch"] / last["+expected-stop"], last["+prefetch learned"] / last["+expected-stop learned"]]
    assert f"prefetch (+prefetch / +expected-stop): {pre[0]:.3f}x with true experts, {pre[1]:.3f}x with learned" in text
    assert "look-ahead eviction" not in text           # its rows were not chosen
    # Sequoia's tree at its best size beside the fixed settings, and SpecFit against both
    assert all(r["sequoia:auto N"] >= 2 for r in rows)
    with_sequoia = [r["specfit"] / max(r["best fixed"], r["sequoia:auto"]) for r in rows]
    assert f"specfit / best of the fixed settings and sequoia:auto: median {np.median(with_sequoia):.3f}" in text
