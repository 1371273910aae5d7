"""Loading the compiled kernels before the first timed cycle: :func:`warm_up` runs each kernel a
live decoder calls every cycle once on a tiny input, through the Python modules that own them
(:mod:`specfit.kernels` holds the kernels and their on-disk cache)."""

from __future__ import annotations

__all__ = ["warm_up"]


def warm_up() -> float:
    """Load (or, the first time after an install or an edit, compile) the kernels a live decoder
    calls every cycle: a tree's checks and accepted path, the search, SpecFit's per-level
    decision, ``evaluate`` and the cache's admits, so that no timed cycle pays for it. Returns the seconds it took."""
    import time

    import numpy as np

    from .costmodel import CostModel
    from .experts.cache import ExpertCache
    from .policy_base import CycleView
    from .search import best_subtree, evaluate
    from .specfit_policy import SpecFitPolicy
    from .tree import DraftTree

    start = time.perf_counter()
    tree = DraftTree(parents=np.array([-1, 0, 0]), path_probs=np.array([1.0, 0.5, 0.25]), tokens=np.array([5, 6, 7]))
    experts = np.zeros((3, 1, 1), dtype=np.int64)
    cached = np.zeros((1, 2), dtype=bool)
    cost = CostModel(base_s=1.0, per_node_s=0.1, hit_s=0.0, miss_s=0.5)
    best_subtree(tree, experts, cached, cost, 1, start=np.zeros(1, dtype=np.int64))
    evaluate(tree, np.array([0, 1]), experts, cached, cost, 1)
    policy = SpecFitPolicy()
    view = CycleView(tree, experts, cached, cost, 0)
    policy.begin_cycle()
    for levels in range(2):
        policy.keep_drafting(view.truncated(levels))
    policy.select(view.truncated(1))
    tree.accepted_path(np.array([6, 0, 0]))
    cache = ExpertCache(1, 2, 1)
    cache.admit(~cached)
    cache.admit_layer(0, np.array([1]))
    return time.perf_counter() - start
