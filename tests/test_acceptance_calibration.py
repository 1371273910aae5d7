"""The acceptance calibrator on drafters whose truth is known: edges learned given an accepted
parent (the chain rule), the depth correction, the rules a DraftTree needs, and the same path
probabilities live (TreeDraft) as on a trace."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specfit.experts.calibration import (AcceptanceCalibrator, accepted_nodes, cross_calibrate, edge_mask,
                                        edge_outcomes)
from specfit.traces.format import Trace, read_trace

from trace_helpers import SAMPLE_OLMOE, hand_trace

BRANCH, DEPTH = 2, 4
OTHER = 0                                   # the target's verdict when no child is its token


def complete_tree() -> tuple[np.ndarray, np.ndarray]:
    """(parents, depth) of a complete tree with BRANCH children per node, DEPTH levels, in level order."""
    parents, depth = [-1], [0]
    frontier = [0]
    for d in range(1, DEPTH + 1):
        nxt = []
        for p in frontier:
            for _ in range(BRANCH):
                parents.append(p)
                depth.append(d)
                nxt.append(len(parents) - 1)
        frontier = nxt
    return np.array(parents), np.array(depth)


def drifting_drafter_trace(seed: int, n_cycles: int, decay, sequences: int = 1) -> tuple[Trace, np.ndarray]:
    """Full trees whose every node was verified, and each node's true probability of lying on the
    accepted path. Below a node on the accepted path, a child at depth d is the target's verdict
    with probability q^2 decay^(d - 1) (q: the drafter's probability of it given its parent); below
    a rejected node the verdict follows the drafter's own q (the target continues a context it
    never keeps). ``decay``: one value, or one per cycle; ``sequences``: the cycles split into
    that many sequences of consecutive cycles."""
    rng = np.random.default_rng(seed)
    decays = np.broadcast_to(np.asarray(decay, dtype=np.float64), (n_cycles,))
    parents, depth = complete_tree()
    n = parents.size
    logprob, token, verdict, parent_col, depth_col, truth = [], [], [], [], [], []
    for c in range(n_cycles):
        decay = decays[c]
        q = np.ones(n)
        for p in range(n):
            children = np.flatnonzero(parents == p)
            if children.size:
                first = rng.uniform(0.5, 0.98)
                q[children] = [first, (1 - first) * rng.uniform(0.1, 0.9)]
        tokens = 100 + np.arange(n) + c * n       # distinct tokens: at most one child matches a verdict
        on_path = np.zeros(n, dtype=bool)
        on_path[0] = True
        verdicts = np.full(n, OTHER)
        for p in range(n):                        # level order: a parent's status is known first
            children = np.flatnonzero(parents == p)
            if not children.size:
                verdicts[p] = OTHER
                continue
            chance = q[children] ** 2 * decay ** (depth[children] - 1) if on_path[p] else q[children]
            i = int(np.searchsorted(np.cumsum(chance), rng.random(), side="right"))
            if i < children.size:
                verdicts[p] = tokens[children[i]]
                on_path[children[i]] = on_path[p]
        path = np.ones(n)
        for v in range(1, n):
            path[v] = path[parents[v]] * q[v] ** 2 * decay ** (depth[v] - 1)
        truth.append(path)
        logprob.append(np.log(q))
        token.append(tokens)
        verdict.append(verdicts)
        parent_col.append(parents)
        depth_col.append(depth)
    meta = hand_trace().meta
    sequence = (np.arange(n_cycles) * sequences) // n_cycles
    first = np.searchsorted(sequence, sequence)
    return Trace(meta=meta, offsets=np.arange(n_cycles + 1) * n, sequence=sequence.astype(np.int32),
                 position=(np.arange(n_cycles) - first).astype(np.int32), parent=np.concatenate(parent_col).astype(np.int16),
                 depth=np.concatenate(depth_col).astype(np.int16), token=np.concatenate(token).astype(np.int32),
                 draft_logprob=np.concatenate(logprob).astype(np.float32), path_prob=np.ones(n * n_cycles),
                 verdict=np.concatenate(verdict).astype(np.int32),
                 true_experts=np.zeros((n * n_cycles, 1, 1), dtype=np.int16)), np.concatenate(truth)


def predicted_over_true(calibrator, trace, truth, depth=None) -> float:
    """Summed path probabilities over the true ones (non-root nodes, at ``depth``): no sampling
    noise of a fresh trace's outcomes."""
    rows = trace.parent >= 0 if depth is None else trace.depth == depth
    return float(calibrator.path_probs(trace)[rows].sum() / truth[rows].sum())


@pytest.fixture(scope="module")
def steady():
    """A drafter whose acceptance does not drift with depth (fit trace, its true path probabilities)."""
    return drifting_drafter_trace(0, 1500, 1.0)


@pytest.fixture(scope="module")
def drifting():
    return drifting_drafter_trace(1, 1500, 0.8)


def test_accepted_nodes_by_hand():
    # hand trace: cycle 0 accepts A then C (root -> 11 -> 12), cycle 1 accepts 12, cycle 2 rejects 50
    assert accepted_nodes(hand_trace()).tolist() == [True, True, False, True, True, True, True, False]


def test_edge_outcomes_given_the_parent_accepted_leave_out_children_of_rejected_nodes():
    trace = hand_trace()
    trace.verdict[1] = 77                 # the target rejects C after A ... and A itself:
    trace.verdict[0] = 20                 # the root's verdict is B's token, so A is rejected
    # every node whose parent has a verdict: A, B, C (cycle 0), 12 (cycle 1), 50 (cycle 2)
    assert edge_mask(trace, given_parent_accepted=False).tolist() == [False, True, True, True, False, True, False,
                                                                      True]
    # C's parent A is rejected: its outcome is not one the chain rule multiplies
    assert edge_mask(trace).tolist() == [False, True, True, False, False, True, False, True]
    q, accepted = edge_outcomes(trace)
    assert q == pytest.approx([0.9, 0.05, 0.5, 0.4]) and accepted.tolist() == [0, 1, 1, 0]


def test_edges_of_rejected_parents_would_bias_the_edge_map(steady):
    trace, truth = steady
    chain_rule = AcceptanceCalibrator(confidence=False, depth_correction=False).fit(trace)
    every_verified = AcceptanceCalibrator(given_parent_accepted=False, confidence=False,
                                          depth_correction=False).fit(trace)
    # the product of edges learned given an accepted parent is the drafter's truth at every
    # depth; learned on every verified parent it also learns the children of rejected ones
    for d in range(1, DEPTH + 1):
        assert predicted_over_true(chain_rule, trace, truth, d) == pytest.approx(1.0, abs=0.06), d
        assert predicted_over_true(every_verified, trace, truth, d) > 1.3, d
    # the edge map is the drafter's truth, q^2, on the edges it learned from
    q, _ = edge_outcomes(trace)
    assert np.mean(np.abs(chain_rule.predict_edge(q) - q ** 2)) < 0.04


def test_the_depth_correction_follows_a_drafter_that_drifts_with_depth(drifting):
    trace, truth = drifting
    product = AcceptanceCalibrator(depth_correction=False).fit(trace)
    corrected = AcceptanceCalibrator().fit(trace)
    assert corrected.coef_ is not None and corrected.max_depth_ == DEPTH
    # the pooled edge map is right on average, so the product over-predicts deep nodes
    assert predicted_over_true(product, trace, truth, DEPTH) > 1.8
    for d in range(1, DEPTH):
        assert predicted_over_true(corrected, trace, truth, d) == pytest.approx(1.0, abs=0.1), d
    # the correction is linear in depth; a drafter that loses a share of its acceptance at every
    # level (quadratic in depth on the path's log scale) keeps part of its error at the deepest
    error = [abs(np.log(predicted_over_true(c, trace, truth, DEPTH))) for c in (product, corrected)]
    assert error[1] < 0.6 * error[0]
    assert predicted_over_true(corrected, trace, truth) == pytest.approx(1.0, abs=0.05)
    fresh, _ = drifting_drafter_trace(2, 1500, 0.8)
    scored = fresh.parent >= 0
    outcome = accepted_nodes(fresh)[scored]
    brier = [np.mean((c.path_probs(fresh)[scored] - outcome) ** 2) for c in (product, corrected)]
    assert brier[1] < brier[0]


def test_a_steady_drafter_keeps_its_probabilities_with_every_refinement_on(steady):
    trace, truth = steady
    calibrator = AcceptanceCalibrator().fit(trace)
    for d in range(1, DEPTH + 1):
        assert predicted_over_true(calibrator, trace, truth, d) == pytest.approx(1.0, abs=0.08), d


def test_calibrated_trees_are_valid_and_the_correction_is_monotone(drifting):
    fit, _ = drifting
    cal = AcceptanceCalibrator().fit(fit)
    probs = cal.path_probs(fit)
    root = fit.parent < 0
    assert (probs[root] == 1.0).all() and (probs > 0).all()
    assert (probs[~root] <= probs[fit.parent_rows[~root]] + 1e-12).all()
    grid = np.linspace(0.01, 1.0, 60)
    for d in range(1, DEPTH + 3):                       # deeper than fitted: the deepest depth's map
        assert np.all(np.diff(cal.path_from_product(grid, np.full(grid.size, d))) > 0)
    np.testing.assert_array_equal(cal.path_from_product(grid, np.full(grid.size, DEPTH + 2)),
                                  cal.path_from_product(grid, np.full(grid.size, DEPTH)))


def test_the_compiled_maps_are_the_fitted_models(drifting):
    """The edge map is the fitted logistic refinement of the isotonic map on the fit's own features
    (kernels.acceptance computes them per edge); a level calibrated in one call (the live drafter's)
    equals the maps applied in turn: edges multiplied along the path, then depth-corrected, never
    above the parent, and NaN draft probabilities stay NaN for the drafter's check to see."""
    fit, _ = drifting
    cal = AcceptanceCalibrator().fit(fit)
    assert cal.edge_coef_ is not None and cal.coef_ is not None
    rng = np.random.default_rng(4)
    q = rng.random(400)
    top = np.maximum(q, rng.random(400))
    z = cal.edge_coef_[0] + cal._confidence_features(q, top) @ cal.edge_coef_[1:]
    np.testing.assert_allclose(cal.predict_edge(q, top), np.maximum(1 / (1 + np.exp(-z)), cal.min_prob), rtol=1e-12)
    # a level of 3 expanded nodes x 4 children under a tree of 4 nodes
    width, parents = 4, np.repeat(np.array([1, 2, 3]), 4)
    depth = np.zeros(16, dtype=np.int64)
    depth[1:4], depth[4:] = 1, 2
    edge_lp = np.sort(np.log(rng.random((3, width))), axis=1)[:, ::-1].ravel().copy()   # first child: the top
    new = np.arange(4, 16)
    edge_product, path = np.ones(16), np.ones(16)
    edge_product[1:4], path[1:4] = [0.9, 0.5, 0.2], [0.9, 0.4, 0.003]
    want_edge = edge_product[parents] * cal.predict_edge(np.exp(edge_lp), np.repeat(np.exp(edge_lp[::width]), width))
    want_path = np.minimum(path[parents], cal.path_from_product(want_edge, depth[new]))
    cal.calibrate_level(edge_lp, width, new, parents, depth, edge_product, path)
    np.testing.assert_array_equal(edge_product[new], want_edge)
    np.testing.assert_array_equal(path[new], want_path)
    assert (path[new] == path[parents]).any()            # the parent's bound is reached on the third node
    edge_lp[5] = np.nan
    cal.calibrate_level(edge_lp, width, new, parents, depth, edge_product, path)
    assert np.isnan(path[new]).sum() == 1 and np.isnan(path[9])


def test_too_few_outcomes_leave_the_product_alone():
    trace = hand_trace()
    cal = AcceptanceCalibrator().fit(trace)
    assert cal.coef_ is None
    np.testing.assert_allclose(cal.path_from_product([0.2, 0.7], [1, 3]), [0.2, 0.7])


def test_round_trip_and_calibrators_written_before_the_correction(drifting):
    fit, _ = drifting
    cal = AcceptanceCalibrator().fit(fit)
    back = AcceptanceCalibrator.from_dict(json.loads(json.dumps(cal.to_dict())))
    np.testing.assert_allclose(back.path_probs(fit), cal.path_probs(fit))
    assert back.get_params() == cal.get_params()
    old = {"calibrator": "isotonic", "min_prob": 1e-4, "x_": [0.0, 1.0], "y_": [0.0, 0.5], "brier_": 0.1, "n_edges_": 9}
    before = AcceptanceCalibrator.from_dict(old)
    assert before.coef_ is None and not before.given_parent_accepted
    np.testing.assert_allclose(before.path_from_product([0.25], [2]), [0.25])


def test_the_shipped_trace_is_predicted_within_a_few_percent_held_out():
    olmoe = read_trace(SAMPLE_OLMOE)
    nodes = (olmoe.parent >= 0) & (olmoe.verdict[np.maximum(olmoe.parent_rows, 0)] >= 0)
    truth = accepted_nodes(olmoe)[nodes].sum()
    now = cross_calibrate(olmoe)[nodes].sum() / truth
    before = cross_calibrate(olmoe, given_parent_accepted=False, confidence=False, depth_correction=False)[nodes].sum()
    assert abs(now - 1) < 0.04 and before / truth > 1.08


@pytest.mark.parametrize("params", [{}, {"depth_correction": False}, {"min_nodes": 10**9}])
def test_the_cross_fit_equals_a_fit_then_a_prediction_per_fold(params):
    """The cross-fit hands the depth fit's path products to the prediction: exactly what a
    calibrator fitted on the other folds predicts for the fold on its own."""
    from specfit.experts.predictors import cycle_folds

    olmoe = read_trace(SAMPLE_OLMOE)
    fold = cycle_folds(olmoe, 2)[olmoe.cycle_of_node]
    expected = np.ones(olmoe.n_nodes)
    for f in (0, 1):
        train = np.flatnonzero(cycle_folds(olmoe, 2) != f)
        expected[fold == f] = AcceptanceCalibrator(**params).fit(olmoe, train).path_probs(olmoe)[fold == f]
    np.testing.assert_array_equal(cross_calibrate(olmoe, **params), expected)


def test_a_trace_recorded_workload_by_workload_is_calibrated_on_every_workload():
    """Sequences 0-3 from one drafter, 4-7 from one whose deep acceptance decays. The cross-fit
    deals whole sequences to the folds in turn, so each fold's maps see both drafters and predict
    each half as a map fitted on every cycle does (in contiguous blocks, each half would be scored
    by the other drafter's map alone: 0.34x and 2.8x of the truth at depth >= 2 here, against 0.7x
    and 1.8x for one map of both)."""
    trace, truth = drifting_drafter_trace(3, 800, np.repeat([1.0, 0.6], 400), sequences=8)
    crossed = cross_calibrate(trace)
    fitted_on_all = AcceptanceCalibrator().fit(trace).path_probs(trace)
    deep = trace.depth >= 2
    for half in (trace.cycle_of_node < 400, trace.cycle_of_node >= 400):
        rows = half & deep
        assert crossed[rows].sum() / truth[rows].sum() == pytest.approx(
            fitted_on_all[rows].sum() / truth[rows].sum(), rel=0.05)


def test_calibrated_path_probabilities_never_exceed_the_parents():
    from specfit.experts.calibration import AcceptanceCalibrator

    # a depth correction that raises deeper nodes (c > 0): the product alone would put C above A
    cal = AcceptanceCalibrator.from_dict({"x_": [0.0, 1.0], "y_": [0.0, 1.0], "coef_": [0.0, 1.0, 3.0, 0.0],
                                          "max_depth_": 2})
    trace = hand_trace()
    probs = cal.path_probs(trace)
    root = trace.parent < 0
    assert np.all(probs[~root] <= probs[trace.parent_rows[~root]])
    assert probs[3] == probs[1]     # C is held at its parent A's probability


def test_depth_correction_with_an_interaction_must_be_monotone_at_the_deepest_depth(monkeypatch):
    import specfit.experts.calibration as calibration

    class Fitted:            # logistic fits with known weights: b = 1, e = -0.5 (b + e d = 0 at d = 2)
        def __init__(self, **kwargs):
            pass

        def fit(self, x, y):
            self.coef_ = np.array([[1.0, 0.0, -0.5]]) if x.shape[1] == 3 else np.array([[1.0, 0.0]])
            self.intercept_ = np.array([0.0])
            return self

    monkeypatch.setattr("sklearn.linear_model.LogisticRegression", Fitted)   # the calibrator imports it when it fits
    cal = calibration.AcceptanceCalibrator(confidence=False, min_nodes=1).fit(hand_trace())   # depths 1 and 2
    assert cal.max_depth_ == 2
    np.testing.assert_array_equal(cal.coef_, [0.0, 1.0, 0.0, 0.0])     # the fit without the interaction
