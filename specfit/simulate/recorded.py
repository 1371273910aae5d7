"""Re-charging a live trace as it ran: the recorded decisions, another cache or cost model.

A live trace (``specfit decode --record``, not ``--record-full``) holds the cycles one policy ran:
which nodes it verified and their true experts. Its decisions are fixed, so it cannot answer
"what would another policy do" (that needs a position-indexed trace and :mod:`.replay`), but it
can answer "what would these cycles have cost with this cache and this cost model": each
sequence's prompt passes (recorded in the trace's metadata) and then each cycle's verified union go
through the same :class:`~specfit.experts.cache.ExpertCache` the live decoder used, in the same
order. With the live run's cache settings the hits, misses and bytes are the live run's exactly.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..costmodel import CostModel
from ..errors import SpecFitError
from ..experts.cache import ExpertCache
from ..traces.format import Trace
from ..traces.validate import prompt_passes

__all__ = ["recharge"]


def recharge(trace: Trace, cache: ExpertCache, cost: CostModel | None = None) -> pd.DataFrame:
    """Per cycle of ``trace``: ``sequence``, ``position``, ``hits``, ``misses``, ``bytes_h2d`` and
    (with ``cost``) ``charged_time_s``, with ``cache`` (mutated) carrying state across cycles and
    sequences as the live run's did."""
    moved = trace.expert_bytes if cost is None else cost.bytes_per_miss(trace.expert_bytes)   # one miss's bytes
    prefill = prompt_passes(trace, "recharge")
    if trace.position_indexed:
        raise SpecFitError("recharge: the trace is position-indexed (a --record-full recording, one token per "
                           "cycle); replay it with specfit simulate instead")
    L, E = trace.n_layers, trace.n_experts
    rows = []
    previous = None
    for c in range(trace.n_cycles):
        sequence = int(trace.sequence[c])
        if sequence != previous:
            if sequence not in prefill:
                raise SpecFitError(f"recharge: the trace does not record sequence {sequence}'s prompt pass "
                                   "(recorded by an older SpecFit); its cache state cannot be rebuilt")
            cache.begin_prompt()
            for union in prefill[sequence]:      # the prompt's passes, one after another
                cache.admit(union)
            cache.begin_decode()
            previous = sequence
        r = trace.rows(c)
        verified = trace.verified[r]
        union = np.zeros((L, E), dtype=bool)
        true = trace.true_experts[r][verified].astype(np.int64)
        union[np.broadcast_to(np.arange(L)[None, :, None], true.shape).ravel(), true.ravel()] = True
        result = cache.admit(union)
        rows.append({"sequence": sequence, "position": int(trace.position[c]), "hits": result.total_hits,
                     "misses": result.total_misses, "bytes_h2d": result.total_misses * moved,
                     "nodes_verified": int(verified.sum())})
    frame = pd.DataFrame(rows)
    if cost is not None and len(frame):
        levels = np.array([int(trace.depth[trace.rows(c)].max()) for c in range(trace.n_cycles)])
        frame["charged_time_s"] = cost.predict_counts(levels, frame["nodes_verified"], frame["hits"], frame["misses"])
    return frame
