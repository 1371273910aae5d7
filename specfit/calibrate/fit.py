"""Fitting the cycle-time predictor from measured cycles, physically.

The fit works in a physical parametrisation of :class:`~specfit.costmodel.CostModel`: a miss costs
a hit plus a non-negative transfer,

    T = draft_level_s * d + base_s + per_node_s * |S| + hit_s * |U| + transfer_s * misses
    miss_s = hit_s + transfer_s,   every term >= 0

(``|U| = hits + misses``, the union), so no fit can make a miss cheaper than a hit. Rows are
weighted by 1 / measured time, so the fit minimises *relative* error (a 2 ms cycle matters as much
as a 200 ms one), and iteratively reweighted with Huber weights, so a few cycles slowed by
something else on the machine are down-weighted instead of fitted.

A term is fitted only where the data identify it; otherwise it is *held* at its prior value (a
probe's direct measurement, or the profile being refitted; 0 without one) and ``quality_["held"]``
says which and why. Identification is a forward selection on the weighted normal equations
(``base_s`` is fitted from the start when there is no prior for it): while some candidate's
standard error (the residual spread of the largest model times the square root of the inverse
normal matrix's diagonal) is below the prior's own uncertainty, or the data put it more than
``REFUTED`` standard errors from its prior (the prior is wrong, however noisy the data), the
best-determined candidate is freed. The prior's uncertainty is ``prior_spread`` times the prior
value, or times the value at which the term would be ``VISIBLE_SHARE`` of a cycle when that is
larger (a prior of 0 is not a certainty). A column that moves with the others (draft levels that
grow with the node count) or a term too small to see in the noise thus stays at the prior instead
of trading against the other terms, as a plain non-negative least squares does.

The held terms share one candidate more, a *speed factor*: cycles that all run 1.6 times slower
than the profile say so even when they cannot tell the base from the node and hit terms
(autoregressive cycles: one node, a union of always the same size), and those terms then keep the
profile's proportions, scaled (``quality_["speed_factor"]``). A term constant over the cycles (the
base always) is only ever moved that way. Parameters measured directly by a probe (the draft level)
can be ``fixed``. The held-out error is measured on cycles the fit did not see and kept as data.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import nnls

from .. import kernels
from ..accounting import prediction_errors
from ..costmodel import PARAM_NAMES, CostModel
from ..errors import SpecFitError

__all__ = ["CycleTimeFitter", "prediction_errors", "PHYSICAL_NAMES", "physical_features", "to_physical",
           "from_physical", "VISIBLE_SHARE", "at_bound_text"]

# the fitted parameters, in the order of physical_features' columns
PHYSICAL_NAMES = ("draft_level_s", "base_s", "per_node_s", "hit_s", "transfer_s")
BASE = PHYSICAL_NAMES.index("base_s")
# a term adding this share of a cycle is one the data should be able to see
VISIBLE_SHARE = 0.02
# relative residual spread assumed at least: exact synthetic data must not make every term "certain"
NOISE_FLOOR = 0.005
# the data refute a prior value that is this many standard errors from what they say
REFUTED = 3.0
# a normal matrix (columns scaled to unit norm) this badly conditioned has collinear columns
COLLINEAR_CONDITION = 1e8


def physical_features(features) -> np.ndarray:
    """Feature rows ``(draft_levels, 1, n_nodes, hits, misses)`` of :meth:`CostModel.features`
    as the physical fit's columns ``(draft_levels, 1, n_nodes, hits + misses, misses)``."""
    X = np.asarray(features, dtype=np.float64)
    Z = X.copy()
    Z[..., 3] = X[..., 3] + X[..., 4]
    return Z


def to_physical(params) -> np.ndarray:
    """Cost-model parameters (:data:`PARAM_NAMES` order) as physical ones (:data:`PHYSICAL_NAMES`).
    A model whose miss is cheaper than its hit (an unphysical fit) maps to hit = miss, transfer 0."""
    d, base, node, hit, miss = (float(v) for v in params)
    hit = min(hit, miss)
    return np.array([d, base, node, hit, miss - hit])


def from_physical(theta) -> np.ndarray:
    d, base, node, hit, transfer = (float(v) for v in theta)
    return np.array([d, base, node, hit, hit + transfer])


def _physical_values(values: dict | CostModel | None, source: str) -> np.ndarray:
    """A partial set of parameter values (CostModel names, or ``transfer_s``) as a physical
    vector, NaN where unknown."""
    out = np.full(len(PHYSICAL_NAMES), np.nan)
    if values is None:
        return out
    d = values.to_dict() if isinstance(values, CostModel) else dict(values)
    d.pop("expert_bytes", None)
    unknown = set(d) - set(PARAM_NAMES) - {"transfer_s"}
    if unknown:
        raise SpecFitError(f"{source}: unknown parameter(s) {sorted(unknown)}; expected some of "
                           f"{[*PARAM_NAMES, 'transfer_s']}")
    for name in ("draft_level_s", "base_s", "per_node_s"):
        if name in d:
            out[PHYSICAL_NAMES.index(name)] = float(d[name])
    hit, miss = d.get("hit_s"), d.get("miss_s")
    if hit is not None and miss is not None:
        out[3:] = to_physical([0, 0, 0, hit, miss])[3:]
    elif hit is not None:
        out[3] = float(hit)
    if "transfer_s" in d:
        out[4] = float(d["transfer_s"])
    if np.any(out[np.isfinite(out)] < 0):
        raise SpecFitError(f"{source}: parameters must be non-negative seconds, got {d}")
    return out


def at_bound_text(prior_s: float) -> str:
    """What a fitted term at its bound (``quality_["at_bound"]``, its prior ``prior_s``) means."""
    return (f"fitted at 0, its bound: the data would put it below 0, the other terms taking its part "
            f"(its prior: {prior_s:.4g} s)")


def _median(x: np.ndarray) -> float:
    """``np.median`` of a 1-D float array, from one sort: the online refit takes two per refit of
    a few dozen cycles, where ``np.median``'s many Python-level calls cost more than the sort."""
    s = np.sort(x)
    m = s.size // 2
    return float(s[m]) if s.size % 2 else 0.5 * (float(s[m - 1]) + float(s[m]))


class CycleTimeFitter:
    """Physically constrained, robust least-squares fit of the cost model (scikit-learn shape).

    Args:
        holdout_fraction: share of the cycles kept out of the fit to measure its error.
        seed: shuffles the split.
        fixed: parameters held at given values, e.g. ``{"draft_level_s": 8e-4}`` (CostModel names,
            or ``transfer_s``; ``miss_s`` alone holds the miss cost and fits the hit below it).
        prior: what each parameter is believed to be before these cycles (a :class:`CostModel`,
            or a partial dict: the probes' direct measurements, the profile being refitted); a
            term the data cannot identify is held there (at 0 without a prior).
        prior_spread: the prior's relative uncertainty; the data must determine a term better
            than this for it to be fitted.
        robust_iterations: reweighting rounds with Huber weights (0: plain least squares).

    Attributes after ``fit``: ``params_`` (in :data:`PARAM_NAMES` order, fitted on all cycles),
    ``physical_`` (:data:`PHYSICAL_NAMES` order), ``quality_`` (held-out and training errors,
    counts, the fitted and the held terms with the reason, the residual spread).
    """

    def __init__(self, holdout_fraction: float = 0.25, seed: int = 0, fixed: dict | None = None,
                 robust_iterations: int = 5, prior: dict | CostModel | None = None, prior_spread: float = 0.5):
        if not 0.0 <= holdout_fraction < 1.0:
            raise SpecFitError(f"holdout_fraction: expected a value in [0, 1), got {holdout_fraction}")
        if not prior_spread > 0:
            raise SpecFitError(f"prior_spread: expected a positive relative uncertainty, got {prior_spread}")
        fixed = dict(fixed or {})
        self._fixed_phys = _physical_values({k: v for k, v in fixed.items() if k != "miss_s"}, "fixed")
        self._fixed_miss = float(fixed["miss_s"]) if "miss_s" in fixed else None
        if self._fixed_miss is not None and np.isfinite(self._fixed_phys[3]):
            # both given: the transfer is their difference
            if self._fixed_miss < self._fixed_phys[3]:
                raise SpecFitError(f"fixed: miss_s ({self._fixed_miss}) below hit_s ({self._fixed_phys[3]}) is unphysical")
            self._fixed_phys[4], self._fixed_miss = self._fixed_miss - self._fixed_phys[3], None
        self.holdout_fraction, self.seed, self.fixed = holdout_fraction, seed, fixed
        self.robust_iterations = int(robust_iterations)
        self.prior = prior
        self._prior_phys = _physical_values(prior, "prior")
        self.prior_spread = float(prior_spread)

    # ------------------------------------------------------------------ checks
    def _check(self, features, times_s, source: str) -> tuple[np.ndarray, np.ndarray]:
        X = np.asarray(features, dtype=np.float64)
        y = np.asarray(times_s, dtype=np.float64)
        if X.ndim != 2 or X.shape[1] != len(PARAM_NAMES) or y.shape != (X.shape[0],):
            raise SpecFitError(f"{source}: expected features [cycles, {len(PARAM_NAMES)}] and times [cycles], "
                               f"got {X.shape} and {y.shape}")
        if X.shape[0] < 2:
            raise SpecFitError(f"{source}: expected at least 2 measured cycles to fit, got {X.shape[0]}")
        if not (np.all(np.isfinite(X)) and np.all(np.isfinite(y))):
            raise SpecFitError(f"{source}: features and times must be finite (found NaN or inf)")
        if np.any(y <= 0):
            raise SpecFitError(f"{source}: measured times must be positive seconds")
        return X, y

    # ------------------------------------------------------------------ the solver
    def _held_values(self) -> tuple[np.ndarray, np.ndarray]:
        """(fixed mask, value of every term when it is not fitted) in physical order."""
        fixed = np.isfinite(self._fixed_phys)
        held_at = np.where(np.isfinite(self._prior_phys), self._prior_phys, 0.0)
        held_at = np.where(fixed, self._fixed_phys, held_at)
        if self._fixed_miss is not None:
            fixed[4], held_at[4] = True, 0.0
            held_at[3] = min(held_at[3], self._fixed_miss)
        return fixed, held_at

    def solve(self, features, times_s, start=None, robust_iterations: int | None = None,
              sample_weight=None, choice: dict | None = None) -> tuple[np.ndarray, dict]:
        """(physical parameters, what was fitted and held) on already checked cycles.

        ``start`` (physical parameters) gives the first round's Huber weights from its residuals
        (else the first round is unweighted); ``robust_iterations`` overrides the rounds after it;
        ``sample_weight`` weighs the cycles (the online refit's recency), at most 1 each.
        The online refit calls this with the current model and no further round: one pass, the
        reweighting carried from refit to refit. ``choice`` (``info["choice"]`` of an earlier
        solve) keeps its fitted and held terms instead of selecting them again."""
        X = np.asarray(features, dtype=np.float64)
        y = np.asarray(times_s, dtype=np.float64)
        Z = physical_features(X)
        y_fit = y
        if self._fixed_miss is not None:
            # miss_s held, hit_s free below it: T - miss_s * misses = ... + hit_s * hits
            y_fit = y - self._fixed_miss * X[:, 4]
            Z[:, 3], Z[:, 4] = X[:, 3], 0.0
        fixed, held_at = self._held_values()
        weight = 1.0 / y                                     # relative error
        w = np.ones_like(y) if sample_weight is None else np.asarray(sample_weight, dtype=np.float64)
        # a term's share of a cycle per unit of it, over the (weighted) cycles
        self._unit = (w @ np.abs(Z / y[:, None])) / w.sum()
        weight = weight * np.sqrt(w)
        A, b = Z * weight[:, None], y_fit * weight
        theta = None if start is None else np.asarray(start, dtype=np.float64)
        rounds = self.robust_iterations if robust_iterations is None else int(robust_iterations)
        info = {}
        for _ in range(rounds + 1):
            if theta is None:
                robust = np.ones_like(b)
            else:
                # Huber weights on the relative residuals (scale: the median absolute deviation): a
                # cycle slowed down by something else on the machine is down-weighted, not fitted
                r = (y_fit - Z @ theta) / y
                scale = max(1.4826 * _median(np.abs(r - _median(r))), NOISE_FLOOR)
                robust = np.sqrt(np.minimum(1.0, 1.345 * scale / np.maximum(np.abs(r), 1e-300)))
            Ar, br = A * robust[:, None], b * robust
            # the rows' weights in all (recency x Huber), for the noise per cycle and its degrees of freedom
            wr = w * robust * robust
            self._weights = (float(wr.sum()), float(wr.sum() ** 2 / np.sum(wr * wr)), float(np.sum(wr * wr) / wr.sum()))
            if choice is None or rounds > 0 or self._lost_a_column(Ar, held_at, fixed, choice):
                choice = self._identify(Ar, br, held_at, fixed, Z)
            theta = self._fit_choice(Ar, br, held_at, fixed, choice)
        if self._fixed_miss is not None:
            theta[3] = min(theta[3], self._fixed_miss)       # a hit never costs more than the held miss
            theta[4] = self._fixed_miss - theta[3]
        info = {"free": [PHYSICAL_NAMES[j] for j in choice["free"]], "speed": choice["speed_value"],
                "held_names": [PHYSICAL_NAMES[j] for j in choice["held"]], "choice": choice}
        return theta, info

    # A term the data cannot identify on its own is held at its prior value times one common speed
    # factor s (fitted when the data determine it): the cycles may say that the machine runs at s
    # times the speed the prior was measured at, and the terms they cannot tell apart keep the
    # prior's proportions. Without a prior a term is held at 0.
    def _columns(self, A, b, held_at, fixed, free, group, speed: bool):
        """(design columns [n, k], what they must explain [n]) of a choice: the free terms, then
        the held group's column (its prior contribution) when the speed factor is free."""
        cols = [A[:, j] for j in free]
        target = b - A[:, fixed] @ held_at[fixed] if fixed.any() else b
        if group:
            held_part = A[:, group] @ held_at[group]
            if speed:
                cols.append(held_part)
            else:
                target = target - held_part
        return (np.stack(cols, axis=1) if cols else np.zeros((A.shape[0], 0))), target

    def _lost_a_column(self, A, held_at, fixed, choice) -> bool:
        """Whether a column the choice fits is all zero in these cycles (e.g. no miss since the cache
        warmed up): NNLS would set its term to 0 where a selection holds it at the prior."""
        cols, _ = self._columns(A, np.zeros(A.shape[0]), held_at, fixed, choice["free"], choice["group"], choice["speed"])
        return bool(cols.size) and not bool(np.all(np.any(cols != 0, axis=0)))

    def _fit_choice(self, A, b, held_at, fixed, choice) -> np.ndarray:
        """Physical parameters of a choice: NNLS on its columns, the held group at s x prior."""
        cols, target = self._columns(A, b, held_at, fixed, choice["free"], choice["group"], choice["speed"])
        theta = held_at.copy()                               # fixed, absent or without a prior: as held
        speed = 1.0
        if cols.shape[1]:
            coef, _ = nnls(cols, target)
            theta[choice["free"]] = coef[:len(choice["free"])]
            if choice["speed"]:
                speed = float(coef[-1])
        theta[choice["group"]] = speed * held_at[choice["group"]]
        choice["speed_value"] = speed
        return theta

    def _identify(self, A: np.ndarray, b: np.ndarray, held_at: np.ndarray, fixed: np.ndarray, Z: np.ndarray) -> dict:
        """Forward selection of what the data determine better than the prior (see the module
        docstring): the free terms, and whether the speed factor of the held group is free.

        The noise ``sigma`` is the residual spread of the largest model (every term free, plain
        least squares). A candidate (a term leaving the held group, or the speed factor) is
        scored in the model with it freed: its standard error ``sigma * sqrt(inv(G)_cc)`` against
        the prior's uncertainty, or against its distance from the prior (refuted beyond
        ``REFUTED`` standard errors); ``1 / (G_cc inv(G)_cc)`` is the share of its column the
        others do not explain (collinear below ``1 / COLLINEAR_CONDITION``).
        """
        p = A.shape[1]
        sum_w, n_eff, shrink = self._weights
        known = np.isfinite(self._prior_phys)
        G, g, bb = A.T @ A, A.T @ b, float(b @ b)
        diag = G.diagonal()
        absent = [j for j in range(p) if not fixed[j] and diag[j] == 0]
        movable = [j for j in range(p) if not fixed[j] and j not in absent]
        free = [BASE] if BASE in movable and not known[BASE] else []
        group = [j for j in movable if j not in free and known[j] and held_at[j] > 0]
        # a term constant over the cycles (the base always; a union that never changes) is part of
        # the cycle's constant: the data cannot tell it from the others, only scale them together
        # A base whose prior is 0 is no such term: the speed factor cannot scale it off 0, so it is a
        # candidate like a varying one (the data free it where a constant part of the cycle is theirs)
        remaining = [j for j in movable if j not in free and (np.ptp(Z[:, j]) > 0 or (j == BASE and held_at[j] == 0))]
        held_fixed = np.where(fixed, held_at, 0.0)
        unit = self._unit

        def ids(indices) -> np.ndarray:
            return np.array(indices, dtype=np.int64)

        def system(f, grp, sp):
            """Normal equations of a choice (:func:`specfit.kernels.identify.system`)."""
            return kernels.identify.system(G, g, bb, ids(f), ids(grp), bool(sp), held_at, held_fixed)

        def score(f, grp, sp, c, prior_value, visible):
            """(score, estimate, distance from the prior in standard errors) of column c
            (:func:`specfit.kernels.identify.score`)."""
            return kernels.identify.score(G, g, ids(f), ids(grp), bool(sp), held_at, held_fixed, c, float(prior_value),
                                          float(visible), sigma2, shrink, self.prior_spread, REFUTED,
                                          COLLINEAR_CONDITION)

        def speed_visible(grp):
            share = float(unit[grp] @ held_at[grp]) if grp else 0.0     # the group's share of a cycle
            return VISIBLE_SHARE / share if share > 0 else np.inf

        # the noise from the largest model: a smaller model's residual would count the terms not
        # yet freed as noise and free none of them
        Gk, rhs, target2 = system(movable, [], False)
        rss = target2 - rhs @ np.linalg.pinv(Gk, hermitian=True) @ rhs if movable else target2
        if n_eff - len(movable) < 1:
            # as many cycles as terms (or fewer): the largest model fits them exactly and leaves no
            # residual to measure the noise by; the noise is unknown, so no term is freed by it
            sigma2 = np.inf
        else:
            sigma2 = max(rss / sum_w * n_eff / (n_eff - len(movable)), NOISE_FLOOR ** 2)
        scores = {}
        speed, speed_now = False, 1.0
        while True:
            best, best_score, best_estimate = None, np.inf, 1.0
            if group and not speed:
                sc, est, dist = score(free, group, True, len(free), 1.0, speed_visible(group))
                scores[("speed", None)] = (sc, dist)
                best, best_score, best_estimate = ("speed", None), sc, est
            for j in remaining:
                grp = [k for k in group if k != j]
                prior_value = speed_now * held_at[j] if j in group else 0.0
                visible = VISIBLE_SHARE / unit[j] if unit[j] > 0 else np.inf
                sc, est, dist = score(free + [j], grp, speed and bool(grp), len(free), prior_value, visible)
                scores[("term", j)] = (sc, dist)
                if sc < best_score:
                    best, best_score, best_estimate = ("term", j), sc, est
            if best is None or not best_score < 1.0:
                break
            kind, j = best
            if kind == "speed":
                speed, speed_now = True, max(best_estimate, 0.0)
            else:
                free.append(j)
                remaining.remove(j)
                if j in group:
                    group.remove(j)
                    if speed and group and 1.0 <= score(free, group, True, len(free), 1.0, speed_visible(group))[0] < np.inf:
                        # freed, the term would take the evidence of the speed factor the data chose
                        # before it (the factor is still estimable, no longer determined): it moves
                        # with the group. Dropping the factor instead put the group back at the
                        # prior's speed and this one term carried the whole slowdown of a machine
                        # uniformly slower than the profile (hit_s 7x, the rest 1x)
                        free.remove(j)
                        group.append(j)
                        scores[("term", j)] = (np.inf, scores[("term", j)][1])
                        continue
            if speed and group and not score(free, group, True, len(free), 1.0, speed_visible(group))[0] < 1.0:
                speed, speed_now = False, 1.0      # what is left of the group: the free terms explain it
        if speed and len(group) == 1:
            # a speed factor of one term is that term fitted
            free, group, speed = free + group, [], False
        held = sorted(j for j in range(p) if not fixed[j] and j not in free)
        return {"free": sorted(free), "group": group, "speed": speed and bool(group), "held": held,
                "absent": absent, "scores": scores, "held_at": held_at, "Z": Z, "speed_value": 1.0}

    def _at_bound(self, theta, choice) -> dict:
        """The fitted terms the non-negativity holds at 0 where a prior (a probe's measurement, the
        refitted profile) puts them above: the data would put them below 0, the other terms taking
        their part (a miss no dearer than a hit next to an H2D probe of microseconds), which a
        reader of "fitted" should be told; name -> the prior's value."""
        return {PHYSICAL_NAMES[j]: float(self._prior_phys[j]) for j in choice["free"]
                if theta[j] == 0 and np.isfinite(self._prior_phys[j]) and self._prior_phys[j] > 0}

    def _held_terms(self, choice) -> dict:
        """The held terms in words: their value, where it comes from, why they are held."""
        out = {}
        speed = choice["speed_value"] if choice["speed"] else 1.0
        for j in choice["held"]:
            score, shift = choice["scores"].get(("term", j), (np.inf, 0.0))
            if j in choice["absent"]:
                reason = "absent from the data (always 0)"
            elif np.ptp(choice["Z"][:, j]) == 0:
                reason = "constant in the data"
            elif not np.isfinite(score):
                reason = "moves with the fitted terms in the data (collinear)"
            else:
                reason = (f"not determined by the data (its standard error is over the prior's +-{self.prior_spread:.0%}, "
                          f"and the data put it {shift:.1f} standard errors from the prior)")
            in_group = j in choice["group"]
            at = ("zero (no prior)" if not np.isfinite(self._prior_phys[j]) else
                  f"prior x speed factor {speed:.3g}" if in_group and choice["speed"] else "prior")
            out[PHYSICAL_NAMES[j]] = {"value": float(choice["held_at"][j] * (speed if in_group else 1.0)),
                                      "at": at, "reason": reason}
        return out

    # ------------------------------------------------------------------ estimator API
    def fit(self, features, times_s, source: str = "measured cycles") -> "CycleTimeFitter":
        X, y = self._check(features, times_s, source)
        n = X.shape[0]
        n_test = int(round(n * self.holdout_fraction)) if n >= 4 else 0
        order = np.random.default_rng(self.seed).permutation(n)
        test, train = order[:n_test], order[n_test:]
        held_out = {}
        if n_test:
            theta, _ = self.solve(X[train], y[train])
            held_out = prediction_errors(X[test] @ from_physical(theta), y[test])
        theta, info = self.solve(X, y)
        self.physical_ = theta
        self.params_ = from_physical(theta)
        residual = (y - X @ self.params_) / y
        self.quality_ = {
            "n_cycles": n,
            "n_train": int(train.size),
            "n_holdout": int(n_test),
            "holdout": held_out,
            "train": prediction_errors(X @ self.params_, y),
            "fixed": dict(self.fixed),
            "parametrisation": "miss_s = hit_s + transfer_s, every term >= 0",
            "physical_params": dict(zip(PHYSICAL_NAMES, map(float, theta))),
            "fitted": info["free"],
            "at_bound": self._at_bound(theta, info["choice"]),
            "held": self._held_terms(info["choice"]),
            "speed_factor": info["speed"],
            "unidentified": info["held_names"],
            "prior": None if self.prior is None else
            {k: float(v) for k, v in zip(PHYSICAL_NAMES, self._prior_phys) if np.isfinite(v)},
            "residual_spread": float(1.4826 * np.median(np.abs(residual - np.median(residual)))),
        }
        return self

    def predict(self, features) -> np.ndarray:
        return np.asarray(features, dtype=np.float64) @ self.params_

    def cost_model(self, expert_bytes: int = 0) -> CostModel:
        return CostModel(**dict(zip(PARAM_NAMES, map(float, self.params_))), expert_bytes=expert_bytes)
