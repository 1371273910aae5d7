"""Float tolerances of the exact search, shared by the compiled kernels and the Python wrappers
(this module imports no numba)."""

# Ratios within this relative distance are ties (float rounding of sums that are equal in reals).
TIE_REL = 1e-12
# The inner solver treats gains below this many tokens as zero: far above the rounding of
# p - lam * cost (~1e-16 for the magnitudes involved), far below any gain that changes a ratio by
# TIE_REL. It applies to each subtree on its own: n subtrees each just below it are dropped
# together, a loss of up to n x 1e-14 tokens (past TIE_REL of a one-token ratio from about 100
# such subtrees; no drafter's probabilities come near 1e-14).
GAIN_EPS = 1e-14
# The minimum cut counts a residual capacity below this share of the weights' total magnitude (plus
# GAIN_EPS) as saturated: what the flow's subtractions round off, e.g. a project worth the float
# sum of hundreds of its costs keeps a residual of ~1e-11 at weights of 1e5 (a tie, not a gain).
# The share is of all the weights, so an item no selection affords (a miss at 1e8 times the base
# cost) widens the margin for every other gain of the same solve.
FLOW_REL = 1e-15
# A path probability may exceed its parent's by this much (float rounding of products of the same
# edge probabilities); a tree clips it to the parent's value.
PROB_SLACK = 1e-9
