"""What-if cost models (link scale, overrides, labels, presets' published bandwidths), the
prepared trace's acceptance and level probabilities, and `recharge`'s charge of a live trace's
cycles, by hand."""

from pathlib import Path

import numpy as np
import pytest

from specfit import CostModel
from specfit.calibrate.presets import QWEN3_30B_A3B, preset_profile
from specfit.errors import SpecFitError
from specfit.simulate.scenarios import build_scenario, link_gbps, scenario_label, unique_names
from specfit.simulate.whatif import apply_overrides, scale_h2d

from trace_helpers import hand_trace


@pytest.mark.parametrize("factor", [0.0, -1.0, float("inf"), float("nan")])
def test_scale_h2d_refuses_a_factor_that_is_not_finite_and_positive(factor):
    with pytest.raises(SpecFitError, match="--h2d-scale"):
        scale_h2d(CostModel(base_s=1.0, per_node_s=0.1, hit_s=0.01, miss_s=0.51), factor)


def test_overrides_that_leave_a_cycle_no_time_are_refused():
    free = CostModel(base_s=1.0, per_node_s=0.0, hit_s=0.0, miss_s=0.5)
    with pytest.raises(SpecFitError, match="--cost"):
        apply_overrides(free, {"base_s": 0.0})


def test_a_scenario_label_names_a_slower_link_too():
    assert scenario_label("pcie5", 0.5, {}) == "pcie5 x0.5 H2D"
    assert scenario_label("pcie5", 2.0, {"base_s": 0.004}) == "pcie5 x2 H2D (base_s=0.004)"
    assert scenario_label("calibrate/MY.json", 1.0, {}) == "MY"


def test_a_scenario_applies_the_overrides_and_the_link_scale_together():
    plain = preset_profile("pcie4", QWEN3_30B_A3B).cost
    s = build_scenario("pcie4", QWEN3_30B_A3B, h2d_scale=2.0, overrides={"base_s": 0.004})
    assert s.cost.base_s == 0.004
    assert s.cost.miss_s == pytest.approx(plain.hit_s + plain.transfer_s / 2)


def test_link_bandwidth_is_infinite_when_a_miss_costs_no_more_than_a_hit():
    cost = CostModel(base_s=1.0, per_node_s=0.1, hit_s=0.01, miss_s=0.01, expert_bytes=1000)
    assert link_gbps(cost) == float("inf")
    assert link_gbps(preset_profile("pcie5", QWEN3_30B_A3B).cost) == pytest.approx(50.0)


def test_unique_names_keep_the_whole_path_wherever_stems_collide():
    paths = [Path("a/t.parquet"), Path("b/t.parquet"), Path("d/u.parquet")]
    assert unique_names(paths) == ["a/t.parquet", "b/t.parquet", "u"]
    paths = [Path("a/t.parquet"), Path("b/t.parquet"), Path("c/t.parquet")]
    assert unique_names(paths) == ["a/t.parquet", "b/t.parquet", "c/t.parquet"]


def test_qwen3_preset_shape_and_compute_terms():
    # 3 matrices of 2048 x 768 in bf16: 9.44 MB per expert
    assert QWEN3_30B_A3B.expert_bytes == 3 * 2048 * 768 * 2
    cost = preset_profile("pcie4").cost
    # an H100 reads 9.44 MB at ~3 TB/s: a hit is microseconds, far below a PCIe copy
    assert 1e-6 < cost.hit_s < 2e-5 < cost.transfer_s


# --acceptance raw replays the drafter's probabilities, calibrated the calibrator's
def test_prepare_trace_uses_raw_or_calibrated_probabilities_as_asked():
    from specfit.experts.calibration import cross_calibrate
    from specfit.simulate.prepared import prepare_trace
    from specfit.traces.format import read_trace
    from trace_helpers import SAMPLE_OLMOE

    trace = read_trace(SAMPLE_OLMOE)
    raw = prepare_trace("s", trace, "oracle", "raw")
    calibrated = prepare_trace("s", trace, "oracle", "calibrated")
    assert np.array_equal(raw.raw_probs, trace.path_prob)
    assert np.allclose(calibrated.raw_probs, cross_calibrate(trace))
    assert not np.allclose(calibrated.raw_probs, trace.path_prob)


def _roots_only_trace():
    """The hand trace's three roots, nothing drafted."""
    t = hand_trace()
    keep = t.offsets[:-1]
    return type(t)(meta=t.meta, offsets=np.arange(4), sequence=t.sequence, position=t.position,
                   parent=t.parent[keep], depth=t.depth[keep], token=t.token[keep],
                   draft_logprob=t.draft_logprob[keep], path_prob=t.path_prob[keep], verdict=t.verdict[keep],
                   true_experts=t.true_experts[keep])


# with no draft node there is no wrong prediction: slot precision 1 (no uncertainty price)
def test_slot_precision_of_a_trace_without_draft_nodes_is_one():
    from specfit.simulate.prepared import prepare
    trace = _roots_only_trace()
    other = np.zeros_like(trace.true_experts)          # a predictor that would be wrong on any draft node
    prep = prepare("roots", trace, other)
    assert prep.info["predicted_slots"] == 0
    assert prep.info["slot_precision"] == 1.0


def _hand_live_trace():
    """The hand trace as a live recording (not position-indexed): cycle 0 verified root, A, C;
    cycle 1 both nodes; cycle 2 the root alone (50 was rejected); the prompt pass made e0 resident."""
    t = hand_trace()
    meta = {**t.meta, "recording": {"kind": "live", "position_indexed": False, "prefill_sequences": [0],
                                    "prefill_experts": [[[0]]]}}
    from dataclasses import replace
    return replace(t, meta=meta, verified=np.array([1, 1, 0, 1, 1, 1, 1, 0], dtype=bool))


# a recharge charges each cycle its drafted levels and its verified nodes
def test_recharge_charges_the_drafted_levels_and_the_verified_nodes_by_hand():
    from specfit import ExpertCache
    from specfit.simulate.recorded import recharge

    cost = CostModel(base_s=1.0, per_node_s=0.1, hit_s=0.01, miss_s=0.5, draft_level_s=0.2, expert_bytes=1000)
    frame = recharge(_hand_live_trace(), ExpertCache(1, 4, 4, expert_bytes=1000), cost)
    assert frame["nodes_verified"].tolist() == [3, 2, 1]
    # unions {0,1,3} (e0 resident from the prompt), {1,3}, {3}
    assert frame["hits"].tolist() == [1, 2, 1] and frame["misses"].tolist() == [2, 0, 0]
    # levels drafted 2, 1, 1: 0.2 per level + 1 + 0.1 per node + 0.01 per hit + 0.5 per miss
    assert frame["charged_time_s"].tolist() == pytest.approx([0.4 + 1 + 0.3 + 0.01 + 1.0, 0.2 + 1 + 0.2 + 0.02,
                                                              0.2 + 1 + 0.1 + 0.01])


# a tree cut at fewer levels has the compiled replay's level_probs exactly (the Python
# policies and the compiled ones see the same numbers even where the given values rise by rounding)
def test_a_cut_tree_has_the_level_probabilities_exactly():
    from specfit.simulate.prepared import prepare
    from specfit.traces.format import Trace

    t = hand_trace()
    eps = 4e-10                                     # below the tree's rounding slack (1e-9)
    probs = np.array([1.0, 0.5, 0.5 + eps, 0.5 + 2 * eps, 0.5 + 2 * eps])
    chain = Trace(meta=t.meta, offsets=np.array([0, 5]), sequence=np.zeros(1, dtype=np.int32),
                  position=np.zeros(1, dtype=np.int32), parent=np.array([-1, 0, 1, 2, 3], dtype=np.int16),
                  depth=np.arange(5, dtype=np.int16), token=np.array([10, 11, 12, 13, 14], dtype=np.int32),
                  draft_logprob=np.log(np.r_[1.0, probs[1:] / probs[:-1]]).astype(np.float32), path_prob=probs,
                  verdict=np.array([99, 12, 13, 14, 15], dtype=np.int32),
                  true_experts=np.array([0, 1, 2, 3, 0], dtype=np.int16).reshape(5, 1, 1))
    prep = prepare("chain", chain, chain.true_experts)
    assert np.array_equal(prep.tree(0).path_probs, prep.path_probs)
    assert np.array_equal(prep.tree(0, 3).path_probs, prep.level_probs[:4])
    assert prep.level_probs[3] != prep.path_probs[3]          # the case the two differ in
