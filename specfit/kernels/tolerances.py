"""Float tolerances of the exact search, shared by the compiled kernels and the Python wrappers
(this module imports no numba)."""

# Ratios within this relative distance are ties (float rounding of sums that are equal in reals).
TIE_REL = 1e-12
# The inner solver treats gains below this many tokens as zero: far above the rounding of
# p - lam * cost (~1e-16 for the magnitudes involved), far below any gain that changes a ratio by
# TIE_REL, even summed over a few hundred nodes.
GAIN_EPS = 1e-14
# The minimum cut counts a residual capacity below this share of the weights' total magnitude (plus
# GAIN_EPS) as saturated: what the flow's subtractions round off, e.g. a project worth the float
# sum of hundreds of its costs keeps a residual of ~1e-11 at weights of 1e5 (a tie, not a gain).
FLOW_REL = 1e-15
# A path probability may exceed its parent's by this much (float rounding of products of the same
# edge probabilities); a tree clips it to the parent's value.
PROB_SLACK = 1e-9
