"""Prefetch into idle link time: while the drafter drafts a level, the host-to-device link has
nothing to do, and the tree drafted so far says which experts the cycle's verification will need.

:class:`DraftPrefetch` plans, before each drafted level, which experts to copy during it: the
non-resident experts with the highest *need* (an expert's need is the largest path probability of
a drafted node predicted to route to it, 1 for the root's), up to what the level's time can carry,
``efficiency * draft_level_s / transfer_s`` experts (fractions carry over to the next level of the
same cycle). Experts below ``min_need`` are not worth a slot. The cache copies them
(:meth:`specfit.experts.cache.ExpertCache.prefetch`: a prefetch never displaces an expert with a
higher priority), and the policy's next search sees them resident.

The overlap term: a prefetched expert costs link time that runs beside the drafter. ``efficiency``
is the share of a level's time that actually overlaps (1 on a copy stream that never stalls the
drafter; measured live as ``1 - exposed wait / copy time`` by :meth:`DraftPrefetch.observe`); a plan
that fits it adds no time. Live, the decoder measures the copy time and the wait the verification
pass had for it, and the error of the predicted exposed time (0 by construction when the plan fits)
is reported per run.
"""

from __future__ import annotations

import numpy as np

from .. import kernels
from ..tree import DraftTree

__all__ = ["DraftPrefetch", "need_priority"]


def need_priority(tree: DraftTree, experts: np.ndarray, n_experts: int) -> np.ndarray:
    """float [L, E]: for each expert, the largest path probability of a node predicted to route to
    it (the root's experts: 1)."""
    return kernels.lookahead.need_priority(np.array(tree.path_probs), np.ascontiguousarray(experts, dtype=np.int64),
                                           int(n_experts))


class DraftPrefetch:
    """Plans prefetches into the link time of drafted levels (see the module docstring).

    Args:
        efficiency: share of a draft level's time the link can copy in without delaying anything;
            None learns it from the live decoder's measurements (starting at ``prior_efficiency``).
        min_need: experts needed with a lower probability are not prefetched.
    """

    name = "prefetch"

    def __init__(self, efficiency: float | None = 1.0, min_need: float = 0.3, prior_efficiency: float = 0.5):
        for name, value in (("efficiency", efficiency), ("prior_efficiency", prior_efficiency)):
            if value is not None and not 0 <= value <= 1:
                raise ValueError(f"prefetch.{name}: expected a share in [0, 1], got {value!r}")
        if not 0 <= min_need <= 1:
            raise ValueError(f"prefetch.min_need: expected a share in [0, 1], got {min_need!r}")
        self.fixed_efficiency = efficiency
        self.efficiency_ = float(prior_efficiency if efficiency is None else efficiency)
        self.min_need = float(min_need)
        self._carry = 0.0
        self.copy_s_ = 0.0          # live: measured copy time and exposed wait, summed
        self.wait_s_ = 0.0

    def get_params(self) -> dict:
        return {"efficiency": self.fixed_efficiency, "min_need": self.min_need}

    def kernel_config(self, lconf: np.ndarray, lf: np.ndarray) -> None:
        """Write this prefetcher's settings and state into the lever arrays of
        :mod:`specfit.kernels.levers`."""
        lv = kernels.levers
        lconf[lv.PREFETCH] = 1
        lf[[lv.EFFICIENCY, lv.MIN_NEED, lv.CARRY]] = self.efficiency_, self.min_need, self._carry

    def begin_cycle(self) -> None:
        self._carry = 0.0

    def plan(self, tree: DraftTree, experts: np.ndarray, cached: np.ndarray, cost,
             keep: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(mask, priority), both [L, E]: the experts to copy while the next level is drafted, and
        the priorities the cache orders its victims by (this cycle's need, or ``keep`` where
        higher: what the next cycles are predicted to need). The rule is
        :func:`specfit.kernels.levers.plan_level`, the code the compiled replay runs: the most
        needed non-resident experts first, as many as the level's link time carries,
        ``efficiency * draft_level_s / transfer_s`` (fractions carry over to the next level of the
        same cycle)."""
        lv = kernels.levers
        lconf, lf = np.zeros(lv.N_LCONF, dtype=np.int64), np.zeros(lv.N_LF)
        self.kernel_config(lconf, lf)
        need, mask = lv.plan_level(np.array(tree.path_probs), np.ascontiguousarray(experts, dtype=np.int64),
                                   int(cached.shape[1]), kernels.bitsets.pack_mask(np.asarray(cached, dtype=bool)), lf,
                                   cost.params)
        self._carry = float(lf[lv.CARRY])
        return mask, (need if keep is None else np.maximum(need, keep))

    def observe(self, copy_s: float, wait_s: float) -> None:
        """Live: a cycle's prefetch copy time and the part of it the verification waited for."""
        self.copy_s_ += max(copy_s, 0.0)
        self.wait_s_ += max(wait_s, 0.0)
        if self.fixed_efficiency is None and self.copy_s_ > 0:
            self.efficiency_ = float(np.clip(1.0 - self.wait_s_ / self.copy_s_, 0.0, 1.0))
