"""The cost model refitted while a run goes: a rolling, robust, physical fit of the recent measured
cycles, with the profile as the prior.

A profile describes the machine as it was when it was calibrated. When that changes during a run
(another process takes a core, clocks move, the cache settles into another regime) the predictions
drift, and a policy that decides with them picks the wrong subtrees. :class:`OnlineCostModel`
keeps the last ``window`` cycles (their features and measured times) and refits every
``refit_every`` cycles with :class:`~specfit.calibrate.fit.CycleTimeFitter`: relative error, Huber
weights (a cycle disturbed once is not fitted), a miss never cheaper than a hit, and every term the
window cannot identify held at the profile's value. Cycles weigh less as they age (``half_life``),
so a change of the machine outweighs the cycles before it after about one half-life, not after half
the window. A window of one policy's cycles usually pins ``base_s`` and the terms its choices vary;
the rest keep the profile's values.

On top of the fit, a *speed tracker* follows what a refit every few cycles cannot: a machine whose
speed moves from one cycle to the next. A shared CPU runs the same cycle well above or below its
median time, in phases that last several cycles (the log of measured / predicted time of one cycle
correlates strongly with the next's in ``bench_decode.py`` runs, ``benchmarks/bench_online.py``:
``benchmarks/RESULTS.md``, "A speed tracker on top of the online refit"). Each observed cycle that
comes with the counts its policy priced moves the log speed toward that cycle's log(measured /
fitted prediction) with a half-life of ``speed_half_life`` cycles, and :attr:`OnlineCostModel.cost`
is the fitted model with every term scaled by that speed. A common factor leaves every decision
between subtrees as it was (throughput is a ratio of tokens to seconds); it makes the predicted
seconds right. The same factor absorbs a predictor's steady over- or under-estimate of the union,
since the residual is taken against the counts the policy priced. The speed is relative to the fit
it multiplies, so a refit moves it by the refit's own change for the cycle just seen: a refit that
learns the same slowness the tracker had learned does not count it twice.

The model's own update is part of the cycle it runs in, and not a steady part: a refit every
``refit_every`` cycles (and at least ``refit_interval_s`` seconds apart) takes a visible part of a
cycle on the bundled model (a refit that also selects the terms more), where a cycle without one
pays next to nothing (``bench_decode.py`` runs showed refit cycles clearly slower than predicted:
``benchmarks/RESULTS.md``, "Deterministic noise out of the cycle times"). So the caller hands each
cycle's measured update time back with the cycle (``overhead_s``): the fit and the tracker learn
the cycle without it, a running mean per kind of update (none, refit, refit with selection) learns
what each costs, and :attr:`cost` for the cycle that has just run an update carries that kind's
expected time in its ``base_s``: the policy decides, and the cycle is predicted, with the update it
did pay.

Within a cycle there is one more thing to know before it is priced in full: how fast its own
drafter passes ran. On a shared CPU a slow phase slows every part of a cycle at once, and the
drafter's passes run just before the target's. :meth:`within_cycle` is the model for the rest of
a cycle whose drafter passes have run (the decoder's final selection: the decisions while drafting
keep the cycle start's model): every term but the drafted levels' times
``exp(b * r)``, where ``r`` is the log of the passes' seconds per level against the recent cycles'
(a tracker with a half-life of ``pace_half_life`` cycles) and ``b`` the slope of the log residual
of the rest of the cycles (their time less their drafter passes') on ``r``, learned as the run goes (a least-squares slope over about the last
``PACE_MEMORY`` cycles, shrunk toward ``PACE_PRIOR_SLOPE``, kept in [0, 1]). The drafted levels
keep the price they had before they ran: each term of the prediction is made before the work it
prices. A machine whose drafter speed says nothing about the rest learns ``b`` near 0. The pace
is per level over whole cycles, so it is compared with whole cycles only: a cycle's first pass
also runs the tokens committed last cycle (longer than a later level on the bundled model:
``benchmarks/RESULTS.md``, "Stop 31: the rest of a cycle priced at its drafter's pace"), and
the levels drafted so far would look slow against it.

Before ``min_cycles`` cycles have been seen the fit is the prior itself (the speed tracker starts
with the first cycle).
"""

from __future__ import annotations

import math

import numpy as np

from ..costmodel import PARAM_NAMES, CostModel
from .fit import CycleTimeFitter, from_physical, to_physical

__all__ = ["OnlineCostModel"]


class OnlineCostModel:
    """A cost model that follows the measured cycles of a run.

    Args:
        prior: the profile's cost model (the start, and the value of every term the window cannot
            identify).
        window: how many recent cycles the fit sees.
        min_cycles: cycles seen before the first refit.
        refit_every: cycles between refits.
        refit_interval_s: measured seconds between refits at least (after the first): a refit
            costs milliseconds, so short cycles refit less often than every ``refit_every`` cycles
            and the refits stay a small share of the run's time (short autoregressive cycles on the
            bundled model refitted every 8 spent a few per cent of it; the refit's error on recorded
            runs is the same with or without the interval, ``benchmarks/RESULTS.md``, "Stop 28:
            where SpecFit's live time outside the model passes goes").
        half_life: a cycle this many cycles old weighs half as much as the newest, so the model
            follows a machine that changes instead of averaging over the whole window.
        select_every: refits between two selections of the terms to fit (which terms the window
            identifies changes slowly; the refits in between keep the last selection and only
            solve for the values, a fraction of the cost).
        speed_half_life: cycles after which a cycle's speed weighs half in the speed tracker (None
            or 0: no tracker, the fit alone).
        pace_half_life: cycles after which a cycle's drafter seconds per level weigh half in the
            pace that :meth:`within_cycle` compares a cycle's drafter passes with (None or 0: the
            rest of a cycle is priced as at its start).

    Attributes: ``cost`` (the current model: the fit times the tracked speed, plus the expected
    time of the update just made), ``fitted`` (the fit alone), ``speed`` (the tracked factor),
    ``update_s`` (the expected seconds of the update just made, in ``cost``), ``n_seen`` (cycles
    observed), ``n_refits``, ``held`` (the terms the last refit held at the prior; :meth:`state`
    says why).
    """

    UPDATE_KINDS = ("observe", "refit", "select")
    UPDATE_RATE = 0.25          # the weight of a new measurement of an update's seconds, after the first four
    # the slope of a cycle's log residual on its drafter's log pace deviation: its sums' half-life in
    # cycles, and the prior it is shrunk toward with the weight of that many squared log deviations
    # (a deviation of 0.1 on 20 cycles weighs 0.2)
    PACE_MEMORY = 32.0
    PACE_PRIOR_SLOPE, PACE_PRIOR_WEIGHT = 0.5, 0.2

    def __init__(self, prior: CostModel, window: int = 48, min_cycles: int = 8, refit_every: int = 8,
                 half_life: float = 16.0, select_every: int = 2, speed_half_life: float | None = 1.0,
                 refit_interval_s: float = 0.1, pace_half_life: float | None = 1.0):
        if window < 2 or min_cycles < 2 or refit_every < 1:
            raise ValueError(f"OnlineCostModel: expected window >= 2, min_cycles >= 2, refit_every >= 1, got "
                             f"{window}, {min_cycles}, {refit_every}")
        if speed_half_life is not None and not speed_half_life >= 0:
            raise ValueError(f"speed_half_life: expected >= 0 cycles or None, got {speed_half_life}")
        if not refit_interval_s >= 0:
            raise ValueError(f"refit_interval_s: expected >= 0 seconds, got {refit_interval_s}")
        if pace_half_life is not None and not pace_half_life >= 0:
            raise ValueError(f"pace_half_life: expected >= 0 cycles or None, got {pace_half_life}")
        self.prior = prior
        self.window, self.min_cycles, self.refit_every = int(window), int(min(min_cycles, window)), int(refit_every)
        self.half_life, self.select_every = float(half_life), int(max(select_every, 1))
        self._choice = None
        self._chosen_on = 0              # the window's cycles when the terms were last selected
        self._fitter = CycleTimeFitter(holdout_fraction=0.0, prior=prior)
        self._theta = to_physical(prior.params)
        self._features = np.zeros((self.window, len(PARAM_NAMES)))
        self._times = np.zeros(self.window)
        self.n_seen = 0
        self.n_refits = 0
        self._refused = 0               # refits not kept (see _refit): the next waits its turn
        self.refit_interval_s = float(refit_interval_s)
        self._since_refit = 0            # cycles and measured seconds observed since the last refit
        self._since_refit_s = 0.0
        self.fitted = prior
        self.cost = prior
        # the speed tracker: each new cycle's weight, and the log speed it has reached
        self._speed_rate = 1.0 - 0.5 ** (1.0 / speed_half_life) if speed_half_life else 0.0
        self._log_speed = 0.0
        # the drafter's pace: its tracked log seconds per level (None before a drafted cycle), and
        # the decayed sums of the residual-on-deviation slope
        self._pace_rate = 1.0 - 0.5 ** (1.0 / pace_half_life) if pace_half_life else 0.0
        self._log_pace: float | None = None
        self._pace_rr = self._pace_re = 0.0
        self.held: list[str] = []
        # the model's own update, per kind: a running mean of its measured seconds, how many were seen
        self._update_mean = np.zeros(len(self.UPDATE_KINDS))
        self._update_seen = np.zeros(len(self.UPDATE_KINDS), dtype=np.int64)
        self._last_kind: int | None = None
        self.update_s = 0.0

    @property
    def speed(self) -> float:
        """The tracked speed: measured over fitted time of the recent cycles (1: as fitted)."""
        return math.exp(self._log_speed)

    @property
    def pace_slope(self) -> float:
        """``b`` of :meth:`within_cycle`: how much of a drafter's deviation from its pace the rest
        of the cycle is expected to share (in logs)."""
        slope = ((self._pace_re + self.PACE_PRIOR_WEIGHT * self.PACE_PRIOR_SLOPE)
                 / (self._pace_rr + self.PACE_PRIOR_WEIGHT))
        return min(max(slope, 0.0), 1.0)

    def _pace_deviation(self, drafter_s: float, draft_levels: int) -> float | None:
        """log(seconds per level of this cycle's drafter passes) minus the tracked pace; 0 before
        there is a pace, None when the cycle drafted nothing to compare (or the tracker is off)."""
        if not (self._pace_rate > 0 and draft_levels > 0 and drafter_s > 0 and math.isfinite(drafter_s)):
            return None
        log_pace = math.log(drafter_s / draft_levels)
        return 0.0 if self._log_pace is None else log_pace - self._log_pace

    def within_cycle(self, drafter_s: float, draft_levels: int) -> CostModel:
        """The model for the rest of a cycle whose ``draft_levels`` drafter passes have run in
        ``drafter_s`` seconds: :attr:`cost` with every term but the drafted levels' times
        ``exp(pace_slope * deviation)``; :attr:`cost` itself when the cycle drafted nothing."""
        deviation = self._pace_deviation(drafter_s, draft_levels)
        if not deviation:
            return self.cost
        return self.cost.scaled(math.exp(self.pace_slope * deviation), draft_factor=1.0)

    def observe(self, draft_levels: int, n_nodes: int, hits: int, misses: int, time_s: float,
                priced: tuple[int, int] | None = None, overhead_s: float = 0.0, drafter_s: float = 0.0) -> None:
        """Add one measured cycle (the counts of what it verified, its measured seconds); refit
        when it is time. ``priced``: the (hits, misses) the policy priced the cycle with, before it
        ran (the predicted union's); with it the speed tracker learns from the cycle.
        ``overhead_s``: the seconds of this model's previous update (:meth:`observe` call) that ran
        inside the observed cycle; they are not fitted, and they teach the model what an update of
        that kind costs. ``drafter_s``: the seconds of the cycle's drafter passes (what
        :meth:`within_cycle` was handed); they teach the pace and its slope."""
        overhead_s = float(overhead_s) if overhead_s > 0 and math.isfinite(overhead_s) else 0.0
        if self._last_kind is not None and overhead_s > 0:
            kind = self._last_kind
            self._update_seen[kind] += 1
            # a mean over the first few, then a running mean of the recent ones
            rate = max(1.0 / self._update_seen[kind], self.UPDATE_RATE)
            self._update_mean[kind] += rate * (overhead_s - self._update_mean[kind])
        self._last_kind = None
        work_s = time_s - overhead_s
        if not (work_s > 0 and math.isfinite(work_s)):
            return                                   # nothing to learn from (an empty or broken clock)
        deviation = self._pace_deviation(drafter_s, draft_levels)
        if priced is not None:
            # against the fit that predicted the cycle (a refit below only changes the next ones)
            fitted_s = self.fitted.time_s(draft_levels, n_nodes, *priced)
            if fitted_s > 0:
                residual = math.log(work_s / fitted_s) - self._log_speed     # what the cycle's start missed
                # the slope is of the rest of the cycle, which within_cycle scales: the whole cycle's
                # residual holds the drafter passes' own deviation, and taught a drafter unrelated
                # to the rest its share of the cycle as the slope
                rest_s = work_s - drafter_s
                rest_fitted_s = fitted_s - self.fitted.draft_level_s * draft_levels
                if deviation and rest_s > 0 and rest_fitted_s > 0:
                    rest = math.log(rest_s / rest_fitted_s) - self._log_speed
                    decay = 0.5 ** (1.0 / self.PACE_MEMORY)
                    self._pace_rr = decay * self._pace_rr + deviation * deviation
                    self._pace_re = decay * self._pace_re + deviation * rest
                self._log_speed += self._speed_rate * residual
        if deviation is not None:
            self._log_pace = math.log(drafter_s / draft_levels) - (1.0 - self._pace_rate) * deviation
        slot = self.n_seen % self.window
        self._features[slot] = (draft_levels, 1.0, n_nodes, hits, misses)
        self._times[slot] = work_s
        self.n_seen += 1
        kind = 0                                     # index into UPDATE_KINDS
        self._since_refit += 1
        self._since_refit_s += time_s
        first = self.n_refits == 0 and not self._refused
        if self.n_seen >= self.min_cycles and (first or self._since_refit >= self.refit_every
                                               and self._since_refit_s >= self.refit_interval_s):
            before = self.fitted
            kind = 2 if self._refit() else 1
            self._since_refit, self._since_refit_s = 0, 0.0
            if priced is not None:
                self._rebase_speed(before, draft_levels, n_nodes, *priced)
        self._last_kind = kind
        self.update_s = float(self._update_mean[kind])
        tracked = bool(self._log_speed) or self.update_s > 0
        self.cost = self.fitted.scaled(self.speed, plus_base_s=self.update_s) if tracked else self.fitted

    def _rebase_speed(self, before: CostModel, draft_levels: int, n_nodes: int, hits: int, misses: int) -> None:
        """Keep the tracked speed relative to the fit it multiplies. The tracker has learned how
        much slower the machine runs than ``before`` predicts; a refit that moves the fit toward the
        same measured cycles has absorbed part of that, and the product would count it twice (on
        a machine twice as slow as its profile, the first refit doubled the fit while the tracker
        still said twice as slow: the next cycle was predicted at four times the profile). The log
        speed moves by the refit's own change for the cycle just observed (as it was priced), so
        the prediction for that cycle stays where the tracker had put it."""
        if not self._speed_rate:
            return
        old_s = before.time_s(draft_levels, n_nodes, hits, misses)
        new_s = self.fitted.time_s(draft_levels, n_nodes, hits, misses)
        if old_s > 0 and new_s > 0:
            self._log_speed += math.log(old_s / new_s)

    def _refit(self) -> bool:
        """Refit on the window; True when this refit selected the terms again."""
        n = min(self.n_seen, self.window)
        age = (self.n_seen - 1 - np.arange(n)) % self.window        # slot i holds the cycle this many cycles old
        recency = 0.5 ** (age / self.half_life)
        # one reweighting round per refit, its Huber weights from the current model's residuals:
        # over successive refits of overlapping windows this is the offline fit's iteration
        # a choice of terms is reused only on a window no larger than the one it was made on (a
        # first refit's few cycles freed terms that then traded against each other on the full
        # window: a hit term 7x below its probe), and as a copy, so that a refused refit leaves
        # the kept choice as it was (its speed factor, for state())
        reuse = (dict(self._choice) if self.n_refits % self.select_every and self._choice is not None
                 and self._chosen_on >= n else None)
        theta, info = self._fitter.solve(self._features[:n], self._times[:n], start=self._theta, robust_iterations=0,
                                         sample_weight=recency, choice=reuse)
        params = from_physical(theta)
        fitted = CostModel(**dict(zip(PARAM_NAMES, map(float, params))), expert_bytes=self.prior.expert_bytes)
        if not fitted.base_s + fitted.per_node_s > 1e-6 * (self.prior.base_s + self.prior.per_node_s):
            # every cycle runs a target pass, whose fixed part is positive: a window the other terms
            # explain whole (a loaded machine's noise) gave a model that predicts ~0 s for a root
            # whose experts are cached, which the search refuses (or verifies alone at any
            # ratio); the fit it had stays, and its choice of terms (a first refit refused leaves
            # the model unrefitted); the next try waits the refit interval
            self._refused += 1
            return reuse is None
        self._theta = theta
        self.fitted = fitted
        self._choice = info["choice"]
        if reuse is None:
            self._chosen_on = n
        self.held = info["held_names"]
        self.n_refits += 1
        return reuse is None

    def state(self) -> dict:
        """What the model is now, for a run's summary."""
        return {"cycles_seen": self.n_seen, "refits": self.n_refits, "refused": self._refused, "window": self.window,
                "params": {k: v for k, v in self.fitted.to_dict().items() if k != "expert_bytes"},
                "speed_factor": self._choice["speed_value"] if self.n_refits else 1.0,
                "tracked_speed": self.speed, "pace_slope": self.pace_slope,
                "update_s": {k: float(v) for k, v in zip(self.UPDATE_KINDS, self._update_mean)},
                "held": self._fitter._held_terms(self._choice) if self.n_refits else {}}
