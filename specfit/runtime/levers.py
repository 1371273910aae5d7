"""The decoder's side of the policy levers (:mod:`specfit.policies` ``+cache``, ``+prefetch``):
what the live driver does with a policy's cache advisor and prefetcher, and what it reports of the
cycle's misses, as the replay does (:mod:`specfit.simulate.replay`)."""

from __future__ import annotations

import time

import numpy as np

from .. import kernels
from ..policy_base import CycleView
from ..search import packed

__all__ = ["prefetch_level", "finish_prefetch", "miss_report", "cache_keep", "observe_union"]


def prefetch_level(decoder, draft, view: CycleView, prefetcher) -> CycleView:
    """Start the prefetcher's copies for the level about to be drafted; the view the policy
    decides on next sees them resident (the cache's bookkeeping is updated at once)."""
    start = time.perf_counter()
    offload = decoder.model.offload
    advisor = decoder.policy.cache_advisor
    keep = None if advisor is None else advisor.keep(view.tree, view.experts, [0], decoder.model.config.n_experts)
    mask, priority = prefetcher.plan(view.tree, view.experts, view.cached, decoder.cost, keep=keep)
    if mask.any():
        draft.prefetched += offload.prefetch(mask, keep=priority)
        view = CycleView(view.tree, view.experts, offload.cache.resident(read_only=True), view.cost, view.draft_levels)
    draft.search_time_s += time.perf_counter() - start
    return view


def finish_prefetch(decoder, draft) -> None:
    """Wait for the prefetch copies before the pass reads their slots; the prefetcher learns
    how much of their time overlapped the drafter."""
    if not draft.prefetched:
        return
    draft.prefetch_copy_s, draft.prefetch_wait_s = decoder.model.offload.wait_prefetch()
    if decoder.policy.prefetcher is not None:
        decoder.policy.prefetcher.observe(draft.prefetch_copy_s, draft.prefetch_wait_s)


def miss_report(draft, verification) -> dict:
    """What the predicted experts missed this cycle (see :class:`specfit.policy_base.Observation`)."""
    sel = draft.selection
    if sel is None or draft.cached is None or draft.experts.shape[1:] != verification.expert_ids.shape[1:]:
        return {}

    # the root's misses against the residency the policy saw, counted as the replay counts them
    # (the policy's searches packed that read-only residency already)
    cached = packed(draft.cached)
    return {"misses": verification.offload.total_misses, "predicted_misses": sel.misses,
            "root_misses": int(kernels.bitsets.count_missing(verification.expert_ids, 0, cached)),
            "root_predicted_misses": int(kernels.bitsets.count_missing(draft.experts, 0, cached))}


def cache_keep(decoder, draft) -> np.ndarray | None:
    """The policy's cache advisor's eviction priorities for this cycle's pass (None without)."""
    advisor = decoder.policy.cache_advisor
    if advisor is None or draft.experts.shape[1] == 0:
        return None
    return advisor.keep(draft.tree, draft.experts, draft.nodes, decoder.model.config.n_experts)


def observe_union(decoder, verification) -> None:
    """The policy's cache advisor learns the pass's true union (as the replay reports it)."""
    advisor = decoder.policy.cache_advisor
    if advisor is None:
        return
    config = decoder.model.config
    union = np.zeros((config.n_moe_layers, config.n_experts), dtype=bool)
    layer = np.broadcast_to(np.arange(union.shape[0])[None, :, None], verification.expert_ids.shape)
    union[layer.ravel(), verification.expert_ids.astype(np.int64).ravel()] = True
    advisor.observe(union)
