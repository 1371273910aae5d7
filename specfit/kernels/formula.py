"""The cycle-time formula (this module imports no numba): :mod:`.evaluate` compiles it as it is,
and :class:`specfit.costmodel.CostModel` applies it to scalars and numpy arrays, so every driver
sums the same terms in the same order."""


def cycle_time_s(draft_level_s, base_s, per_node_s, hit_s, miss_s, draft_levels, n_nodes, hits, misses):
    """Seconds of a cycle: the draft levels, the base pass, the verified nodes, the hits and the misses."""
    return draft_level_s * draft_levels + base_s + per_node_s * n_nodes + hit_s * hits + miss_s * misses
