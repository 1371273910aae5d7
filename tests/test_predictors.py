"""Expert predictors and the acceptance calibrator: fit/predict/round trip, no leakage, quality."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from specfit.errors import SpecFitError
from specfit.experts.calibration import AcceptanceCalibrator, cross_calibrate, edge_mask, edge_outcomes, edge_probs
from specfit.experts.predictors import (AffinityPredictor, ExpertPredictor, ParentPredictor, cross_predict,
                                        cycle_folds, last_known_experts, make_predictor, predictor_from_dict,
                                        union_quality)
from specfit.experts.predictor_base import NodeBatch
from specfit.traces.format import read_trace
from specfit.traces.stats import set_overlap

from trace_helpers import SAMPLE_OLMOE, hand_trace


@pytest.fixture(scope="module")
def olmoe():
    return read_trace(SAMPLE_OLMOE)


def test_last_known_routing_is_the_previous_root(olmoe):
    last = last_known_experts(olmoe)
    roots = olmoe.offsets[:-1]
    assert (last[0] == -1).all()
    np.testing.assert_array_equal(last[1], olmoe.true_experts[roots[0]])
    first_of_second = np.flatnonzero(olmoe.sequence == 1)[0]
    assert (last[first_of_second] == -1).all()   # a new sequence knows nothing yet


def test_oracle_is_exact_and_parent_repeats_the_last_routing(olmoe):
    np.testing.assert_array_equal(make_predictor("oracle").predict_trace(olmoe), olmoe.true_experts)
    parent = ParentPredictor().fit(olmoe)
    pred = parent.predict_trace(olmoe, [5])
    assert (pred == last_known_experts(olmoe)[5]).all()   # every node of the cycle, siblings alike


def test_the_oracle_is_the_traces_own_array_and_refuses_a_trace_with_unknown_experts(olmoe):
    oracle = make_predictor("oracle")
    assert oracle.predict_trace(olmoe) is olmoe.true_experts       # no copy: the replay skips a second union
    np.testing.assert_array_equal(oracle.predict_trace(olmoe, [3, 5]),
                                  olmoe.true_experts[np.r_[olmoe.offsets[3]:olmoe.offsets[4], olmoe.offsets[5]:olmoe.offsets[6]]])
    true = olmoe.true_experts.copy()
    true[olmoe.offsets[5] + 1] = -1                                  # one node of cycle 5 unknown
    blind = dataclasses.replace(olmoe, true_experts=true)
    for cycles in (None, [5], [4, 5]):
        with pytest.raises(SpecFitError, match="--predictor oracle: the trace does not know every node's true experts"):
            oracle.predict_trace(blind, cycles)
    np.testing.assert_array_equal(oracle.predict_trace(blind, [4]), true[olmoe.offsets[4]:olmoe.offsets[5]])


def test_affinity_learns_a_seen_token_exactly():
    trace = hand_trace()
    model = AffinityPredictor(prior_strength=0.0, sample=False).fit(trace)
    pred = model.predict_trace(trace)
    np.testing.assert_array_equal(pred[trace.token == 50], [[[0]]])   # token 50 always routed to e0
    back = AffinityPredictor.from_dict(json.loads(json.dumps(model.to_dict())))
    np.testing.assert_array_equal(back.predict_trace(trace), pred)


def test_affinity_siblings_get_different_predictions(olmoe):
    pred = cross_predict("affinity", olmoe)
    r = olmoe.rows(10)
    parents = olmoe.parent[r]
    kids = np.flatnonzero(parents == 0)
    assert len({pred[r][k].tobytes() for k in kids}) == kids.size


def test_cross_fitting_never_sees_the_predicted_fold(olmoe):
    folds = cycle_folds(olmoe, 2)
    seqs = np.unique(olmoe.sequence)
    for i, s in enumerate(seqs):                  # whole sequences, dealt to the folds in turn
        assert set(folds[olmoe.sequence == s]) == {i % 2}
    # a predictor fitted on all cycles would reproduce the nodes it was fitted on far better than
    # a cross-fitted one reproduces unseen ones (per node: share of the true top-k predicted)
    fitted_on_all = AffinityPredictor(sample=False).fit(olmoe).predict_trace(olmoe)
    cross = cross_predict("affinity", olmoe, sample=False)
    seen = set_overlap(fitted_on_all, olmoe.true_experts).mean()
    unseen = set_overlap(cross, olmoe.true_experts).mean()
    assert seen > unseen + 0.1
    assert unseen > 0.2   # still better than chance (8 of 64 experts: 0.125)


def test_make_predictor_rejects_unknown_names_and_recorded_needs_data(olmoe):
    with pytest.raises(SpecFitError, match="unknown predictor 'crystal'"):
        make_predictor("crystal")
    with pytest.raises(SpecFitError, match="no recorded predictions"):
        make_predictor("recorded").predict_trace(olmoe)
    assert isinstance(predictor_from_dict({"predictor": "oracle"}), ExpertPredictor)


def test_union_quality_counts():
    pred = np.array([[[0, 1]], [[1, 2]]])
    true = np.array([[[1, 3]], [[3, 0]]])
    assert union_quality(pred, true, 4) == (3, 3, 2)


def test_calibrator_is_monotone_and_matches_acceptance(olmoe):
    cal = AcceptanceCalibrator().fit(olmoe)
    grid = np.linspace(0, 1, 50)
    # increasing in the node's own probability: a runner-up's (its top sibling's fixed) and a top child's
    for top in (0.3, 0.6, 0.95):
        assert np.all(np.diff(cal.predict_edge(grid[:-1] * top, np.full(49, top))) >= 0)
    assert np.all(np.diff(cal.predict_edge(grid, grid)) >= 0)
    q, accepted = edge_outcomes(olmoe)
    q_all, top_all = edge_probs(olmoe)
    mask = edge_mask(olmoe)
    np.testing.assert_array_equal(q_all[mask], q)
    # calibrated probabilities average to the observed acceptance (isotonic regression and the
    # logistic refinement's intercept preserve it)
    assert abs(cal.predict_edge(q, top_all[mask]).mean() - accepted.mean()) < 0.01
    back = AcceptanceCalibrator.from_dict(json.loads(json.dumps(cal.to_dict())))
    np.testing.assert_allclose(back.predict_edge(grid, np.ones(50)), cal.predict_edge(grid, np.ones(50)))


def test_calibrated_path_probabilities_are_valid_trees(olmoe):
    probs = cross_calibrate(olmoe)
    for c in (0, 50, 200):
        r = olmoe.rows(c)
        from specfit.tree import DraftTree

        DraftTree(parents=olmoe.parent[r].astype(np.int64), path_probs=probs[r])   # validates monotonicity
    assert probs[olmoe.offsets[:-1]].tolist() == [1.0] * olmoe.n_cycles


def test_affinity_learned_online_equals_fitted_on_the_same_routings(olmoe):
    """The live decoder learns the table cycle by cycle (update); the simulator fits it on a trace at
    once. On the same routed tokens both give the same table and the same predictions."""
    known = olmoe.true_known
    fitted = AffinityPredictor(sample=False).fit(olmoe)
    online = AffinityPredictor(sample=False)
    rows = np.flatnonzero(known)
    for chunk in np.array_split(rows, 7):                 # in several updates, as cycles come
        online.update(olmoe.token[chunk], olmoe.true_experts[chunk], olmoe.n_experts)
    for name in ("tokens_", "occurrences_", "keys_", "counts_"):
        np.testing.assert_array_equal(getattr(online, name), getattr(fitted, name), err_msg=name)
    np.testing.assert_allclose(online.popularity_, fitted.popularity_)
    np.testing.assert_array_equal(online.predict_trace(olmoe, [3, 4]), fitted.predict_trace(olmoe, [3, 4]))


@pytest.mark.parametrize("precision", [0.0, 0.3, 0.8, 1.0])
def test_noisy_oracle_is_wrong_in_the_share_of_slots_it_is_told(olmoe, precision):
    """Each slot keeps its true expert with probability ``precision``; a wrong one names an expert
    the node does not route to at that layer, never twice in a node's layer."""
    from specfit.experts.predictors import slots_right

    pred = cross_predict(f"noisy:{precision}", olmoe)
    true = olmoe.true_experts
    n_slots = pred.size
    right = slots_right(pred, true)
    # binomial: 5 standard deviations around the expected count
    sd = np.sqrt(n_slots * precision * (1 - precision))
    assert abs(right - precision * n_slots) <= 5 * sd + 1e-9
    ordered = np.sort(pred, axis=2)
    assert not (ordered[:, :, 1:] == ordered[:, :, :-1]).any()          # distinct picks per layer
    assert ((pred >= 0) & (pred < olmoe.n_experts)).all()
    changed = pred != true
    in_true = (pred[:, :, :, None] == true[:, :, None, :]).any(axis=3)
    assert not in_true[changed].any()                # a replaced slot is an expert the node does not use
    np.testing.assert_array_equal(cross_predict(f"noisy:{precision}", olmoe), pred)    # the same draw again


def test_noisy_oracle_where_a_node_routes_to_every_expert_keeps_them():
    from specfit.experts.predictors import NoisyOraclePredictor, NodeBatch

    true = np.array([[[0, 1], [1, 0]], [[1, 0], [0, 1]]], dtype=np.int16)      # 2 nodes, 2 layers, top-2 of 2
    noisy = NoisyOraclePredictor(precision=0.0)
    noisy.n_experts_ = 2
    batch = NodeBatch(tokens=np.zeros(2, dtype=np.int64), last_known=np.full((2, 2, 2), -1), true_experts=true)
    np.testing.assert_array_equal(noisy.predict(batch), true)       # no expert is left to be wrong with
    with pytest.raises(SpecFitError, match="fit it on a trace first"):
        NoisyOraclePredictor(0.5).predict(batch)
    with pytest.raises(SpecFitError, match="true experts"):
        noisy.predict(NodeBatch(tokens=np.zeros(2, dtype=np.int64), last_known=np.full((2, 2, 2), -1)))


@pytest.mark.parametrize("spec, message", [
    ("noisy:1.5", "slot precision P in \\[0, 1\\], got 'noisy:1.5'"),
    ("noisy:x", "slot precision P in \\[0, 1\\], got 'noisy:x'"),
    ("noisy:nan", "slot precision P in \\[0, 1\\], got 'noisy:nan'"),
    ("parent:0.5", "parent takes no argument, got 'parent:0.5'"),
    ("crystal:0.5", "unknown predictor 'crystal:0.5'"),
])
def test_predictor_specs_are_checked_with_one_clear_error(spec, message):
    from specfit.simulate.scenarios import check_replay_options

    with pytest.raises(SpecFitError, match=message):
        make_predictor(spec)
    with pytest.raises(SpecFitError, match="sweep.yaml: field 'predictor': "):
        check_replay_options(spec, "calibrated", "per_layer", "lru", source="sweep.yaml")


def _batch(tokens, last):
    return NodeBatch(tokens=np.asarray(tokens, dtype=np.int64),
                     last_known=np.asarray(last, dtype=np.int64).reshape(len(tokens), 1, 1))


def test_parent_predictor_falls_back_on_the_most_popular_expert():
    trace = hand_trace()            # true experts 0 1 2 3 1 3 3 0: expert 3 is the layer's most popular
    p = ParentPredictor().fit(trace)
    got = p.predict(_batch([11, 12], [-1, 2]))
    assert got[0, 0, 0] == 3        # nothing known: the most popular expert
    assert got[1, 0, 0] == 2        # known: the last routing


def test_cycle_folds_are_contiguous_blocks_for_fewer_sequences_than_folds():
    trace = hand_trace()            # one sequence, three cycles
    np.testing.assert_array_equal(cycle_folds(trace, 2), [0, 0, 1])
    np.testing.assert_array_equal(cycle_folds(trace, 3), [0, 1, 2])


def _table(prior_strength=1.0, reuse_weight=0.5):
    p = AffinityPredictor(prior_strength=prior_strength, reuse_weight=reuse_weight, sample=False)
    # token 9 seen four times with expert 3 (expert 3 most popular), token 5 once with expert 2
    p.update(np.array([9, 9, 9, 9, 5]), np.array([3, 3, 3, 3, 2]).reshape(5, 1, 1), n_experts=4)
    return p


def test_affinity_uses_a_last_known_routing_that_starts_with_expert_0():
    p = _table(reuse_weight=1.0)    # an unseen token: its score is the last known routing alone
    assert p.predict(_batch([7], [0]))[0, 0, 0] == 0


def test_affinity_unseen_token_is_not_mistaken_for_its_sorted_neighbour():
    # prior_strength 0: a seen token's own routing is all; an unseen one (2 sorts before 5 and 9)
    # keeps the blend of the last known routing and popularity
    p = _table(prior_strength=0.0)
    assert p._occurrences(np.array([2, 5, 9, 10])).tolist() == [0, 1, 4, 0]
    assert p.predict(_batch([2], [1]))[0, 0, 0] == 1


def test_affinity_blend_weights_the_table_by_w_and_the_rest_by_1_minus_w():
    # token 5 seen once: w = 1/2. expert 2 scores 1/2 * 1 + 1/2 * (1/2 pop2); the last known expert 3
    # scores 1/2 * (1/2 + 1/2 pop3): the token's own expert wins although expert 3 is more popular
    p = _table()
    assert p.predict(_batch([5], [3]))[0, 0, 0] == 2
