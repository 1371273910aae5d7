"""Loading the compiled kernels before the first timed cycle: :func:`warm_up` runs each kernel a
live decoder calls every cycle once on a tiny input, through the Python modules that own them
(:mod:`specfit.kernels` holds the kernels and their on-disk cache).

The first time after an install or an edit numba compiles them, which takes over a minute on a
small machine, in two independent groups of comparable cost (the search with SpecFit's per-level
decision, which calls it; the runtime's kernels: ``benchmarks/RESULTS.md``, "The decoder's first
compile, side by side"). When the on-disk cache is cold and the process may use
more than one core, :func:`warm_up` compiles the second group in a child process, which writes the
cache, while this one compiles the first, and then loads the rest from the cache."""

from __future__ import annotations

import os

from . import kernels

__all__ = ["warm_up", "cache_is_cold"]


def _toy():
    """A three-node tree with its experts, an empty cache and a cost model: the tiny inputs."""
    import numpy as np

    from .costmodel import CostModel
    from .tree import DraftTree

    tree = DraftTree(parents=np.array([-1, 0, 0]), path_probs=np.array([1.0, 0.5, 0.25]), tokens=np.array([5, 6, 7]))
    experts = np.zeros((3, 1, 1), dtype=np.int64)
    cached = np.zeros((1, 2), dtype=bool)
    cost = CostModel(base_s=1.0, per_node_s=0.1, hit_s=0.0, miss_s=0.5)
    return tree, experts, cached, cost


def _search() -> None:
    """The exact search and ``evaluate``."""
    import numpy as np

    from .search import best_subtree, evaluate

    tree, experts, cached, cost = _toy()
    best_subtree(tree, experts, cached, cost, 1, start=np.zeros(1, dtype=np.int64))
    evaluate(tree, np.array([0, 1]), experts, cached, cost, 1)


def _policy() -> None:
    """SpecFit's per-level decision, its selection and what a cycle teaches it, also with acceptance
    learned online."""
    import numpy as np

    from .experts.acceptance_online import OnlineAcceptance
    from .policy_base import CycleView, Observation
    from .specfit_policy import SpecFitPolicy

    tree, experts, cached, cost = _toy()
    policy = SpecFitPolicy()
    view = CycleView(tree, experts, cached, cost, 0)
    policy.begin_cycle()
    for levels in range(2):
        policy.keep_drafting(view.truncated(levels))
    policy.select(view.truncated(1))
    policy.observe(Observation(tree=tree, verified=np.array([0, 1]), verdicts=np.array([6, 0]), draft_levels=1,
                               misses=1, predicted_misses=1, root_misses=0, root_predicted_misses=0))
    # with acceptance learned online (a sampling decode's specfit+online): the calibrated tree before
    # and after a fit, and the update from a sampled cycle's edges
    online = SpecFitPolicy(acceptance=OnlineAcceptance(min_edges=1))
    for edges in ((np.array([1, 2]), np.array([0.5, 0.25])), None):
        online.begin_cycle()
        online.keep_drafting(view.truncated(1))
        if edges is not None:
            online.observe(Observation(tree=tree, verified=np.array([0, 1]), verdicts=np.array([6, 0]),
                                       draft_levels=1, edges=edges))


def _runtime() -> None:
    """A tree's checks, mask and accepted path, the union accounting, the router predictor, the
    KV compaction, a drafted level, the cache and the levers, the online refit's selection."""
    import numpy as np
    import torch

    from .experts.cache import ExpertCache
    from .experts.lookahead import DraftLookahead
    from .experts.predictor_base import NodeBatch
    from .experts.predictors import slots_right
    from .experts.prefetch import DraftPrefetch
    from .experts.router import RouterPredictor
    from .runtime.acceptance import greedy_accept, sample_accept, sample_token
    from .search import packed

    tree, experts, cached, cost = _toy()
    tree.accepted_path(np.array([6, 0, 0]))
    greedy_accept(tree, np.array([0, 1]), np.array([6, 0]))
    # a drafted level's acceptance calibration (the drafter's, with --acceptance)
    ints, floats = np.zeros(3, dtype=np.int64), np.zeros(3)
    kernels.acceptance.calibrate_level(np.log(np.array([0.5, 0.25])), 2, np.array([1, 2]), ints[:2], ints,
                                       floats.copy(), np.ones(3), np.array([0.0, 1.0]), np.array([0.0, 1.0]),
                                       np.zeros(0), 1e-4, np.zeros(0), 0)
    # a sampling decode's first token and walk
    rng = np.random.default_rng(0)
    sample_token(torch.zeros(8), 1.0, rng)
    sample_accept(tree, np.array([0, 1]), torch.zeros(2, 8), 1.0, rng)
    tree.attention_mask(np.array([0, 1]), prefix_len=2)
    kernels.evaluate.union_accounting(experts, np.array([0, 1]), experts[:2], packed(cached))
    kernels.bitsets.count_missing(experts, 0, packed(cached))      # the root's misses
    slots_right(experts, experts)
    router = RouterPredictor(embed=torch.zeros(8, 4), router_weight=torch.ones(1, 2, 4), top_k=1, min_nodes=1,
                             batch_nodes=1)
    # the decoder hands every node the last committed token's routing as a read-only broadcast
    # (one row of it, the root's, is passed on as it is: a read-only array to the kernel)
    last_known = np.broadcast_to(np.zeros((1, 1), dtype=np.int64), (4, 1, 1))
    for n, known in ((2, None), (2, last_known[:2]), (1, last_known[:1])):
        router.predict(NodeBatch(tokens=np.arange(1, n + 1), last_known=known, context=torch.ones(n, 4)))
    router.update(np.array([1]), np.zeros((1, 1, 1), dtype=np.int64), 2, context=torch.ones(1, 4))
    kernels.kv.compact(np.zeros((2, 4, 8), dtype=np.uint8), 1, np.array([0, 2]))
    # the live drafter's level: its nodes and frontier, the frontier's mask
    rows = np.zeros((4, 3), dtype=np.int64)
    floats = np.zeros((2, 3))
    kernels.tree.add_level(np.zeros(1, dtype=np.int64), np.zeros(2), np.arange(2), np.arange(2), 1, 1, *rows[:3],
                           *floats, True)
    kernels.tree.frontier_mask(np.array([1]), rows[1], rows[3], 1, 1)
    cache = ExpertCache(1, 2, 1)
    cache.begin_prompt()           # before each prompt's passes
    cache.admit(~cached)
    cache.begin_decode()           # after them (moe-infinity's counts)
    cache.admit_layer(0, np.array([1]))
    # the levers (+cache, +usage, +prefetch): the look-ahead keep before and after a use record,
    # the prefetch's plan and copies, and the admit by keep
    advisor = DraftLookahead()
    advisor.keep(tree, experts, [0], 2)
    advisor.observe(~cached)
    keep = advisor.keep(tree, experts, np.array([0, 1]), 2)
    _, priority = DraftPrefetch().plan(tree, experts, cached, cost.replace(draft_level_s=1.0), keep=keep)
    cache.prefetch(np.ones_like(cached), keep=priority)
    cache.admit(~cached, keep=keep)
    # the online refit's forward selection (every other refit of a live run)
    one, none = np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int64)
    kernels.identify.system(np.eye(2), np.ones(2), 1.0, one, none, False, np.ones(2), np.zeros(2))
    kernels.identify.score(np.eye(2), np.ones(2), one, one + 1, True, np.ones(2), np.zeros(2), 0, 1.0, 1.0, 1e-4, 1.0,
                           0.3, 3.0, 1e8)


PARTS = (_search, _policy, _runtime)


def cache_is_cold() -> bool:
    """Whether numba has no on-disk cache yet for the heaviest kernels (a heuristic: an index
    written by another version or for another source is found stale only when loaded)."""
    heavy = (kernels.search.best_subtree, kernels.decide.decide_level)
    try:
        return not all(os.path.isfile(k._cache._cache_file._index_path) for k in heavy)
    except AttributeError:            # numba's internals moved: assume warm, compile in-process
        return False


def _usable_cores() -> int:
    """Cores this process may run on (its affinity where the platform says, else all)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def warm_up(parallel: bool | None = None) -> float:
    """Load (or, the first time after an install or an edit, compile) the kernels a live decoder
    calls every cycle: a drafted level's nodes, frontier and mask and its acceptance calibration,
    a tree's checks, mask and accepted path (greedy, and sampled), the search, SpecFit's per-level
    decision and what a cycle teaches it (also with acceptance learned online), ``evaluate``, the cycle's union accounting, the slot precision, the router predictor's
    selection, the cache's admits, the KV compaction and the levers' rules (look-ahead keep,
    prefetch, admit by keep) and the online refit's forward selection, so that no timed cycle pays
    for it.

    ``parallel``: compile the runtime's kernels in a child process while this one compiles the
    search and the policy (None: when the cache is cold and this process may use more than one
    core). A child that fails only costs its head start: this process then compiles what is
    missing itself. Returns the seconds it took."""
    import time

    start = time.perf_counter()
    if parallel is None:
        parallel = _usable_cores() > 1 and cache_is_cold()
    if parallel:
        _compile_side_by_side()
    for part in PARTS:
        part()
    return time.perf_counter() - start


def _compile_side_by_side() -> None:
    """The runtime's kernels in a child process (spawned: no inherited threads) while this one
    compiles the search and the policy (which calls the search's kernels: one group)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    try:
        with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
            child = pool.submit(_runtime)
            _search()
            _policy()
            child.exception()             # wait; what a failed child left is compiled below
    except (OSError, RuntimeError):       # no processes here (a sandbox, a frozen app): in-process
        pass
