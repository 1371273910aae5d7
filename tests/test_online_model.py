"""The online cost model (:class:`specfit.calibrate.online.OnlineCostModel`): when it first refits, its age weights, its pace slope, the update cost of a first cycle."""

from __future__ import annotations

import math

import numpy as np
import pytest

from specfit.calibrate.online import OnlineCostModel
from specfit.costmodel import CostModel

COST = CostModel(base_s=4e-3, per_node_s=1e-4, hit_s=2e-4, miss_s=3e-4, draft_level_s=8e-4)


def test_online_model_min_cycles_above_the_window_refits_once_the_window_is_full():
    online = OnlineCostModel(COST, window=4, min_cycles=8, refit_every=100)
    assert online.min_cycles == 4
    for _ in range(4):
        online.observe(0, 1, 12, 4, 2 * COST.time_s(0, 1, 12, 4))
    assert online.n_refits == 1


def test_online_model_overhead_of_the_first_cycle_teaches_no_update_cost():
    online = OnlineCostModel(COST, window=64, min_cycles=64)
    online.observe(0, 1, 12, 4, COST.time_s(0, 1, 12, 4) + 5e-3, overhead_s=5e-3)
    assert all(v == 0.0 for v in online.state()["update_s"].values())


def test_online_model_weighs_the_newest_cycle_one_and_the_oldest_least(monkeypatch):
    online = OnlineCostModel(COST, window=8, min_cycles=8, refit_every=8, refit_interval_s=0.0, half_life=2.0)
    seen = []
    solve = online._fitter.solve

    def spy(features, times, **kw):
        seen.append((online.n_seen, np.array(kw["sample_weight"])))
        return solve(features, times, **kw)

    monkeypatch.setattr(online._fitter, "solve", spy)
    for _ in range(20):
        online.observe(0, 1, 12, 4, COST.time_s(0, 1, 12, 4))
    assert [n for n, _ in seen] == [8, 16]
    for n_seen, w in seen:
        newest = (n_seen - 1) % 8
        assert w[newest] == pytest.approx(1.0)
        assert w.argmin() == n_seen % 8                  # the oldest cycle in the window
        assert w.min() == pytest.approx(0.5 ** (7 / 2.0))


def test_online_model_pace_slope_is_at_most_one():
    online = OnlineCostModel(COST, window=256, min_cycles=256, speed_half_life=None, pace_half_life=1.0)
    rng = np.random.default_rng(0)
    for _ in range(60):
        drafter_s = 4 * 8e-4 * math.exp(rng.normal(0, 0.3))
        deviation = online._pace_deviation(drafter_s, 4) or 0.0
        fitted = online.fitted.time_s(4, 20, 12, 4)
        online.observe(4, 20, 12, 4, fitted * math.exp(3.0 * deviation), priced=(12, 4), drafter_s=drafter_s)
    assert online.pace_slope == 1.0


def test_a_term_whose_column_leaves_the_window_is_held_at_the_prior_not_zeroed():
    """Misses stop once the cache has warmed up: between two selections a refit reuses the last
    one, whose fitted transfer term then has no column; it is selected again and held at the
    profile's value, not set to 0 (a miss priced as a hit until the next selection, before)."""
    rng = np.random.default_rng(0)
    true = CostModel(base_s=0.010, per_node_s=0.001, hit_s=0.0002, miss_s=0.0022, draft_level_s=0.002)
    prior = true.replace(miss_s=0.0012)
    online = OnlineCostModel(prior, refit_interval_s=0.0)
    transfer = []
    for cycle in range(1, 73):
        d, n, h = int(rng.integers(1, 5)), int(rng.integers(1, 12)), int(rng.integers(10, 60))
        m = int(rng.integers(5, 40)) if cycle <= 16 else 0
        online.observe(d, n, h, m, true.time_s(d, n, h, m) * (1 + 0.01 * rng.standard_normal()))
        if cycle % 8 == 0:
            transfer.append(online.fitted.transfer_s)
    assert transfer[0] == pytest.approx(0.002, rel=0.05)         # fitted while the misses are in the window
    assert min(transfer) > 0 and transfer[-1] == pytest.approx(prior.transfer_s)


def test_a_refit_that_prices_a_cached_root_at_zero_keeps_the_fit_it_had(monkeypatch):
    """On a loaded machine a window's hit and level terms explained the cycles whole: the refit's
    base and per-node terms were 0 with hit_s 0 too, the next search met a root predicted to take
    0 s and the decode ended in a ValueError. Every cycle runs a target pass: such a refit is not kept."""
    online = OnlineCostModel(COST, window=8, min_cycles=8, refit_every=8, refit_interval_s=0.0)
    for _ in range(8):
        online.observe(0, 1, 12, 4, COST.time_s(0, 1, 12, 4))
    kept = online.fitted
    assert online.n_refits == 1 and kept.base_s + kept.per_node_s > 0
    solve = online._fitter.solve

    def explained_by_the_misses(features, times, **kw):
        theta, info = solve(features, times, **kw)
        return np.array([theta[0], 0.0, 0.0, 0.0, theta[4] + theta[3]]), info

    monkeypatch.setattr(online._fitter, "solve", explained_by_the_misses)
    for _ in range(8):
        online.observe(0, 1, 12, 4, COST.time_s(0, 1, 12, 4))
    assert online.n_refits == 1 and online.fitted == kept
    assert online.cost.time_s(0, 1, 12, 0) > 0        # a root whose experts are all cached
    assert online.state()["refits"] == 1


def test_a_first_refit_refused_leaves_the_model_as_it_started(monkeypatch):
    """The first refit refused (above) left the refit count at 1 with no choice of terms, and the
    run's summary (state()) then failed on it: a demo under load ended in a TypeError."""
    online = OnlineCostModel(COST, window=8, min_cycles=8, refit_every=8, refit_interval_s=0.0)
    solve = online._fitter.solve

    def explained_by_the_misses(features, times, **kw):
        theta, info = solve(features, times, **kw)
        return np.array([theta[0], 0.0, 0.0, 0.0, theta[4] + theta[3]]), info

    tries = []

    def counted(features, times, **kw):
        tries.append(online.n_seen)
        theta, info = explained_by_the_misses(features, times, **kw)
        theta[2] = 1.6e-20              # not 0, but no cycle's fixed part either (seen from the fitter)
        return theta, info

    monkeypatch.setattr(online._fitter, "solve", counted)
    for _ in range(20):
        online.observe(0, 1, 12, 4, COST.time_s(0, 1, 12, 4))
    assert online.n_refits == 0 and online.fitted == COST
    assert online.state()["refits"] == 0 and online.cost.time_s(0, 1, 12, 0) > 0
    assert tries == [8, 16]             # a refused refit waits its turn (it was tried every cycle)


def test_a_choice_of_terms_made_on_fewer_cycles_is_not_reused_on_more():
    """The first refit selects its terms on min_cycles cycles; until the window is full each refit
    selects again (a first choice made on 8 cycles, reused on 24, freed terms that traded against
    each other: a hit term 7x below its probe), then every select_every-th refit does."""
    online = OnlineCostModel(COST, window=32, min_cycles=8, refit_every=8, refit_interval_s=0.0)
    kinds = []
    for k in range(64):
        online.observe(2, 6 + k % 5, 20, k % 7, COST.time_s(2, 6 + k % 5, 20, k % 7), priced=(20, k % 7))
        if online._last_kind:
            kinds.append(online._last_kind)
    assert kinds == [2, 2, 2, 2, 2, 1, 2, 1]             # refits at 8, 16, 24, 32 select; then every other
