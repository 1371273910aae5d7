"""Importing a routing log: expert ids against the model, --max-tokens, the shape a log is read as, the routing model's vocabulary."""

from __future__ import annotations

import numpy as np
import pytest

from specfit.errors import SpecFitError
from specfit.traces.drafter import DrafterParams
from specfit.traces.importers import RoutingLog, import_routing, model_for_log

SMALL_DRAFTER = DrafterParams(width=2, depth=3)


def _log(n_tokens=12, n_seq=1, largest=None, seed=0, weights=False):
    rng = np.random.default_rng(seed)
    experts = np.stack([rng.permutation(64)[:8] for _ in range(n_tokens * 16)]).reshape(n_tokens, 16, 8)
    if largest is not None:
        experts[0, 0, 0] = largest
    w = rng.random(experts.shape).astype(np.float32) if weights else None
    return RoutingLog(experts, rng.integers(0, 1000, n_tokens), np.repeat(np.arange(n_seq), n_tokens // n_seq), "mem",
                      weights=w)


def test_importer_rejects_an_expert_id_equal_to_the_model_expert_count():
    log = _log()
    model = model_for_log(log, None)
    assert model["n_experts"] == 64
    log.experts[0, 0, 0] = 64
    with pytest.raises(SpecFitError, match="expert ids must be in"):
        import_routing(log, model, drafter=SMALL_DRAFTER)


def test_model_for_log_refuses_a_log_whose_largest_expert_id_equals_every_shapes_expert_count():
    with pytest.raises(SpecFitError, match="out of range"):
        model_for_log(_log(largest=64), None)


def test_importer_max_tokens_keeps_that_many_positions():
    log = _log(n_tokens=12)
    trace = import_routing(log, model_for_log(log, None), drafter=SMALL_DRAFTER, max_tokens=5)
    assert trace.n_cycles == 5


def test_importers_routing_model_covers_the_logs_largest_token_id():
    from specfit.traces.importers import import_routing_and_model

    log = _log(n_tokens=12)
    model = dict(model_for_log(log, None))
    model.pop("vocab_size", None)                # the vocabulary comes from the log's own token ids
    _, router = import_routing_and_model(log, model, drafter=SMALL_DRAFTER)
    likely = router.likely_experts(log.tokens)
    assert likely.shape == log.experts.shape
    assert router.preferences(np.array([log.tokens.max()])).shape == (1, 16, 8)


def test_the_trace_keeps_the_logs_id_of_each_sequence_and_counts_the_one_token_ones_left_out():
    rng = np.random.default_rng(3)
    lengths = {42: 5, 7: 1, 3: 4, 900: 6}          # first-seen order; sequence 7 has no second token
    experts = np.stack([rng.permutation(64)[:8] for _ in range(16 * sum(lengths.values()))]).reshape(-1, 16, 8)
    ids = np.concatenate([np.full(n, s) for s, n in lengths.items()])
    log = RoutingLog(experts, rng.integers(0, 1000, ids.size), ids, "mem")
    trace = import_routing(log, model_for_log(log, None), drafter=SMALL_DRAFTER)
    recording = trace.meta["recording"]
    assert recording["source_sequence_ids"] == [42, 3, 900]
    assert recording["one_token_sequences_skipped"] == 1
    # trace sequence s is the log's source_sequence_ids[s]: its cycles are that sequence's positions
    for s, source in enumerate(recording["source_sequence_ids"]):
        assert int((trace.sequence == s).sum()) == lengths[source] - 1
        first_root = trace.offsets[:-1][trace.sequence == s][0]
        np.testing.assert_array_equal(trace.true_experts[first_root], experts[np.flatnonzero(ids == source)[0]])
    # --max-tokens stops at a sequence boundary's budget: only the sequences imported are named
    assert import_routing(log, model_for_log(log, None), drafter=SMALL_DRAFTER,
                          max_tokens=4).meta["recording"]["source_sequence_ids"] == [42]
