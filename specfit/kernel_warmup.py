"""Loading the compiled kernels before the first timed cycle: :func:`warm_up` runs each kernel a
live decoder calls every cycle once on a tiny input, through the Python modules that own them
(:mod:`specfit.kernels` holds the kernels and their on-disk cache)."""

from __future__ import annotations

__all__ = ["warm_up"]


def warm_up() -> float:
    """Load (or, the first time after an install or an edit, compile) the kernels a live decoder
    calls every cycle: a tree's checks, mask and accepted path, the search, SpecFit's per-level
    decision, ``evaluate``, the cycle's union accounting, the slot precision, the router
    predictor's selection and the cache's admits, so that no timed cycle pays for it. Returns the
    seconds it took."""
    import time

    import numpy as np

    from .costmodel import CostModel
    from .experts.cache import ExpertCache
    from .experts.predictor_base import NodeBatch
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
    tree.attention_mask(np.array([0, 1]), prefix_len=2)
    from . import kernels
    from .experts.predictors import slots_right
    from .experts.router import RouterPredictor
    from .search import packed

    kernels.evaluate.union_accounting(experts, np.array([0, 1]), experts[:2], packed(cached))
    slots_right(experts, experts)
    import torch

    router = RouterPredictor(embed=torch.zeros(8, 4), router_weight=torch.ones(1, 2, 4), top_k=1, min_nodes=1,
                             batch_nodes=1)
    router.predict(NodeBatch(tokens=np.array([1, 2]), last_known=None, context=torch.ones(2, 4)))
    router.update(np.array([1]), np.zeros((1, 1, 1), dtype=np.int64), 2, context=torch.ones(1, 4))
    cache = ExpertCache(1, 2, 1)
    cache.admit(~cached)
    cache.admit_layer(0, np.array([1]))
    return time.perf_counter() - start
