"""Fitting the cycle-time predictor, profiles and presets."""

import json
from pathlib import Path

import numpy as np
import pytest

from specfit import CostModel
from specfit.calibrate.fit import CycleTimeFitter, from_physical, prediction_errors, to_physical
from specfit.calibrate.presets import MIXTRAL_8X7B, OLMOE_1B_7B, PRESETS, QWEN3_30B_A3B, preset_profile, resolve_profile
from specfit.calibrate.profile import ModelShape, Profile, load_profile
from specfit.errors import SpecFitError

TRUE = CostModel(base_s=3e-3, per_node_s=4e-5, hit_s=1.5e-5, miss_s=4e-4, draft_level_s=8e-4)


def synthetic_cycles(rng, n, noise):
    levels = rng.integers(0, 8, n)
    nodes = 1 + rng.integers(0, 40, n)
    hits = rng.integers(0, 300, n)
    misses = rng.integers(0, 200, n)
    X = CostModel.features(levels, nodes, hits, misses)
    y = X @ TRUE.params * (1 + noise * rng.standard_normal(n))
    return X, y


def test_fit_recovers_known_parameters_from_noisy_cycles():
    rng = np.random.default_rng(0)
    X, y = synthetic_cycles(rng, 400, noise=0.03)
    fitter = CycleTimeFitter(seed=1).fit(X, y)
    fitted = fitter.cost_model()
    for name in ("base_s", "per_node_s", "hit_s", "miss_s", "draft_level_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE, name), rel=0.15), name
    # 3% multiplicative noise: the held-out MAPE is about 0.8 * 3%, and it is reported honestly
    assert 0.01 < fitter.quality_["holdout"]["mape"] < 0.04
    assert fitter.quality_["n_holdout"] == 100


def test_held_out_error_reflects_a_model_that_cannot_fit():
    rng = np.random.default_rng(2)
    X, _ = synthetic_cycles(rng, 200, noise=0.0)
    y = 1e-3 + 1e-6 * X[:, 4] ** 2          # quadratic in misses: the linear model is wrong
    quality = CycleTimeFitter().fit(X, y).quality_
    assert quality["holdout"]["mape"] > 0.2


def test_fixed_parameters_are_kept_and_the_rest_fitted():
    rng = np.random.default_rng(3)
    X, y = synthetic_cycles(rng, 300, noise=0.0)
    fitter = CycleTimeFitter(fixed={"miss_s": 4e-4}).fit(X, y)
    assert fitter.cost_model().miss_s == 4e-4
    assert fitter.cost_model().base_s == pytest.approx(3e-3, rel=1e-6)


def test_a_fixed_miss_caps_the_fitted_hit_so_the_transfer_is_never_negative():
    # hits really cost 3e-4 but the miss is fixed at 1e-4: the fitted hit may not exceed the miss
    # (a miss costs a hit plus a non-negative transfer), so it stops at 1e-4 and the transfer is 0
    rng = np.random.default_rng(3)
    X, _ = synthetic_cycles(rng, 300, noise=0.0)
    y = X @ TRUE.replace(hit_s=3e-4, miss_s=3e-4).params
    fitter = CycleTimeFitter(fixed={"miss_s": 1e-4}).fit(X, y)
    cost = fitter.cost_model()
    assert cost.hit_s == pytest.approx(1e-4)
    assert fitter.physical_[4] == pytest.approx(0.0, abs=1e-12)
    assert cost.miss_s == 1e-4


def test_to_physical_maps_a_miss_cheaper_than_its_hit_to_hit_equal_miss_and_no_transfer():
    # (draft level, base, node, hit 3e-4, miss 2e-4): the hit is clamped to the miss, transfer 0
    assert to_physical([0.0, 1e-3, 0.0, 3e-4, 2e-4]).tolist() == [0.0, 1e-3, 0.0, 2e-4, 0.0]
    # a physical model: transfer = miss - hit, and from_physical undoes it
    assert to_physical(TRUE.params) == pytest.approx([8e-4, 3e-3, 4e-5, 1.5e-5, 4e-4 - 1.5e-5])
    assert from_physical(to_physical(TRUE.params)) == pytest.approx(TRUE.params)


def test_parameters_without_variation_are_reported_unidentified():
    rng = np.random.default_rng(4)
    X, y = synthetic_cycles(rng, 50, noise=0.0)
    X[:, 0] = 0  # no draft levels in the data
    y = X @ TRUE.params
    assert CycleTimeFitter().fit(X, y).quality_["unidentified"] == ["draft_level_s"]


@pytest.mark.parametrize(
    "features, times, match",
    [
        (np.zeros((0, 5)), np.zeros(0), "at least 2"),
        (np.ones((3, 4)), np.ones(3), r"features \[cycles, 5\]"),
        (np.ones((3, 5)), np.array([1.0, np.nan, 1.0]), "finite"),
        (np.ones((3, 5)), np.array([1.0, 0.0, 1.0]), "positive"),
    ],
)
def test_bad_probe_data_is_one_clear_error(features, times, match):
    with pytest.raises(SpecFitError, match=match):
        CycleTimeFitter().fit(features, times)


def test_prediction_errors():
    err = prediction_errors([1.1, 0.9, 2.0], [1.0, 1.0, 2.0])
    assert err["mape"] == pytest.approx(0.2 / 3)
    assert err["max_ape"] == pytest.approx(0.1)
    assert err["max_abs_err"] == pytest.approx(0.1)


def test_prediction_bias_counts_the_cycles_whose_actual_value_is_zero():
    # the last cycle moved no bytes but was predicted to move some: no relative error (n = 3),
    # but it raises the bias, sum(p) / sum(a) - 1 = 4.5 / 4 - 1, and is the largest absolute error
    err = prediction_errors([1.1, 0.9, 2.0, 0.5], [1.0, 1.0, 2.0, 0.0])
    assert err["n"] == 3
    assert err["bias"] == pytest.approx(4.5 / 4.0 - 1.0)
    assert err["max_abs_err"] == pytest.approx(0.5)
    assert err["mape"] == pytest.approx(0.2 / 3)


def test_median_ape_is_the_median_of_the_relative_errors_not_their_mean():
    # relative errors 0, 0, 3: the median 0, the mean 1
    err = prediction_errors([1.0, 1.0, 4.0], [1.0, 1.0, 1.0])
    assert err["median_ape"] == 0.0
    assert err["mape"] == pytest.approx(1.0)
    # relative errors 0.1, 0.1, 0: the median 0.1, the mean 0.2 / 3
    assert prediction_errors([1.1, 0.9, 2.0], [1.0, 1.0, 2.0])["median_ape"] == pytest.approx(0.1)


def test_profile_round_trip(tmp_path):
    shape = ModelShape("tiny", n_layers=4, n_experts=16, top_k=4, expert_bytes=1000)
    prof = Profile(cost=TRUE.replace(expert_bytes=1000), shape=shape, kind="measured", source="unit test",
                   machine={"device": "cpu"}, fit={"holdout": {"mape": 0.05}})
    path = prof.save(tmp_path / "p.json")
    back = load_profile(path)
    assert back.to_dict() == prof.to_dict()


def test_profile_of_another_shape_is_refused_unless_rescaled(tmp_path):
    shape = ModelShape("tiny", n_layers=4, n_experts=16, top_k=4, expert_bytes=1000)
    other = ModelShape("big", n_layers=4, n_experts=16, top_k=4, expert_bytes=4000)
    prof = Profile(cost=TRUE, shape=shape)
    path = prof.save(tmp_path / "p.json")
    with pytest.raises(SpecFitError, match="made for tiny.*--rescale"):
        resolve_profile(path, shape=other)
    scaled = resolve_profile(path, shape=other, rescale=True)
    # transfer part (miss - hit) x4, compute terms unchanged
    assert scaled.cost.miss_s == pytest.approx(TRUE.hit_s + 4 * (TRUE.miss_s - TRUE.hit_s))
    assert scaled.cost.base_s == TRUE.base_s


@pytest.mark.parametrize(
    "content, match",
    [
        ("{not json", "not valid JSON"),
        ('{"profile_version": 99}', "profile_version"),
        ('{"shape": {}, "cost": {}}', "field 'profile_version' is missing, this SpecFit reads version 1"),
        ('{"profile_version": 1, "cost": {}}', "missing field 'shape'"),
        ('{"profile_version": 1, "shape": {"name": "x"}, "cost": {"base_s": 1}}', "cost"),
        ('{"profile_version": 1, "shape": {"name": "x", "n_layers": 1, "n_experts": 2, "top_k": 1, "expert_bytes": 1},'
         ' "cost": {"base_s": -1, "per_node_s": 0, "hit_s": 0, "miss_s": 0}}', "non-negative"),
        ('{"profile_version": 1, "shape": {"name": "x", "n_layers": 0, "n_experts": 2, "top_k": 1, "expert_bytes": 1},'
         ' "cost": {"base_s": 1, "per_node_s": 0, "hit_s": 0, "miss_s": 0}}', "n_layers >= 1, .* got n_layers=0"),
        ('{"profile_version": 1, "shape": {"name": "x", "n_layers": 2, "n_experts": 2, "top_k": 3, "expert_bytes": 1},'
         ' "cost": {"base_s": 1, "per_node_s": 0, "hit_s": 0, "miss_s": 0}}', "top_k <= n_experts"),
        ('{"profile_version": 1, "shape": {"name": "x", "n_layers": 2, "n_experts": 2, "top_k": 1, "expert_bytes": 8},'
         ' "cost": {"base_s": 1, "per_node_s": 0, "hit_s": 0, "miss_s": 0, "expert_bytes": 9}}',
         "'cost.expert_bytes' is 9, but 'shape.expert_bytes' is 8"),
    ],
)
def test_corrupt_profile_is_one_clear_error(tmp_path, content, match):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(SpecFitError, match=match):
        load_profile(path)


def test_missing_profile_file_is_one_clear_error(tmp_path):
    with pytest.raises(SpecFitError, match="no such profile"):
        resolve_profile(tmp_path / "absent.json")


# the published link bandwidths (GB/s) the presets module quotes, written out here: a test that
# read them from PRESETS would pass whatever they were changed to
PUBLISHED_GBPS = {"pcie4": 25.0, "pcie5": 50.0, "gh200": 340.0}


def test_presets_follow_published_bandwidths():
    assert set(PRESETS) == set(PUBLISHED_GBPS)
    for name, gbps in PUBLISHED_GBPS.items():
        for shape in (QWEN3_30B_A3B, OLMOE_1B_7B):
            prof = preset_profile(name, shape)
            assert prof.kind == "preset"
            assert prof.cost.transfer_s == pytest.approx(shape.expert_bytes / (gbps * 1e9))
            assert prof.cost.miss_s == pytest.approx(prof.cost.hit_s + prof.cost.transfer_s)
    # a hit reads the expert from HBM (~3 TB/s) after ~4.9 us of launches: 8 us for Qwen3's 9.44 MB,
    # Mixtral's 352 MB never less than their 117 us read
    hits = {s.name: preset_profile("pcie4", s).cost.hit_s for s in (QWEN3_30B_A3B, OLMOE_1B_7B, MIXTRAL_8X7B)}
    assert hits["qwen3-30b-a3b"] == pytest.approx(8e-6)
    for name, shape in (("olmoe-1b-7b", OLMOE_1B_7B), ("mixtral-8x7b", MIXTRAL_8X7B)):
        assert hits[name] - hits["qwen3-30b-a3b"] == pytest.approx((shape.expert_bytes - QWEN3_30B_A3B.expert_bytes) / 3e12)
    assert hits["mixtral-8x7b"] > MIXTRAL_8X7B.expert_bytes / 3e12 > 117e-6
    assert json.loads(json.dumps(preset_profile("pcie4").to_dict()))["kind"] == "preset"
    with pytest.raises(SpecFitError, match="preset"):
        resolve_profile("pcie9")


# --------------------------------------------------------------------------- the physical fit
def plain_nnls(X, y):
    """The fit as it was: non-negative least squares on relative error, hit and miss free."""
    from scipy.optimize import nnls

    w = 1.0 / y
    return nnls(X * w[:, None], y * w)[0]


def ar_like_cycles(rng, n, noise, transfer_s=0.0):
    """Autoregressive cycles of a 4-layer top-4 model: one node, no draft level, a union of 16
    experts of which 0..16 miss; the miss costs ``transfer_s`` more than a hit."""
    misses = rng.integers(0, 17, n)
    X = CostModel.features(0, 1, 16 - misses, misses)
    truth = TRUE.replace(hit_s=3e-4, miss_s=3e-4 + transfer_s)
    return X, X @ truth.params * (1 + noise * rng.standard_normal(n)), truth


def test_a_miss_is_never_fitted_cheaper_than_a_hit():
    flipped = 0
    for seed in range(12):
        X, y, truth = ar_like_cycles(np.random.default_rng(seed), 60, noise=0.05)
        old = plain_nnls(X, y)
        flipped += old[3] > old[4]
        fitter = CycleTimeFitter(holdout_fraction=0, prior=TRUE.replace(hit_s=3e-4, miss_s=3e-4)).fit(X, y)
        cost = fitter.cost_model()
        assert cost.miss_s >= cost.hit_s, seed
        assert fitter.physical_[4] >= 0 and cost.miss_s - cost.hit_s == pytest.approx(fitter.physical_[4])
        # the cycles' time is still predicted: the typical error stays at the noise level
        assert fitter.quality_["train"]["median_ape"] < 0.06
    assert flipped >= 3       # the case is real: the unconstrained fit made misses cheaper than hits


def test_a_term_the_data_cannot_identify_is_held_at_its_probe_value():
    X, y, truth = ar_like_cycles(np.random.default_rng(5), 80, noise=0.02, transfer_s=2e-4)
    probe = {"per_node_s": 7e-5, "hit_s": 2.5e-4, "transfer_s": 1.5e-4}
    fitter = CycleTimeFitter(holdout_fraction=0, prior=probe).fit(X, y)
    held = fitter.quality_["held"]
    # one node per cycle and a union of 16 every time: the node and hit terms move with the base
    assert held["per_node_s"]["value"] == 7e-5 and held["per_node_s"]["at"] == "prior"
    assert held["hit_s"]["value"] == 2.5e-4 and held["hit_s"]["reason"] == "constant in the data"
    assert "absent" in held["draft_level_s"]["reason"] and held["draft_level_s"]["at"].startswith("zero")
    cost = fitter.cost_model()
    assert cost.per_node_s == 7e-5 and cost.hit_s == 2.5e-4
    # the transfer varies with the misses, so it is fitted: to the truth, not to the probe's value
    assert fitter.quality_["fitted"] == ["base_s", "transfer_s"]
    assert cost.miss_s - cost.hit_s == pytest.approx(2e-4, rel=0.15)
    # the base absorbs what the held terms leave: the total is right
    assert cost.base_s + cost.per_node_s + 16 * cost.hit_s == pytest.approx(
        truth.base_s + truth.per_node_s + 16 * truth.hit_s, rel=0.02)


def test_a_term_the_data_put_below_zero_is_fitted_at_its_bound_and_said_so():
    """Cycles whose misses cost a little less than their hits (a copy the pass hides, a timing
    artefact): the unconstrained transfer is negative, far from the probe's, and the constraint
    holds it at 0 with the hit term taking its part. That is the data's answer (holding it at the
    probe's value instead made every other term over-explain the cycles), and the fit says so: the
    term is in ``at_bound`` with the probe's value, which the calibration shows."""
    from specfit.calibrate.fit import at_bound_text, physical_features

    rng = np.random.default_rng(7)
    n = 200
    nodes, hits, misses = 1 + rng.integers(0, 40, n), rng.integers(0, 300, n), rng.integers(0, 200, n)
    X = CostModel.features(np.zeros(n), nodes, hits, misses)
    truth = np.array([0.0, 3e-3, 4e-5, 2e-5, -5e-6])             # physical order; transfer below 0
    y = physical_features(X) @ truth * (1 + 0.01 * rng.standard_normal(n))
    probe = {"per_node_s": 4e-5, "hit_s": 2e-5, "transfer_s": 4e-6}
    fitter = CycleTimeFitter(prior=probe).fit(X, y)
    q = fitter.quality_
    assert "transfer_s" in q["fitted"] and fitter.cost_model().miss_s == fitter.cost_model().hit_s
    assert q["at_bound"] == {"transfer_s": 4e-6} and "its prior: 4e-06 s" in at_bound_text(4e-6)
    assert q["holdout"]["mape"] < 0.03                          # the cycles are still predicted
    # a term at 0 whose prior is 0 (or unknown) is no news
    assert CycleTimeFitter(prior={**probe, "transfer_s": 0.0}).fit(X, y).quality_["at_bound"] == {}


def test_draft_levels_that_move_with_the_node_count_are_not_traded_against_it():
    rng = np.random.default_rng(6)
    n = 120
    levels = rng.integers(0, 5, n)
    nodes = levels + 1                          # a chain: one node per level
    misses = rng.integers(0, 30, n)
    hits = rng.integers(0, 40, n)
    X = CostModel.features(levels, nodes, hits, misses)
    y = X @ TRUE.params * (1 + 0.03 * rng.standard_normal(n))
    fitter = CycleTimeFitter(holdout_fraction=0, prior=TRUE).fit(X, y)
    held = fitter.quality_["held"]
    assert len({"draft_level_s", "per_node_s"} & set(held)) == 1
    name = next(iter({"draft_level_s", "per_node_s"} & set(held)))
    assert "collinear" in held[name]["reason"]
    # held with the base in the profile's proportion, the pair scaled by the machine's speed (~1 here)
    cost = fitter.cost_model()
    assert getattr(cost, name) / cost.base_s == pytest.approx(getattr(TRUE, name) / TRUE.base_s)
    assert fitter.quality_["speed_factor"] == pytest.approx(1.0, abs=0.05)
    assert fitter.quality_["train"]["median_ape"] < 0.04


def test_a_prior_changes_nothing_where_the_data_identify_every_term():
    rng = np.random.default_rng(7)
    X, y = synthetic_cycles(rng, 400, noise=0.03)
    wrong = TRUE.replace(base_s=1e-2, hit_s=1e-4, miss_s=1e-3)
    fitted = CycleTimeFitter(seed=1, prior=wrong).fit(X, y)
    assert fitted.quality_["held"] == {}
    np.testing.assert_allclose(fitted.params_, CycleTimeFitter(seed=1).fit(X, y).params_, rtol=1e-9)
    assert fitted.cost_model().base_s == pytest.approx(TRUE.base_s, rel=0.15)


def test_terms_held_together_follow_the_machines_speed_in_the_priors_proportions():
    """Autoregressive cycles (one node, a union of 16) on a machine 1.6 times slower than the
    profile: base, node and hit terms cannot be told apart, so they keep the profile's proportions
    scaled by one speed factor, even where the profile's base is 0 and could not go lower."""
    rng = np.random.default_rng(8)
    prior = TRUE.replace(base_s=0.0, per_node_s=1e-4, hit_s=4e-4, miss_s=4.5e-4)
    misses = rng.integers(0, 17, 80)
    X = CostModel.features(0, 1, 16 - misses, misses)
    y = 1.6 * (X @ prior.params) * (1 + 0.02 * rng.standard_normal(80))
    fitter = CycleTimeFitter(holdout_fraction=0, prior=prior).fit(X, y)
    cost, held = fitter.cost_model(), fitter.quality_["held"]
    assert fitter.quality_["speed_factor"] == pytest.approx(1.6, rel=0.05)
    assert "speed factor" in held["hit_s"]["at"] and held["hit_s"]["reason"] == "constant in the data"
    assert cost.per_node_s / cost.hit_s == pytest.approx(prior.per_node_s / prior.hit_s)
    assert fitter.quality_["train"]["median_ape"] < 0.03


def test_a_term_freed_beside_the_speed_factor_does_not_carry_the_whole_slowdown():
    """Cycles of a machine 3 times slower than the profile, drafting one level nearly always (the
    level and union columns move with the constant part). The speed factor is chosen first; a term
    freed after it (the hits) left the factor undetermined, the factor was dropped, and the fit
    ended with the base, node and level terms at the profile's 1x and the hits at about 7x: the
    cycles predicted, their parts priced wrong. A term that would take the factor's evidence stays
    with the group, so the base follows the machine."""
    prior = CostModel(base_s=1.1e-3, per_node_s=3.6e-5, hit_s=3.6e-5, miss_s=3.75e-5, draft_level_s=3.3e-4)
    for seed in range(12):
        rng = np.random.default_rng(seed)
        levels = np.where(rng.random(48) < 0.95, 1, rng.choice([0, 2], 48))
        nodes = np.where(levels > 0, 1 + levels * rng.integers(1, 3, 48), 1)
        union = 16 + (nodes - 1) * rng.integers(2, 6, 48)
        misses = rng.integers(0, union // 2)
        X = CostModel.features(levels, nodes, union - misses, misses)
        y = 3.0 * (X @ prior.params) * np.exp(0.1 * rng.standard_normal(48))
        fitter = CycleTimeFitter(holdout_fraction=0, prior=prior).fit(X, y)
        assert fitter.cost_model().base_s > 2 * prior.base_s, seed
        assert fitter.quality_["train"]["median_ape"] < 0.1, seed


def probe_like_cycles(rng, stars: bool, noise: float):
    """Verification passes as ``specfit calibrate`` probes them on a 4-layer, 16-expert, top-4
    model: random trees whose union grows with the node count (and saturates), at five cache
    sizes, and (``stars``) the star trees whose union stays that of two nodes."""
    from specfit.calibrate.cycles import probe_trees

    truth = CostModel(base_s=4e-3, per_node_s=1e-4, hit_s=1.2e-4, miss_s=1.4e-4, draft_level_s=0.0)
    rows = []
    for capacity in (0, 4, 8, 12, 16):
        for kind, n in probe_trees((1, 2, 3, 4, 6, 8, 12, 16, 24, 32), repeats=2):
            if kind == "star" and not stars:
                continue
            routed = 2 if kind == "star" else n
            union = rng.binomial(64, 1 - (1 - 4 / 16) ** routed)
            misses = rng.binomial(union, 1 - capacity / 16)
            rows.append((0, n, union - misses, misses))
    X = CostModel.features(*np.array(rows).T)
    return X, X @ truth.params * np.exp(noise * rng.standard_normal(len(rows))), truth


def test_star_trees_identify_the_cost_of_a_node_that_random_trees_trade_against_the_hits():
    for seed in range(5):
        X, y, truth = probe_like_cycles(np.random.default_rng(seed), stars=True, noise=0.15)
        fitter = CycleTimeFitter(holdout_fraction=0, prior={"hit_s": 1e-4}).fit(X, y)
        assert "per_node_s" in fitter.quality_["fitted"], seed
        assert fitter.cost_model().per_node_s == pytest.approx(truth.per_node_s, rel=0.35), seed


def test_the_compiled_choice_score_equals_the_normal_equations_written_in_numpy():
    # specfit.kernels.identify.score against the forward selection's formulas in plain numpy:
    # design columns A @ M (a free term its own column, the speed factor the held group's prior
    # contribution), the candidate's standard error and estimate from the inverse normal matrix
    from specfit import kernels

    rng = np.random.default_rng(5)
    checked = singular = 0
    for trial in range(300):
        n, p = 40, 5
        A = rng.random((n, p)) * rng.choice([1.0, 1e-3], p)
        if trial % 7 == 0:
            A[:, 2] = 2.0 * A[:, 3]                        # collinear columns
        if trial % 11 == 0:
            A[:, 4] = 0.0                                  # an absent term
        b = A @ rng.random(p) * (1 + 0.05 * rng.standard_normal(n))
        G, g = A.T @ A, A.T @ b
        held_at = rng.random(p) * (rng.random(p) < 0.8)
        held_fixed = np.where(rng.random(p) < 0.2, held_at, 0.0)
        terms = rng.permutation(p)
        n_free = int(rng.integers(1, p))
        free, group = sorted(terms[:n_free]), sorted(terms[n_free:n_free + int(rng.integers(0, p - n_free + 1))])
        speed = bool(rng.random() < 0.5)
        c = int(rng.integers(0, len(free)))
        prior_value, visible, sigma2, shrink, spread = rng.random(), rng.random(), 1e-3 * rng.random(), 1.0, 0.3

        k = len(free) + (1 if speed and group else 0)
        M = np.zeros((p, k))
        M[free, np.arange(len(free))] = 1.0
        v = held_fixed.copy()
        if group:
            if speed:
                M[group, -1] = held_at[group]
            else:
                v[group] = held_at[group]
        Gk, rhs = M.T @ G @ M, M.T @ (g - G @ v)
        got = kernels.identify.score(G, g, np.array(free, dtype=np.int64), np.array(group, dtype=np.int64), speed,
                                     held_at, held_fixed, c, prior_value, visible, sigma2, shrink, spread, 3.0, 1e8)
        try:
            inv = np.linalg.inv(Gk)
        except np.linalg.LinAlgError:
            assert got == (np.inf, 0.0, 0.0)
            singular += 1
            continue
        if not (Gk[c, c] > 0 and inv[c, c] > 0 and 1.0 / (Gk[c, c] * inv[c, c]) > 1e-8):
            assert got == (np.inf, 0.0, 0.0)
            singular += 1
            continue
        estimate = float(inv[c] @ rhs)
        se = float(np.sqrt(sigma2 * shrink * inv[c, c]))
        shift = abs(estimate - prior_value)
        want = (min(se / (spread * max(prior_value, visible)), 3.0 * se / max(shift, 1e-300)), estimate, shift / se)
        # the products' summation order differs from numpy's BLAS: agreement to the conditioning
        assert got == pytest.approx(want, rel=max(1e-12 * np.linalg.cond(Gk), 1e-10), abs=1e-300)
        checked += 1
    assert checked > 150 and singular > 10


SHIPPED_PROFILES = sorted((Path(__file__).resolve().parents[1] / "calibrate" / "examples").glob("*.json"))


def test_the_shipped_profiles_are_found():
    assert len(SHIPPED_PROFILES) == 2          # an empty glob would skip the test below without a word


@pytest.mark.parametrize("path", SHIPPED_PROFILES, ids=lambda p: p.name)
def test_every_shipped_profile_loads_and_predicts_what_it_says_it_measured(path):
    """The profiles under calibrate/examples/ stay readable by the current schema; each one's cost model is
    physical (a miss never cheaper than a hit) and its held-out error is what its fit recorded."""
    profile = load_profile(path)
    cost = profile.cost
    assert cost.base_s > 0 and 0 <= cost.hit_s <= cost.miss_s and cost.expert_bytes == profile.shape.expert_bytes
    holdout = profile.fit["holdout"]
    assert 0 <= holdout["mape"] < 0.15 and holdout["n"] >= 10
    assert profile.machine["device_name"] and profile.probes["h2d"]


def test_identify_system_leaves_the_residual_of_the_held_terms():
    from specfit import kernels

    rng = np.random.default_rng(0)
    A, b = rng.normal(size=(20, 3)), rng.normal(size=20)
    held = np.array([0.5, 0.0, -1.0])                  # terms 0 and 2 fixed at these values, term 1 free
    _, _, left = kernels.identify.system(A.T @ A, A.T @ b, float(b @ b), np.array([1], dtype=np.int64),
                                         np.zeros(0, dtype=np.int64), False, np.zeros(3), held)
    assert left == pytest.approx(float(np.sum((b - A @ held) ** 2)), rel=1e-12)


def test_a_prior_of_hit_and_miss_is_read_as_a_hit_and_a_transfer_of_their_difference():
    """A prior's miss costs its hit plus the transfer: hit 1.5e-5 and miss 4e-4 are a transfer of
    3.85e-4, not a hit of the miss's size with no transfer."""
    X, y = synthetic_cycles(np.random.default_rng(5), 40, noise=0.0)
    prior = {"hit_s": 1.5e-5, "miss_s": 4e-4}
    quality = CycleTimeFitter(prior=prior).fit(X, y).quality_
    assert quality["prior"] == pytest.approx({"hit_s": 1.5e-5, "transfer_s": 4e-4 - 1.5e-5})


def test_a_fixed_hit_and_miss_are_kept_as_given():
    """Fixing both the hit and the miss fixes the transfer at their difference: the fitted model's
    miss is the miss given, not the hit plus the whole miss."""
    X, y = synthetic_cycles(np.random.default_rng(3), 200, noise=0.0)
    fitter = CycleTimeFitter(fixed={"hit_s": 1.5e-5, "miss_s": 4e-4}).fit(X, y)
    cost = fitter.cost_model()
    assert cost.hit_s == pytest.approx(1.5e-5) and cost.miss_s == pytest.approx(4e-4)
    assert fitter.physical_[4] == pytest.approx(4e-4 - 1.5e-5)
    assert cost.base_s == pytest.approx(TRUE.base_s, rel=1e-6)


def test_the_held_out_error_is_that_of_a_fit_that_never_saw_the_held_out_cycles():
    """The held-out cycles (the first quarter of the seeded permutation) are left out of the fit that
    is scored on them, and are priced by its cost model (a miss at the hit plus the transfer): the
    error equals that of a fit on the other cycles alone."""
    X, y = synthetic_cycles(np.random.default_rng(7), 200, noise=0.01)
    fitter = CycleTimeFitter(seed=2).fit(X, y)
    order = np.random.default_rng(2).permutation(200)
    test, train = order[:50], order[50:]
    assert fitter.quality_["n_holdout"] == 50 and fitter.quality_["n_train"] == 150
    alone = CycleTimeFitter(holdout_fraction=0.0).fit(X[train], y[train])
    assert alone.cost_model().hit_s > 0.5 * TRUE.hit_s                # the hit is fitted, not held at 0
    expected = prediction_errors(X[test] @ alone.params_, y[test])
    assert fitter.quality_["holdout"] == pytest.approx(expected)
    assert fitter.quality_["holdout"]["mape"] < 0.03                   # 1% noise


def test_the_robust_weights_median_is_numpys_median_for_even_and_odd_counts():
    """The Huber scale's one-sort median is the median: the mean of the two middle values for an
    even count (the online refit reweights a few dozen cycles, often an even number)."""
    from specfit.calibrate.fit import _median

    assert _median(np.array([10.0, 1.0, 3.0, 2.0])) == 2.5
    assert _median(np.array([5.0, 1.0, 3.0])) == 3.0
    rng = np.random.default_rng(0)
    for n in (2, 7, 40):
        x = rng.standard_normal(n)
        assert _median(x) == pytest.approx(float(np.median(x)))


@pytest.mark.parametrize("fraction", [1.0, -0.1])
def test_a_holdout_of_every_cycle_or_of_a_negative_share_is_refused(fraction):
    """A held-out share of 1 leaves nothing to fit."""
    with pytest.raises(SpecFitError, match=r"holdout_fraction: expected a value in \[0, 1\)"):
        CycleTimeFitter(holdout_fraction=fraction)


def test_a_prior_base_of_zero_is_refuted_by_cycles_that_hold_a_constant_part():
    """A profile whose base is 0 (a fit that landed there) refitted on cycles with a 10 ms base: the
    base is constant over the cycles, so only a candidate can leave the prior; held at 0, the other
    terms had to carry it (held-out error 6.5 % against 0.7 %)."""
    rng = np.random.default_rng(2)
    true = CostModel(base_s=0.010, per_node_s=0.001, hit_s=0.0002, miss_s=0.0012, draft_level_s=0.002)
    n = 200
    levels, nodes, hits, misses = rng.integers(0, 5, n), rng.integers(1, 12, n), rng.integers(10, 60, n), rng.integers(0, 30, n)
    X = CostModel.features(levels, nodes, hits, misses)
    y = X @ true.params * (1 + 0.01 * rng.standard_normal(n))
    fitter = CycleTimeFitter(prior=true.replace(base_s=0.0)).fit(X, y)
    assert "base_s" in fitter.quality_["fitted"]
    assert fitter.cost_model().base_s == pytest.approx(true.base_s, rel=0.05)
    assert fitter.quality_["holdout"]["mape"] < 0.015


@pytest.mark.parametrize("n", [3, 5])
def test_no_more_cycles_than_terms_leave_every_term_at_its_prior(n):
    """As many cycles as terms (or fewer): the largest model fits them exactly, so there is no
    residual to measure the noise by. Every term keeps the prior (here the truth) instead of being
    fitted exactly to 10 % noise (hit_s 3x and base_s 0 with five cycles, before)."""
    for seed in range(4):
        rng = np.random.default_rng(seed)
        levels, nodes, hits, misses = rng.integers(0, 5, n), rng.integers(1, 12, n), rng.integers(10, 60, n), rng.integers(0, 30, n)
        X = CostModel.features(levels, nodes, hits, misses)
        y = X @ TRUE.params * (1 + 0.10 * rng.standard_normal(n))
        fitter = CycleTimeFitter(prior=TRUE).fit(X, y)
        assert fitter.quality_["fitted"] == [] and fitter.quality_["speed_factor"] == 1.0
        np.testing.assert_allclose(fitter.cost_model().params, TRUE.params)
