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
says which and why. Identification is a forward selection on the weighted normal equations:
``base_s`` is always fitted (every cycle has one); then, while some term's standard error from the
data (the residual spread times the square root of the inverse normal matrix's diagonal) is below
the prior's own uncertainty, or the data put the term more than ``REFUTED`` standard errors from its
prior (the prior is wrong, however noisy the data), the best-determined term is added. The prior's uncertainty is
``prior_spread`` times the prior value, or times the value at which the term would be
``VISIBLE_SHARE`` of a cycle when that is larger (a prior of 0 is not a certainty). A constant column,
one that moves with the others (draft levels that grow with the node count), or a term too small to
see in the noise thus stays at the prior instead of trading against the other terms, as a plain
non-negative least squares does. Parameters measured directly by a probe (the draft level) can be
``fixed``. The held-out error is measured on cycles the fit did not see and kept as data.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import nnls

from ..accounting import prediction_errors
from ..costmodel import PARAM_NAMES, CostModel
from ..errors import SpecFitError

__all__ = ["CycleTimeFitter", "prediction_errors", "PHYSICAL_NAMES", "physical_features", "to_physical",
           "from_physical", "VISIBLE_SHARE"]

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
              sample_weight=None) -> tuple[np.ndarray, dict]:
        """(physical parameters, what was fitted and held) on already checked cycles.

        ``start`` (physical parameters) gives the first round's Huber weights from its residuals
        (else the first round is unweighted); ``robust_iterations`` overrides the rounds after it;
        ``sample_weight`` weighs the cycles (the online refit's recency), at most 1 each.
        The online refit calls this with the current model and no further round: one pass, the
        reweighting carried from refit to refit."""
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
        self._weights = (float(w.sum()), float(w.sum() ** 2 / np.sum(w * w)), float(np.sum(w * w) / w.sum()))
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
                scale = 1.4826 * np.median(np.abs(r - np.median(r))) or 1e-12
                robust = np.sqrt(np.minimum(1.0, 1.345 * scale / np.maximum(np.abs(r), 1e-300)))
            Ar, br = A * robust[:, None], b * robust
            free, info = self._identify(Ar, br, held_at, fixed, Z)
            theta = held_at.copy()
            if free:
                held = [j for j in range(len(theta)) if j not in free]
                theta[free], _ = nnls(Ar[:, free], br - Ar[:, held] @ theta[held])
        if self._fixed_miss is not None:
            theta[3] = min(theta[3], self._fixed_miss)       # a hit never costs more than the held miss
            theta[4] = self._fixed_miss - theta[3]
        info["free"] = [PHYSICAL_NAMES[j] for j in info.pop("free_idx")]
        info["held_names"] = [PHYSICAL_NAMES[j] for j in sorted(info["held_idx"][0] + info["held_idx"][1])]
        return theta, info

    def _identify(self, A: np.ndarray, b: np.ndarray, held_at: np.ndarray, fixed: np.ndarray, Z: np.ndarray):
        """Forward selection of the terms the data determine better than the prior (see the
        module docstring). Returns (free column indices, what is needed to say why the others are
        held: :meth:`_held_terms` turns it into words).

        Everything is computed on the p x p normal equations. The noise ``sigma`` is the residual
        spread of the largest model; one round costs one small inverse: freeing term j next to the
        free set F, the Schur complement ``s_j = G_jj - G_jF G_FF^-1 G_Fj`` gives its standard
        error ``sigma / sqrt(s_j)`` and the share of its column the free terms do not explain,
        ``s_j / G_jj`` (collinear below ``1 / COLLINEAR_CONDITION``).
        """
        p = A.shape[1]
        # rows weighted by w (recency): the spread of one cycle is rss / sum(w), with the degrees of
        # freedom of n_eff = sum(w)^2 / sum(w^2) cycles; a parameter's variance scales by sum(w^2) / sum(w)
        sum_w, n_eff, shrink = self._weights
        G, g, bb = A.T @ A, A.T @ b, float(b @ b)
        unit = self._unit
        visible = np.divide(VISIBLE_SHARE, unit, out=np.full(p, np.inf), where=unit > 0)
        prior_sd = self.prior_spread * np.maximum(held_at, visible)
        diag = G.diagonal()
        absent = [j for j in range(p) if not fixed[j] and diag[j] == 0]
        free = [BASE] if not fixed[BASE] and BASE not in absent else []
        remaining = [j for j in range(p) if not fixed[j] and j not in free and j not in absent]
        ratios, shifts = np.full(p, np.inf), np.zeros(p)
        # the noise from the largest model (every candidate free, plain least squares): a subset's
        # own residual would count the terms not yet freed as noise and free none of them
        S = free + remaining
        H = [j for j in range(p) if j not in S]
        vH = held_at[H]
        Ab0 = g - G[:, H] @ vH                               # A^T (b - A_H v_H): what S must explain
        b0b0 = bb - 2 * vH @ g[H] + vH @ G[np.ix_(H, H)] @ vH
        rss = b0b0 - Ab0[S] @ (np.linalg.pinv(G[np.ix_(S, S)], hermitian=True) @ Ab0[S]) if S else b0b0
        dof = max(n_eff - len(S), 1.0)
        sigma2 = max(rss / sum_w * n_eff / dof, NOISE_FLOOR ** 2)
        while remaining:
            C = remaining
            # the free terms' fit with the candidates held (at the prior): its residual's correlation
            # with a candidate's column, over the Schur complement, is how far the data move it
            H = [j for j in range(p) if j not in free]
            vH = held_at[H]
            Ab0 = g - G[:, H] @ vH
            if free:
                inv = np.linalg.inv(G[np.ix_(free, free)])
                cross = G[np.ix_(free, C)]
                s = diag[C] - np.einsum("fc,fc->c", cross, inv @ cross)
                c = Ab0[C] - cross.T @ (inv @ Ab0[free])
            else:
                s, c = diag[C].copy(), Ab0[C]
            ok = s > diag[C] / COLLINEAR_CONDITION
            s_safe = np.where(ok, s, 1.0)
            se = np.sqrt(sigma2 * shrink / s_safe)
            shift = np.abs(c / s_safe)
            # identified: determined better than the prior knows it, or the prior refuted (the data
            # put the term further than REFUTED standard errors from it)
            ratio = np.where(ok, np.minimum(se / prior_sd[C], REFUTED * se / np.maximum(shift, 1e-300)), np.inf)
            ratios[C], shifts[C] = ratio, np.where(ok, shift / se, 0.0)
            best = int(np.argmin(ratio))
            if not ratio[best] < 1.0:
                break
            free.append(remaining.pop(best))
        free.sort()
        return free, {"free_idx": free, "held_idx": (absent, remaining, ratios, shifts, held_at, Z)}

    def _held_terms(self, held_idx) -> dict:
        """The held terms in words: their value, where it comes from, why they are held."""
        absent, remaining, ratios, shifts, held_at, Z = held_idx
        out = {}
        for j in sorted(absent + remaining):
            if j in absent:
                reason = "absent from the data (always 0)"
            elif np.ptp(Z[:, j]) == 0:
                reason = "constant in the data"
            elif not np.isfinite(ratios[j]):
                reason = "moves with the fitted terms in the data (collinear)"
            else:
                reason = (f"not determined by the data (its standard error is {ratios[j]:.1f}x the prior's "
                          f"+-{self.prior_spread:.0%}, and the data put it {shifts[j]:.1f} standard errors from the prior)")
            out[PHYSICAL_NAMES[j]] = {"value": float(held_at[j]),
                                      "at": "prior" if np.isfinite(self._prior_phys[j]) else "zero (no prior)",
                                      "reason": reason}
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
            "held": self._held_terms(info["held_idx"]),
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
