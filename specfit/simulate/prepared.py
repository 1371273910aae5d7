"""A position-indexed trace prepared for replay: everything that does not depend on the policy,
computed once per trace as flat arrays over the trace's node rows (:class:`PreparedTrace`): the
path probabilities of the full trees and of the trees cut at fewer levels, the tree's size within
each number of levels, the predicted experts, and the accepted path of every full tree (the
accepted path inside a selected, ancestor-closed subtree is its prefix inside the subtree,
because siblings carry distinct tokens). :func:`prepare_trace` adds the predictor's experts and
the calibrated acceptance; :mod:`specfit.simulate.replay` replays policies on the result.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import kernels
from ..errors import SpecFitError
from ..traces.format import Trace
from ..tree import DraftTree, bad_path_probs

__all__ = ["PreparedTrace", "prepare", "prepare_trace", "check_position_indexed", "check_router_model"]


@dataclass(eq=False)
class PreparedTrace:
    """Per-trace inputs of the replay, shared by every policy, cache size and cost model.

    Node arrays are aligned with the trace's rows (``trace.offsets`` splits them into cycles).
    """

    name: str
    trace: Trace
    predictor: str
    offsets: np.ndarray             # int64 [cycles + 1]: cycle c owns node rows offsets[c]:offsets[c + 1]
    parents: np.ndarray             # int16 [nodes]: local parent ids, -1 at roots
    depths: np.ndarray              # int16 [nodes]
    tokens: np.ndarray              # int32 [nodes]
    verdicts: np.ndarray            # int32 [nodes]: the target's greedy next token at each node
    true_experts: np.ndarray        # int16 [nodes, L, k]
    raw_probs: np.ndarray           # float64 [nodes]: the path probabilities given (drafter's or calibrated)
    drafter_probs: np.ndarray       # float64 [nodes]: the drafter's own (a chain follows its top-1, as drafted live)
    path_probs: np.ndarray          # float64 [nodes]: each full tree's, clipped to the parent's as a DraftTree does
    level_probs: np.ndarray         # float64 [nodes]: the same in a tree cut at fewer levels than drafted
    level_offsets: np.ndarray       # int64 [cycles + 1]: cycle c's level sizes are level_sizes[lo[c]:lo[c + 1]]
    level_sizes: np.ndarray         # int64: nodes within d levels, d = 0 .. the cycle's depth
    predicted_experts: np.ndarray   # int16 [nodes, L, k] the policies decide with (the true array for oracle)
    true_bits: np.ndarray           # uint64 [nodes, L, words]: each node's true experts per layer as a set
    predicted_bits: np.ndarray      # uint64 [nodes, L, words]: the same of the predicted (the true array for oracle)
    path_offsets: np.ndarray        # int64 [cycles + 1]: cycle c's accepted path is paths[po[c]:po[c + 1]]
    paths: np.ndarray               # int64: accepted paths of the full trees, root first, local node ids
    first_cycles: np.ndarray        # first cycle (position 0) of each sequence
    prefill_bits: np.ndarray        # uint64 [passes, L, words]: the experts each prompt pass made resident
    prefill_offsets: np.ndarray     # int64 [sequences + 1]: sequence s's passes in order are prefill_bits[po[s]:po[s + 1]]
                                    # (none where the trace does not record them; live recordings do)
    info: dict = field(default_factory=dict)   # e.g. the predictor's and calibrator's quality
    _trees: dict = field(default_factory=dict, repr=False)
    _memo: dict = field(default_factory=dict, repr=False)     # derived arrays, computed on first use

    @property
    def n_cycles(self) -> int:
        return self.trace.n_cycles

    @property
    def has_prefill(self) -> np.ndarray:
        """bool [sequences]: the trace records the sequence's prompt passes."""
        return np.diff(self.prefill_offsets) > 0

    @property
    def predicted_is_true(self) -> bool:
        """The policies decide with the true experts (the oracle predictor)."""
        return self.predicted_experts is self.true_experts

    @property
    def max_nodes(self) -> int:
        """Nodes of the largest drafted tree."""
        return int(self.trace.tree_sizes.max())

    @property
    def sibling_ranks(self) -> np.ndarray:
        """int64 [nodes]: each node's rank among its siblings by the drafter's probabilities, -1 at
        roots (:func:`specfit.sequoia.sibling_ranks`)."""
        if "sibling_ranks" not in self._memo:
            from ..sequoia import sibling_ranks
            self._memo["sibling_ranks"] = sibling_ranks(self.trace.parent_rows, self.drafter_probs)
        return self._memo["sibling_ranks"]

    def positional_rates(self) -> np.ndarray:
        """Sequoia's positional acceptance rates on this trace (:func:`specfit.sequoia.trace_rates`)."""
        if "positional_rates" not in self._memo:
            from ..sequoia import trace_rates
            self._memo["positional_rates"] = trace_rates(self.trace, self.sibling_ranks)
        return self._memo["positional_rates"]

    def accepted_path(self, cycle: int) -> np.ndarray:
        """The full tree's accepted path at ``cycle`` (local node ids, root first)."""
        return self.paths[self.path_offsets[cycle]:self.path_offsets[cycle + 1]]

    def depth(self, cycle: int) -> int:
        """Levels drafted at ``cycle``."""
        return int(self.level_offsets[cycle + 1] - self.level_offsets[cycle] - 1)

    def tree(self, cycle: int, levels: int | None = None) -> DraftTree:
        """The tree of ``cycle`` cut at ``levels`` drafted levels (all by default), built on first
        use and kept: the Python policies' view of the arrays the compiled ones read."""
        deepest = self.depth(cycle)
        levels = deepest if levels is None else min(int(levels), deepest)
        key = (cycle, levels)
        tree = self._trees.get(key)
        if tree is None:
            lo = int(self.offsets[cycle])
            n = int(self.level_sizes[self.level_offsets[cycle] + levels])
            # the DraftTree clips what it is given once: the given values for the full tree, the full
            # tree's for a cut one (so its path_probs are path_probs or level_probs exactly)
            probs = self.raw_probs if levels == deepest else self.path_probs
            tree = DraftTree(parents=self.parents[lo:lo + n].astype(np.int64), path_probs=probs[lo:lo + n],
                             tokens=self.tokens[lo:lo + n].astype(np.int64))
            self._trees[key] = tree
        return tree

    @property
    def level_trees(self) -> "_LevelTrees":
        """``level_trees[c][d]``: the tree of cycle c cut at d levels, built when asked for (prefer
        :meth:`tree`, and :attr:`max_nodes` over the largest ``level_trees[c][-1].n_nodes``)."""
        return _LevelTrees(self)

    @property
    def reference(self) -> list[np.ndarray]:
        """Each sequence's reference output after position 0 (what any policy must commit)."""
        tr = self.trace
        out = []
        bounds = np.r_[self.first_cycles, tr.n_cycles]
        for a, b in zip(bounds[:-1], bounds[1:]):
            out.append(tr.verdict[tr.offsets[a:b]].astype(np.int64))
        return out


class _LevelTrees:
    """A lazy ``[cycle][levels]`` sequence of :meth:`PreparedTrace.tree`."""

    def __init__(self, prep: PreparedTrace):
        self._prep = prep

    def __len__(self) -> int:
        return self._prep.n_cycles

    def __getitem__(self, cycle: int) -> "_CycleTrees":
        if not -len(self) <= cycle < len(self):
            raise IndexError(cycle)
        return _CycleTrees(self._prep, cycle % len(self))

    def __iter__(self):
        return (_CycleTrees(self._prep, c) for c in range(len(self)))


class _CycleTrees:
    """One cycle's trees by number of levels, each built when first asked for."""

    def __init__(self, prep: PreparedTrace, cycle: int):
        self._prep, self._cycle = prep, cycle

    def __len__(self) -> int:
        return self._prep.depth(self._cycle) + 1

    def __getitem__(self, levels: int) -> DraftTree:
        if not -len(self) <= levels < len(self):
            raise IndexError(levels)
        return self._prep.tree(self._cycle, levels % len(self))


def check_position_indexed(trace: Trace, where: str) -> None:
    """One error, naming ``where`` (the trace's file or label), for a trace the replay cannot use."""
    if not trace.position_indexed:
        raise SpecFitError(f"{where}: counterfactual replay needs a position-indexed trace (a full tree at every "
                           "position with every verdict known); this one was recorded as "
                           f"{trace.meta['recording'].get('kind')!r} without it (record one with "
                           f"`specfit decode --record FILE --record-full`)")


def prepare(name: str, trace: Trace, predicted_experts: np.ndarray, path_probs: np.ndarray | None = None,
            predictor: str = "oracle", info: dict | None = None) -> PreparedTrace:
    """Cut the trace into the replay's flat arrays. ``predicted_experts`` ``[nodes, L, k]`` is what
    the policies decide with; ``path_probs`` ``[nodes]`` replaces the drafter's (e.g. calibrated).

    The trace is validated again here (a few ms): the compiled replay indexes by its depths,
    parents and offsets without bounds checks, so a trace changed in memory after it was read (or
    read with ``validate=False``) must not reach it unchecked."""
    from ..traces.validate import prompt_passes, validate_trace

    validate_trace(trace, name)
    check_position_indexed(trace, name)
    # the dtypes the compiled kernels take (those of a trace read from disk: no copies)
    offsets = np.ascontiguousarray(trace.offsets, dtype=np.int64)
    parents = np.ascontiguousarray(trace.parent, dtype=np.int16)
    depths = np.ascontiguousarray(trace.depth, dtype=np.int16)
    tokens = np.ascontiguousarray(trace.token, dtype=np.int32)
    verdicts = np.ascontiguousarray(trace.verdict, dtype=np.int32)
    true_experts = np.ascontiguousarray(trace.true_experts, dtype=np.int16)
    n = trace.n_nodes
    cycle_of = trace.cycle_of_node
    root = trace.parent < 0
    parent_row = np.where(root, np.arange(n), trace.parent_rows)
    drafter = np.asarray(trace.path_prob, dtype=np.float64)
    raw = drafter if path_probs is None else np.asarray(path_probs, dtype=np.float64)
    _check_path_probs(name, raw, root, parent_row, cycle_of, offsets)
    # a DraftTree clips each node to its parent's value (rounding slack); a tree cut at fewer
    # levels is built from the full tree's clipped values and clips once more
    full = np.where(root, raw, np.minimum(raw, raw[parent_row]))
    level = np.where(root, full, np.minimum(full, full[parent_row]))
    depth = trace.depth.astype(np.int64)
    n_levels = np.maximum.reduceat(depth, offsets[:-1]) + 1
    level_offsets = np.r_[0, np.cumsum(n_levels)].astype(np.int64)
    # nodes within d levels: depth is sorted within a cycle, so count the nodes at depth <= d
    within = np.zeros(level_offsets[-1], dtype=np.int64)
    np.add.at(within, level_offsets[:-1][cycle_of] + depth, 1)
    level_sizes = np.cumsum(within)
    level_sizes -= np.repeat(np.r_[0, level_sizes[level_offsets[1:-1] - 1]], n_levels)
    if predicted_experts is trace.true_experts:
        predicted_experts = true_experts     # the oracle predictor: the replay then skips a second union
    else:
        predicted_experts = _checked_experts(name, predicted_experts, trace)
    # the per-node sets the replay takes its unions on (an OR per word instead of a pass per id)
    true_bits = _packed(name, "true experts", true_experts, trace.n_experts)
    predicted_bits = true_bits if predicted_experts is true_experts else \
        _packed(name, "predicted experts", predicted_experts, trace.n_experts)
    path_offsets, paths = kernels.replay.accepted_paths(offsets, parents, depths, tokens, verdicts)
    seq = trace.sequence
    first = np.flatnonzero(np.r_[True, seq[1:] != seq[:-1]])
    # the cache a live run's first cycle saw held its prompt passes' experts: admitted before it,
    # one pass after another
    passes = prompt_passes(trace, name)
    recorded = [passes.get(int(seq[c]), np.zeros((0, trace.n_layers, trace.n_experts), dtype=bool)) for c in first]
    prefill_offsets = np.r_[0, np.cumsum([p.shape[0] for p in recorded])].astype(np.int64)
    prefill_bits = np.zeros((prefill_offsets[-1], trace.n_layers, kernels.bitsets.n_words(trace.n_experts)),
                            dtype=np.uint64)
    for p, mask in enumerate(m for r in recorded for m in r):
        prefill_bits[p] = kernels.bitsets.pack_mask(mask)
    info = dict(info or {})
    slots, right = _slots_right(predicted_experts, true_experts, ~root)
    info.setdefault("predicted_slots", slots)
    info.setdefault("predicted_slots_right", right)
    info.setdefault("slot_precision", right / slots if slots else 1.0)
    # read-only, as a Ray worker receives them (zero-copy from the object store): numba compiles a
    # kernel once per argument types, read-only ones included, so a sweep's workers find the kernels
    # simulate compiled in the cache instead of each compiling its own (minutes per worker)
    frozen: dict[int, np.ndarray] = {}

    def read_only(a: np.ndarray) -> np.ndarray:
        if id(a) not in frozen:                  # arrays shared (the oracle's experts) stay shared
            frozen[id(a)] = v = a.view()
            v.flags.writeable = False
        return frozen[id(a)]

    arrays = dict(offsets=offsets, parents=parents, depths=depths, tokens=tokens, verdicts=verdicts,
                  true_experts=true_experts, raw_probs=raw, drafter_probs=drafter, path_probs=full, level_probs=level,
                  level_offsets=level_offsets, level_sizes=level_sizes, predicted_experts=predicted_experts,
                  true_bits=true_bits, predicted_bits=predicted_bits, path_offsets=path_offsets, paths=paths,
                  first_cycles=first, prefill_bits=prefill_bits, prefill_offsets=prefill_offsets)
    return PreparedTrace(name=name, trace=trace, predictor=predictor, info=info,
                         **{key: read_only(np.asarray(a)) for key, a in arrays.items()})


def _check_path_probs(name, probs, root, parent_row, cycle_of, offsets) -> None:
    """The checks a DraftTree makes, on every cycle at once, naming the first bad node."""
    if probs.shape != root.shape:
        raise SpecFitError(f"{name}: path_probs: expected one value per node ({root.size}), got shape {probs.shape}")
    bad = bad_path_probs(probs, parent_row, root)
    if bad is not None:
        what = {"range": "must be probabilities in [0, 1]", "root": "must be 1 at the root",
                "rising": "must not increase along a path"}[bad[1]]
        i = int(np.flatnonzero(bad[0])[0])
        c = int(cycle_of[i])
        raise SpecFitError(f"{name}: path_probs {what} (cycle {c}, node {i - int(offsets[c])}, got {probs[i]!r})")


def _packed(name: str, what: str, experts: np.ndarray, n_experts: int) -> np.ndarray:
    bits, ok = kernels.bitsets.pack_rows(experts, n_experts)
    if not ok:
        raise SpecFitError(f"{name}: {what}: expected ids in [0, {n_experts}), got [{experts.min()}, {experts.max()}]")
    return bits


def _checked_experts(name: str, experts, trace: Trace) -> np.ndarray:
    experts = np.asarray(experts)
    want = (trace.n_nodes, trace.n_layers, trace.top_k)
    if experts.shape != want or not np.issubdtype(experts.dtype, np.integer):
        raise SpecFitError(f"{name}: predicted experts: expected integers of shape {list(want)}, got "
                         f"{experts.dtype} {list(experts.shape)}")
    if experts.size and (experts.min() < 0 or experts.max() >= trace.n_experts):
        raise SpecFitError(f"{name}: predicted experts: expected ids in [0, {trace.n_experts}), got "
                         f"[{experts.min()}, {experts.max()}]")
    return np.ascontiguousarray(experts, dtype=np.int16)


def _slots_right(predicted: np.ndarray, true: np.ndarray, draft: np.ndarray) -> tuple[int, int]:
    """(predicted, right) (layer, expert) slots of the draft nodes: how many name an expert the
    node really routes to, what pricing prediction uncertainty (:func:`specfit.search.uncertainty_price_s`)
    needs."""
    from ..experts.predictors import slots_right

    rows = np.flatnonzero(draft)
    total = rows.size * int(np.prod(true.shape[1:]))
    if predicted is true:
        return total, total
    right = 0
    for lo in range(0, rows.size, 65536):   # in chunks: keep the int64 copies slots_right takes small
        chunk = rows[lo:lo + 65536]
        right += slots_right(predicted[chunk], true[chunk])
    return int(total), int(right)


def check_router_model(predictor: str, model_dir) -> None:
    """``predictor="router"`` reads the target's routers from ``model_dir``: without one it is one
    error, which a command gives with its other option checks (before any trace is read)."""
    if predictor == "router" and model_dir is None:
        raise SpecFitError("--predictor router: needs the target's weights; pass --model DIR (the trace's model)")
    if predictor != "router" and model_dir is not None:
        raise SpecFitError(f"--model {model_dir}: only --predictor router reads the target's weights; --predictor is "
                           f"{predictor}")


def prepare_trace(name: str, trace: Trace, predictor: str = "oracle", acceptance: str = "calibrated",
                  model_dir=None) -> PreparedTrace:
    """:func:`prepare` with the experts of ``predictor`` and, for ``acceptance="calibrated"``, path
    probabilities from the acceptance calibrator (both fitted on the other sequences only).
    ``predictor="router"`` reads the target's routers from ``model_dir`` (the trace's model)."""
    from ..experts.calibration import cross_calibrate
    from ..experts.predictors import cross_predict, parse_predictor

    parse_predictor(predictor)
    check_router_model(predictor, model_dir)
    if acceptance not in ("calibrated", "raw"):
        raise SpecFitError(f"--acceptance: expected calibrated or raw, got {acceptance!r}")
    unfittable = trace.meta.get("recording", {}).get("unfittable_predictors", [])
    if predictor in unfittable:
        raise SpecFitError(f"--predictor {predictor}: the trace cannot fit it (its token ids are "
                           f"{trace.meta['recording'].get('token_ids', 'unknown')}); use oracle, parent or recorded")
    probs = cross_calibrate(trace) if acceptance == "calibrated" else None
    if predictor == "router":
        from ..runtime.loader import load_router

        router = load_router(model_dir)
        if router.layers_experts != (trace.n_layers, trace.n_experts):
            raise SpecFitError(f"--model {model_dir}: {router.layers_experts[0]} layers x "
                               f"{router.layers_experts[1]} experts, the trace has {trace.n_layers} x {trace.n_experts}")
        experts = router.predict_trace(trace)
    else:
        experts = cross_predict(predictor, trace)
    return prepare(name, trace, experts, probs, predictor=predictor)
