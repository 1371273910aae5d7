"""CostModel: the cycle-time formula, counts and features, JSON round trip, bad input."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from core_helpers import core_settings, search_case_st
from specfit import CostModel, DraftTree

TREE = DraftTree(parents=np.array([-1, 0, 0, 1]), path_probs=np.array([1.0, 0.6, 0.3, 0.45]))
EXPERTS = np.array([
    [[0, 1], [2, 3]],
    [[1, 2], [2, 2]],     # a repeated expert counts once
    [[3, 0], [0, 1]],
    [[2, 1], [3, 0]],
])
CACHED = np.array([[True, False, True, False],
                   [False, False, True, True]])
# dyadic parameters: every sum below is exact in binary floating point
COST = CostModel(base_s=0.5, per_node_s=0.25, hit_s=0.0625, miss_s=1.0, draft_level_s=0.125)


@pytest.mark.parametrize("nodes, draft_levels, hits, misses, time_s", [
    # root: layer 0 {0, 1}: 0 hit, 1 miss; layer 1 {2, 3}: both hit
    ([0], 2, 3, 1, 0.25 + 0.5 + 0.25 + 3 * 0.0625 + 1.0),
    # {0, 1, 3}: layer 0 {0, 1, 2}: 0, 2 hit, 1 miss; layer 1 {0, 2, 3}: 2, 3 hit, 0 miss
    ([0, 1, 3], 2, 4, 2, 0.25 + 0.5 + 0.75 + 4 * 0.0625 + 2.0),
    ([3, 0, 1], 2, 4, 2, 0.25 + 0.5 + 0.75 + 4 * 0.0625 + 2.0),
    # everything: layer 0 {0, 1, 2, 3}: 2 hits, 2 misses; layer 1 {0, 1, 2, 3}: 2 hits, 2 misses
    ([0, 1, 2, 3], 0, 4, 4, 0.5 + 1.0 + 4 * 0.0625 + 4.0),
    # {0, 2}: layer 0 {0, 1, 3}: 0 hit, 1, 3 miss; layer 1 {0, 1, 2, 3}: 2, 3 hit, 0, 1 miss
    ([0, 2], 1, 3, 4, 0.125 + 0.5 + 0.5 + 3 * 0.0625 + 4.0),
])
def test_predict_equals_the_hand_computed_formula(nodes, draft_levels, hits, misses, time_s):
    assert COST.predict(TREE, nodes, EXPERTS, CACHED, draft_levels) == time_s
    assert COST.union_counts(EXPERTS, np.array(sorted(nodes)), CACHED) == (hits, misses)
    assert float(COST.predict_counts(draft_levels, len(nodes), hits, misses)) == time_s


def test_time_s_and_predict_counts_are_one_formula():
    # the scalar form, the array form and the formula written out agree bit for bit on real
    # (non-dyadic) parameters, where a different order of the five terms would round differently
    cost = CostModel(base_s=3.1e-3, per_node_s=4.3e-5, hit_s=1.7e-5, miss_s=3.9e-4, draft_level_s=7.7e-4)
    rng = np.random.default_rng(0)
    d, n, h, m = (rng.integers(0, hi, size=200) for hi in (9, 65, 400, 400))
    times = cost.predict_counts(d, n, h, m)
    assert times.dtype == np.float64 and times.shape == (200,)
    for i in range(200):
        by_hand = 7.7e-4 * float(d[i]) + 3.1e-3 + 4.3e-5 * float(n[i]) + 1.7e-5 * float(h[i]) + 3.9e-4 * float(m[i])
        assert cost.time_s(int(d[i]), int(n[i]), int(h[i]), int(m[i])) == by_hand == times[i]


@pytest.mark.parametrize("hit_s, miss_s, transfer_s", [(1e-5, 4e-4, 4e-4 - 1e-5), (2e-6, 2e-6, 0.0), (5e-5, 1e-5, 0.0)])
def test_transfer_s_is_what_a_miss_costs_beyond_a_hit(hit_s, miss_s, transfer_s):
    assert CostModel(base_s=1e-3, per_node_s=0.0, hit_s=hit_s, miss_s=miss_s).transfer_s == transfer_s


def test_predict_default_draft_levels_is_zero():
    assert COST.predict(TREE, [0, 1], EXPERTS, CACHED) == COST.predict(TREE, [0, 1], EXPERTS, CACHED, 0)


def test_features_are_draft_levels_one_nodes_hits_misses():
    f = CostModel.features(3, 5, 7, 11)
    assert np.asarray(f).tolist() == [3.0, 1.0, 5.0, 7.0, 11.0]
    params = np.array([COST.draft_level_s, COST.base_s, COST.per_node_s, COST.hit_s, COST.miss_s])
    assert np.allclose(np.asarray(COST.params), params, rtol=0, atol=0)
    rows = CostModel.features(np.array([0, 1, 2]), np.array([1, 2, 3]), 4, np.array([0, 5, 9]))
    assert rows.shape == (3, 5)
    assert rows.tolist() == [[0, 1, 1, 4, 0], [1, 1, 2, 4, 5], [2, 1, 3, 4, 9]]
    times = COST.predict_counts(np.array([0, 1, 2]), np.array([1, 2, 3]), 4, np.array([0, 5, 9]))
    assert np.asarray(times).tolist() == [
        0.5 + 0.25 + 0.25, 0.125 + 0.5 + 0.5 + 0.25 + 5.0, 0.25 + 0.5 + 0.75 + 0.25 + 9.0]
    assert np.allclose(rows @ params, times, rtol=1e-15, atol=0)


@core_settings(200)
@given(search_case_st(max_nodes=9), st.data())
def test_predict_matches_the_reference_formula_on_random_cases(case, data):
    ref = case.ref()
    chosen = data.draw(st.lists(st.integers(0, case.n - 1), max_size=case.n, unique=True))
    nodes = {0}
    for v in chosen:
        while v not in nodes:
            nodes.add(v)
            v = int(case.parents[v])
    nodes = sorted(nodes)
    _, time_s, hits, misses = ref.evaluate(nodes)
    model = case.cost
    got = model.predict(case.tree, nodes, case.experts, case.cached, case.draft_levels)
    assert math.isclose(got, time_s, rel_tol=1e-12, abs_tol=1e-300)
    assert model.union_counts(case.experts, np.array(nodes), case.cached) == (hits, misses)
    counted = float(model.predict_counts(case.draft_levels, len(nodes), hits, misses))
    assert math.isclose(counted, time_s, rel_tol=1e-12, abs_tol=1e-300)


def test_predict_rejects_a_selection_that_is_not_closed():
    with pytest.raises(ValueError, match="nodes"):
        COST.predict(TREE, [0, 3], EXPERTS, CACHED)
    with pytest.raises(ValueError, match="nodes"):
        COST.predict(TREE, [1], EXPERTS, CACHED)
    with pytest.raises(ValueError, match="nodes"):
        COST.predict(TREE, [0, 9], EXPERTS, CACHED)


def test_predict_rejects_mismatched_experts_and_cached():
    with pytest.raises(ValueError, match="experts"):
        COST.predict(TREE, [0], EXPERTS[:3], CACHED)
    with pytest.raises(ValueError, match="experts|cached"):
        COST.predict(TREE, [0], EXPERTS, CACHED[:1])
    with pytest.raises(ValueError, match="experts"):
        COST.predict(TREE, [0], EXPERTS, CACHED[:, :3])      # expert id 3 out of range
    with pytest.raises(ValueError, match="cached"):
        COST.predict(TREE, [0], EXPERTS, CACHED.astype(np.int8))


# --------------------------------------------------------------------------- persistence
def test_to_dict_from_dict_round_trip_through_json():
    model = CostModel(base_s=3e-3, per_node_s=4e-5, hit_s=1.5e-5, miss_s=2e-4, draft_level_s=8e-4)
    d = model.to_dict()
    for name in ("base_s", "per_node_s", "hit_s", "miss_s", "draft_level_s"):
        assert d[name] == getattr(model, name)
    again = CostModel.from_dict(json.loads(json.dumps(d)))
    assert again == model
    assert again.to_dict() == d
    assert again.predict(TREE, [0, 1], EXPERTS, CACHED, 1) == model.predict(TREE, [0, 1], EXPERTS, CACHED, 1)


def test_from_dict_defaults_the_draft_cost_to_zero():
    model = CostModel.from_dict({"base_s": 1.0, "per_node_s": 0.5, "hit_s": 0.0, "miss_s": 2.0})
    assert model.draft_level_s == 0.0
    assert model.predict(TREE, [0], EXPERTS, CACHED, draft_levels=5) == 1.0 + 0.5 + 0.0 + 2.0


@pytest.mark.parametrize("missing", ["base_s", "per_node_s", "hit_s", "miss_s"])
def test_from_dict_names_a_missing_field(missing):
    d = {"base_s": 1.0, "per_node_s": 0.5, "hit_s": 0.0, "miss_s": 2.0}
    del d[missing]
    with pytest.raises(ValueError, match=missing):
        CostModel.from_dict(d)


@pytest.mark.parametrize("field", ["base_s", "per_node_s", "hit_s", "miss_s", "draft_level_s"])
@pytest.mark.parametrize("value", [-1.0, float("nan"), "fast"])
def test_from_dict_names_a_bad_value(field, value):
    d = {"base_s": 1.0, "per_node_s": 0.5, "hit_s": 0.0, "miss_s": 2.0, "draft_level_s": 0.1}
    d[field] = value
    with pytest.raises(ValueError, match=field):
        CostModel.from_dict(d)


def test_from_dict_rejects_a_non_object():
    with pytest.raises(ValueError):
        CostModel.from_dict([1.0, 2.0, 3.0, 4.0])


def test_zero_costs_are_valid():
    model = CostModel(base_s=0.0, per_node_s=0.0, hit_s=0.0, miss_s=0.0, draft_level_s=0.0)
    assert model.predict(TREE, [0, 1, 2, 3], EXPERTS, CACHED, 3) == 0.0


def test_a_cost_model_is_frozen_so_its_checked_terms_stay_checked():
    import dataclasses

    cost = CostModel(base_s=1e-3, per_node_s=1e-4, hit_s=1e-5, miss_s=1e-3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cost.miss_s = float("nan")
    with pytest.raises(ValueError, match="miss_s"):
        cost.replace(miss_s=float("nan"))
    assert cost.miss_s == 1e-3
