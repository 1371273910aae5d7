"""Fitting the cycle-time predictor from measured cycles.

Every cycle is summarised by the features of :meth:`CostModel.features`
``(draft_levels, 1, n_nodes, hits, misses)`` and its measured time; the model is linear in the
five parameters, so fitting is a non-negative least squares (scipy), iteratively reweighted with Huber weights so a few cycles
slowed by something else on the machine do not pull the fit. Rows are weighted by
1 / measured time so the fit minimises *relative* error (a 2 ms cycle matters as much as a
200 ms one). Parameters measured directly by a probe (e.g. the transfer cost from the H2D sweep)
can be held fixed. The held-out error is measured on cycles the fit did not see and kept as data.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import nnls

from ..accounting import prediction_errors
from ..costmodel import PARAM_NAMES, CostModel
from ..errors import SpecFitError

__all__ = ["CycleTimeFitter", "prediction_errors"]


class CycleTimeFitter:
    """Non-negative least-squares fit of the cost model (scikit-learn shape).

    Args:
        holdout_fraction: share of the cycles kept out of the fit to measure its error.
        seed: shuffles the split.
        fixed: parameters held at given values, e.g. ``{"miss_s": 4e-4}``.
        robust_iterations: reweighting rounds with Huber weights (0: plain least squares).

    Attributes after ``fit``: ``params_`` (in :data:`PARAM_NAMES` order, fitted on all cycles),
    ``quality_`` (held-out and training errors, counts, which parameters the data could not
    identify).
    """

    def __init__(self, holdout_fraction: float = 0.25, seed: int = 0, fixed: dict | None = None,
                 robust_iterations: int = 5):
        if not 0.0 <= holdout_fraction < 1.0:
            raise SpecFitError(f"holdout_fraction: expected a value in [0, 1), got {holdout_fraction}")
        unknown = set(fixed or {}) - set(PARAM_NAMES)
        if unknown:
            raise SpecFitError(f"fixed: unknown parameter(s) {sorted(unknown)}; expected some of {list(PARAM_NAMES)}")
        self.holdout_fraction, self.seed, self.fixed = holdout_fraction, seed, dict(fixed or {})
        self.robust_iterations = int(robust_iterations)

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

    def _solve(self, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        params = np.zeros(len(PARAM_NAMES))
        free = []
        residual = y.copy()
        for j, name in enumerate(PARAM_NAMES):
            if name in self.fixed:
                params[j] = float(self.fixed[name])
                residual -= X[:, j] * params[j]
            else:
                free.append(j)
        if free:
            weight = 1.0 / y   # relative error
            A, b = X[:, free] * weight[:, None], residual * weight
            robust = np.ones_like(b)
            for _ in range(self.robust_iterations + 1):
                params[free], _ = nnls(A * robust[:, None], b * robust)
                # Huber weights on the relative residuals: a cycle slowed down by something else on
                # the machine (a page fault, another process) is down-weighted, not fitted
                r = b - A @ params[free]
                scale = 1.4826 * np.median(np.abs(r - np.median(r))) or 1e-12
                robust = np.sqrt(np.minimum(1.0, 1.345 * scale / np.maximum(np.abs(r), 1e-300)))
        return params

    def fit(self, features, times_s, source: str = "measured cycles") -> "CycleTimeFitter":
        X, y = self._check(features, times_s, source)
        n = X.shape[0]
        n_test = int(round(n * self.holdout_fraction)) if n >= 4 else 0
        order = np.random.default_rng(self.seed).permutation(n)
        test, train = order[:n_test], order[n_test:]
        held_out = {}
        if n_test:
            params = self._solve(X[train], y[train])
            held_out = prediction_errors(X[test] @ params, y[test])
        self.params_ = self._solve(X, y)
        varying = [name for j, name in enumerate(PARAM_NAMES) if np.ptp(X[:, j]) > 0 or name == "base_s"]
        self.quality_ = {
            "n_cycles": n,
            "n_train": int(train.size),
            "n_holdout": int(n_test),
            "holdout": held_out,
            "train": prediction_errors(X @ self.params_, y),
            "fixed": dict(self.fixed),
            "unidentified": [name for name in PARAM_NAMES if name not in varying and name not in self.fixed],
        }
        return self

    def predict(self, features) -> np.ndarray:
        return np.asarray(features, dtype=np.float64) @ self.params_

    def cost_model(self, expert_bytes: int = 0) -> CostModel:
        return CostModel(**dict(zip(PARAM_NAMES, map(float, self.params_))), expert_bytes=expert_bytes)
