"""Counterfactual replay of a position-indexed trace through one policy.

Greedy decoding is lossless, so every policy produces the trace's reference output; a policy only
decides how many tokens each cycle commits, and so at which positions cycles start. The replay
starts each sequence at position 0; at position t it hands the policy the tree drafted there (with
*predicted* experts), lets it choose a subtree, commits the greedy accepted path inside that
subtree plus the bonus token, charges the cycle with the *true* experts of the subtree against
the expert cache (which then admits them), and moves to position t + committed. The cache state
carries from cycle to cycle and from sequence to sequence.

Everything that does not depend on the policy is computed once per trace in
:class:`PreparedTrace`: draft trees cut at every level, predicted and true expert arrays,
and the accepted path of every full tree (the accepted path inside a selected, ancestor-closed
subtree is its prefix inside the subtree, because siblings carry distinct tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..costmodel import CostModel
from ..errors import SpecFitError
from ..experts.cache import ExpertCache
from ..policies import CycleView, Policy, choose
from ..traces.format import Trace
from ..tree import DraftTree

__all__ = ["PreparedTrace", "prepare", "prepare_trace", "replay", "CycleLog", "CYCLE_COLUMNS"]


@dataclass
class PreparedTrace:
    """Per-cycle inputs of the replay, shared by every policy, cache size and cost model."""

    name: str
    trace: Trace
    predictor: str
    level_trees: list[tuple[DraftTree, ...]]   # [cycle][d]: the tree of the first d levels
    level_sizes: list[np.ndarray]              # [cycle]: int64 [depth + 1] nodes within d levels
    predicted: list[np.ndarray]                # [cycle]: int64 [n, L, k]
    true: list[np.ndarray]                     # [cycle]: int64 [n, L, k]
    verdicts: list[np.ndarray]                 # [cycle]: int64 [n]
    accepted: list[np.ndarray]                 # [cycle]: accepted path of the full tree, root first
    true_items: list[np.ndarray]               # [cycle]: int64 [n, L * k] true experts as layer * E + expert
    predicted_items: list[np.ndarray]          # [cycle]: the same for the predicted experts
    first_cycles: np.ndarray                   # first cycle (position 0) of each sequence
    info: dict = field(default_factory=dict)   # e.g. the predictor's and calibrator's quality

    @property
    def n_cycles(self) -> int:
        return len(self.level_trees)

    @property
    def reference(self) -> list[np.ndarray]:
        """Each sequence's reference output after position 0 (what any policy must commit)."""
        tr = self.trace
        out = []
        bounds = np.r_[self.first_cycles, tr.n_cycles]
        for a, b in zip(bounds[:-1], bounds[1:]):
            out.append(tr.verdict[tr.offsets[a:b]].astype(np.int64))
        return out


def prepare(name: str, trace: Trace, predicted_experts: np.ndarray, path_probs: np.ndarray | None = None,
            predictor: str = "oracle", info: dict | None = None) -> PreparedTrace:
    """Cut the trace into per-cycle arrays. ``predicted_experts`` ``[nodes, L, k]`` is what the
    policies decide with; ``path_probs`` ``[nodes]`` replaces the drafter's (e.g. calibrated)."""
    if not trace.position_indexed:
        raise SpecFitError(f"{name}: counterfactual replay needs a position-indexed trace (a full tree at every "
                           "position with every verdict known); this one was recorded as "
                           f"{trace.meta['recording'].get('kind')!r} without it")
    probs = trace.path_prob if path_probs is None else np.asarray(path_probs, dtype=np.float64)
    level_trees, level_sizes, pred, true, verdicts, accepted = [], [], [], [], [], []
    for c in range(trace.n_cycles):
        r = trace.rows(c)
        tree = DraftTree(parents=trace.parent[r].astype(np.int64), path_probs=probs[r],
                         tokens=trace.token[r].astype(np.int64))
        depth = tree.depth
        sizes = np.searchsorted(depth, np.arange(tree.max_depth + 1), side="right")   # depth is sorted
        level_trees.append(tuple(tree.subtree(np.arange(n)) if n < tree.n_nodes else tree for n in sizes))
        level_sizes.append(sizes)
        true.append(trace.true_experts[r].astype(np.int64))
        # the oracle predictor's arrays are the true ones (the replay then skips a second union)
        pred.append(true[-1] if predicted_experts is trace.true_experts else predicted_experts[r].astype(np.int64))
        v = trace.verdict[r].astype(np.int64)
        verdicts.append(v)
        accepted.append(tree.accepted_path(v))
    seq = trace.sequence
    first = np.flatnonzero(np.r_[True, seq[1:] != seq[:-1]])
    layer_base = (np.arange(trace.n_layers) * trace.n_experts)[None, :, None]
    true_items = [(e + layer_base).reshape(e.shape[0], -1) for e in true]
    info = dict(info or {})
    slots, right = _slots_right(pred, true)
    info.setdefault("predicted_slots", slots)
    info.setdefault("predicted_slots_right", right)
    info.setdefault("slot_precision", right / slots if slots else 1.0)
    return PreparedTrace(name=name, trace=trace, predictor=predictor, level_trees=level_trees,
                         level_sizes=level_sizes, predicted=pred, true=true, verdicts=verdicts,
                         accepted=accepted,
                         true_items=true_items,
                         predicted_items=[(e + layer_base).reshape(e.shape[0], -1) if e is not t else ti
                                          for e, t, ti in zip(pred, true, true_items)],
                         first_cycles=first, info=info)


def prepare_trace(name: str, trace: Trace, predictor: str = "oracle", acceptance: str = "calibrated",
                  model_dir=None) -> PreparedTrace:
    """:func:`prepare` with the experts of ``predictor`` and, for ``acceptance="calibrated"``, path
    probabilities from the acceptance calibrator (both fitted on the other sequences only).
    ``predictor="router"`` reads the target's routers from ``model_dir`` (the trace's model)."""
    from ..experts.calibration import cross_calibrate
    from ..experts.predictors import PREDICTORS, cross_predict

    if predictor not in PREDICTORS:
        raise SpecFitError(f"--predictor: expected one of {sorted(PREDICTORS)}, got {predictor!r}")
    if acceptance not in ("calibrated", "raw"):
        raise SpecFitError(f"--acceptance: expected calibrated or raw, got {acceptance!r}")
    unfittable = trace.meta.get("recording", {}).get("unfittable_predictors", [])
    if predictor in unfittable:
        raise SpecFitError(f"--predictor {predictor}: the trace cannot fit it (its token ids are "
                           f"{trace.meta['recording'].get('token_ids', 'unknown')}); use oracle, parent or recorded")
    probs = cross_calibrate(trace) if acceptance == "calibrated" else None
    if predictor == "router":
        if model_dir is None:
            raise SpecFitError("--predictor router: needs the target's weights; pass --model DIR (the trace's model)")
        from ..runtime.loader import load_router

        router = load_router(model_dir)
        if router.router_weight.shape[:2] != (trace.n_layers, trace.n_experts):
            raise SpecFitError(f"--model {model_dir}: {router.router_weight.shape[0]} layers x "
                               f"{router.router_weight.shape[1]} experts, the trace has {trace.n_layers} x {trace.n_experts}")
        experts = router.predict_trace(trace)
    else:
        experts = cross_predict(predictor, trace)
    return prepare(name, trace, experts, probs, predictor=predictor)


def _slots_right(predicted: list[np.ndarray], true: list[np.ndarray]) -> tuple[int, int]:
    """(predicted, right) (layer, expert) slots of the draft nodes: how many name an expert the
    node really routes to, what pricing prediction uncertainty (:func:`specfit.search.uncertainty_price_s`)
    needs."""
    from ..experts.predictors import slots_right

    right = sum(p[1:].size if p is t else slots_right(p[1:], t[1:]) for p, t in zip(predicted, true))
    total = sum(p[1:].size for p in predicted)
    return int(total), int(right)


def _union(items: np.ndarray, nodes: np.ndarray, n_items: int) -> np.ndarray:
    """[L * E] bool union of the selected nodes' experts: :func:`specfit.costmodel.expert_union`
    on the flat item ids precomputed once per trace (the replay's hot path)."""
    union = np.zeros(n_items, dtype=bool)
    union[items[nodes].ravel()] = True
    return union


@dataclass
class _LevelView(CycleView):
    """A :class:`CycleView` whose truncations come from the trees cut once in
    :func:`prepare` instead of being rebuilt every cycle (the policies are unchanged)."""

    level_trees: tuple = ()
    level_sizes: np.ndarray | None = None

    def truncated(self, levels: int) -> "_LevelView":
        levels = min(int(levels), len(self.level_trees) - 1)
        n = int(self.level_sizes[levels])
        return _LevelView(
            tree=self.level_trees[levels], experts=self.experts[:n], cached=self.cached, cost=self.cost,
            draft_levels=levels,
            verdicts=None if self.verdicts is None else self.verdicts[:n],
            true_experts=None if self.true_experts is None else self.true_experts[:n],
            level_trees=self.level_trees, level_sizes=self.level_sizes)


CYCLE_COLUMNS = ("sequence", "position", "nodes_verified", "draft_levels", "deepest_selected", "union_size",
                 "hits", "misses", "predicted_union_size", "predicted_misses", "union_overlap",
                 "predicted_time_s", "predicted_tokens", "committed_tokens")


@dataclass
class CycleLog:
    """Per-cycle columns of one replay (numpy arrays of equal length) and the committed tokens."""

    columns: dict[str, np.ndarray]
    committed: list[np.ndarray]        # per sequence: the tokens committed, in order

    def __len__(self) -> int:
        return int(self.columns["sequence"].size)


def replay(prep: PreparedTrace, policy: Policy, cache: ExpertCache, cost: CostModel) -> CycleLog:
    """Replay every sequence of ``prep`` through ``policy`` with ``cache`` (mutated: it carries
    state across cycles) and ``cost`` (the policy's cost model)."""
    L, E = prep.trace.n_layers, prep.trace.n_experts
    n = prep.n_cycles
    cols = {name: np.zeros(n, dtype=np.float64 if name.startswith("predicted_t") else np.int64)
            for name in CYCLE_COLUMNS}
    committed: list[np.ndarray] = []
    i = 0
    bounds = np.r_[prep.first_cycles, n]
    needs_truth = policy.needs_truth
    for seq_index, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
        c = int(start)
        tokens_out: list[np.ndarray] = []
        while c < stop:
            true = prep.true[c]
            view = _LevelView(
                tree=prep.level_trees[c][-1], experts=prep.predicted[c], cached=cache.resident(), cost=cost,
                draft_levels=len(prep.level_trees[c]) - 1,
                verdicts=prep.verdicts[c] if needs_truth else None, true_experts=true if needs_truth else None,
                level_trees=prep.level_trees[c], level_sizes=prep.level_sizes[c])
            sel = choose(policy, view)
            nodes = sel.nodes
            tree = prep.level_trees[c][-1]
            path = prep.accepted[c]
            selected = np.zeros(tree.n_nodes, dtype=bool)
            selected[nodes] = True
            inside = selected[path]
            k = int(path.size if inside.all() else np.argmin(inside))   # root + accepted drafts
            union = _union(prep.true_items[c], nodes, L * E)
            result = cache.admit(union.reshape(L, E))
            # the experts the policy decided with (the oracle policy decides with the true ones)
            same = needs_truth or prep.predicted[c] is prep.true[c]
            predicted_union = union if same else _union(prep.predicted_items[c], nodes, L * E)
            tokens_out.append(np.r_[tree.tokens[path[1:k]], prep.verdicts[c][path[k - 1]]])
            cols["sequence"][i] = seq_index
            cols["position"][i] = c - start
            cols["nodes_verified"][i] = nodes.size
            cols["draft_levels"][i] = sel.draft_levels
            cols["deepest_selected"][i] = tree.depth[nodes[-1]]
            cols["union_size"][i] = result.total_hits + result.total_misses
            cols["hits"][i] = result.total_hits
            cols["misses"][i] = result.total_misses
            cols["predicted_union_size"][i] = sel.hits + sel.misses
            cols["predicted_misses"][i] = sel.misses
            cols["union_overlap"][i] = np.count_nonzero(predicted_union & union)
            cols["predicted_time_s"][i] = sel.time_s
            cols["predicted_tokens"][i] = sel.expected_tokens
            cols["committed_tokens"][i] = k
            i += 1
            c += k
        committed.append(np.concatenate(tokens_out) if tokens_out else np.zeros(0, dtype=np.int64))
    cols = {name: v[:i] for name, v in cols.items()}
    # the charged time: the same cost formula, on the true union against the cache state
    cols["charged_time_s"] = cost.predict_counts(cols["draft_levels"], cols["nodes_verified"], cols["hits"], cols["misses"])
    cols["bytes_h2d"] = cols["misses"] * prep.trace.expert_bytes   # the traced model's experts
    return CycleLog(columns=cols, committed=committed)
