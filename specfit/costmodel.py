"""The cycle-time predictor.

    T(S, d) = draft_level_s * d + base_s + per_node_s * |S| + sum_l sum_{e in U_l(S)} w[l, e]
    w[l, e] = hit_s if expert (l, e) is resident else miss_s

``|S|`` counts the root. ``U_l(S)`` is the union of the experts that the nodes of S route to at
layer l. The prediction is linear in the five parameters, so a cycle is summarised by its feature
vector ``(draft_levels, 1, n_nodes, hits, misses)`` and fitting is a non-negative least squares.

The formula is written once, in :func:`cycle_time_s`: :meth:`CostModel.time_s` (scalars) and
:meth:`CostModel.predict_counts` (arrays) evaluate it, and the compiled kernels
(:mod:`specfit.kernels`) compile the same function and receive the parameters as
:attr:`CostModel.params`. The transfer part of a miss is :attr:`CostModel.transfer_s`.
"""

from __future__ import annotations

import math
import dataclasses
from dataclasses import asdict, dataclass, fields

import numpy as np

from . import kernels
from .kernels.formula import cycle_time_s
from .tree import DraftTree, check_nodes

__all__ = ["CostModel", "check_experts", "expert_union", "cycle_time_s", "PARAM_NAMES"]

PARAM_NAMES = ("draft_level_s", "base_s", "per_node_s", "hit_s", "miss_s")
CYCLE_RANGE_S = (1e-12, 1e6)    # what a user's model may price a term at (check_cycle_time)


def check_experts(tree: DraftTree | None, experts, cached) -> tuple[np.ndarray, np.ndarray]:
    """Validate ``experts[node, layer, slot]`` against the tree and ``cached[layer, expert]``."""
    experts = np.asarray(experts)
    cached = np.asarray(cached)
    if cached.ndim != 2 or cached.dtype != np.bool_:
        raise ValueError(f"cached: expected a bool array [layers, experts], got {cached.dtype} {cached.shape}")
    if experts.ndim != 3 or not np.issubdtype(experts.dtype, np.integer):
        raise ValueError(f"experts: expected an integer array [nodes, layers, top_k], got {experts.dtype} {experts.shape}")
    if tree is not None and experts.shape[0] != tree.n_nodes:
        raise ValueError(f"experts: expected {tree.n_nodes} nodes to match the tree, got {experts.shape[0]}")
    if experts.shape[1] != cached.shape[0]:
        raise ValueError(f"experts: expected {cached.shape[0]} layers to match cached, got {experts.shape[1]}")
    if experts.size and (experts.min() < 0 or experts.max() >= cached.shape[1]):
        raise ValueError(f"experts: expected expert ids in [0, {cached.shape[1]}), got [{experts.min()}, {experts.max()}]")
    return experts.astype(np.int64, copy=False), cached


def expert_union(experts: np.ndarray, nodes, n_experts: int) -> np.ndarray:
    """[layers, n_experts] bool: the union over ``nodes`` of their experts, per layer."""
    return kernels.bitsets.unpack(_union_bits(experts, nodes, n_experts), n_experts)


def _union_bits(experts, nodes, n_experts: int) -> np.ndarray:
    experts = np.ascontiguousarray(experts, dtype=np.int64)
    nodes = np.ascontiguousarray(nodes, dtype=np.int64).reshape(-1)
    if nodes.size and (nodes.min() < 0 or nodes.max() >= experts.shape[0]):
        raise ValueError(f"nodes: expected ids in [0, {experts.shape[0]}), got [{nodes.min()}, {nodes.max()}]")
    if not kernels.evaluate.experts_in_range(experts[nodes], n_experts):
        raise ValueError(f"experts: expected expert ids in [0, {n_experts})")
    union = np.empty((experts.shape[1], (n_experts + 63) // 64), dtype=np.uint64)
    kernels.evaluate.union_of_ids(experts, 0, nodes, nodes.size, union)
    return union


@dataclass(frozen=True)
class CostModel:
    """Scalar cycle-time model, all times in seconds.

    ``expert_bytes`` is not a time: it converts misses into bytes moved host-to-device. Frozen:
    the terms are checked once, here; :meth:`replace` and :meth:`scaled` make changed copies.
    """

    base_s: float
    per_node_s: float
    hit_s: float
    miss_s: float
    draft_level_s: float = 0.0
    expert_bytes: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
                raise ValueError(f"CostModel.{f.name}: expected a number, got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"CostModel.{f.name}: expected a finite non-negative number, got {value!r}")
            object.__setattr__(self, f.name, int(value) if f.name == "expert_bytes" else float(value))

    def bytes_per_miss(self, traced_expert_bytes: int) -> int:
        """The bytes one miss moves under this model: its own expert size, which its miss time
        was priced for (a replay at another model's scale, e.g. the demo's Qwen3-30B-A3B what-ifs
        of the tiny model's trace), or the traced model's when it carries none."""
        return self.expert_bytes or int(traced_expert_bytes)

    # ---------------------------------------------------------------- parameters
    @property
    def params(self) -> np.ndarray:
        """Parameters in the order of :data:`PARAM_NAMES` (the order of :meth:`features`)."""
        return np.array((self.draft_level_s, self.base_s, self.per_node_s, self.hit_s, self.miss_s))

    def replace(self, **changes) -> "CostModel":
        known = {f.name for f in fields(self)}
        unknown = set(changes).difference(known)
        if unknown:
            raise ValueError(f"CostModel: unknown parameter(s) {sorted(unknown)}; expected some of {sorted(known)}")
        return dataclasses.replace(self, **changes)

    def scaled(self, factor: float, plus_base_s: float = 0.0, plus_draft_level_s: float = 0.0,
               draft_factor: float | None = None) -> "CostModel":
        """Every time term times ``factor`` (a machine that runs the same work ``factor`` times
        slower), the drafted levels' term times ``draft_factor`` instead when it is given, then
        ``plus_base_s`` seconds more per cycle and ``plus_draft_level_s`` more per drafted level;
        the bytes per expert unchanged.

        The live decoder derives a model this way every cycle (the online speed, a policy's own
        overhead, the rest of a cycle once its drafter passes have run), so only the arguments are
        checked: every term of the result is a product and a sum of finite non-negative numbers, as
        the constructor would have checked."""
        draft_factor = factor if draft_factor is None else draft_factor
        for name, value in (("factor", factor), ("plus_base_s", plus_base_s), ("plus_draft_level_s", plus_draft_level_s),
                            ("draft_factor", draft_factor)):
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"CostModel.scaled: expected a finite {name} >= 0, got {value!r}")
        out = object.__new__(CostModel)
        terms = out.__dict__
        terms.update(self.__dict__)
        for name in PARAM_NAMES:
            terms[name] = float((draft_factor if name == "draft_level_s" else factor) * terms[name])
        terms["base_s"] += float(plus_base_s)
        terms["draft_level_s"] += float(plus_draft_level_s)
        return out

    @property
    def transfer_s(self) -> float:
        """The host-to-device part of a miss: what a miss costs beyond a hit (never negative)."""
        return max(self.miss_s - self.hit_s, 0.0)

    def scaled_transfer(self, factor: float, copy_latency_s: float = 0.0) -> "CostModel":
        """The model whose transfer part of a miss has its bandwidth part times ``factor`` (a link
        ``1 / factor`` times as fast, or experts ``factor`` times as large) and keeps
        ``copy_latency_s``, the fixed latency of a copy (at most the whole transfer), which
        neither changes."""
        fixed_s = min(max(copy_latency_s, 0.0), self.transfer_s)
        return self.replace(miss_s=self.hit_s + fixed_s + (self.transfer_s - fixed_s) * factor)

    # ---------------------------------------------------------------- prediction
    @staticmethod
    def features(draft_levels, n_nodes, hits, misses) -> np.ndarray:
        """Feature rows ``(draft_levels, 1, n_nodes, hits, misses)``; broadcasts over arrays."""
        cols = np.broadcast_arrays(*(np.asarray(x, dtype=np.float64) for x in (draft_levels, 1.0, n_nodes, hits, misses)))
        return np.stack(cols, axis=-1)

    def time_s(self, draft_levels: int, n_nodes: int, hits: int, misses: int) -> float:
        """Cycle time from counts (scalars)."""
        return float(cycle_time_s(self.draft_level_s, self.base_s, self.per_node_s, self.hit_s, self.miss_s,
                                  draft_levels, n_nodes, hits, misses))

    def predict_counts(self, draft_levels, n_nodes, hits, misses) -> np.ndarray:
        """Cycle times from count arrays (broadcast); float64."""
        counts = np.broadcast_arrays(*(np.asarray(x, dtype=np.float64) for x in (draft_levels, n_nodes, hits, misses)))
        return cycle_time_s(self.draft_level_s, self.base_s, self.per_node_s, self.hit_s, self.miss_s, *counts)

    def union_counts(self, experts, nodes, cached) -> tuple[int, int]:
        """(hits, misses) of the union of ``nodes``' experts against ``cached``."""
        hits, misses = kernels.bitsets.count_union(_union_bits(experts, nodes, cached.shape[1]),
                                                   kernels.bitsets.pack_mask(cached))
        return int(hits), int(misses)

    def predict(self, tree: DraftTree, nodes, experts, cached, draft_levels: int = 0) -> float:
        """Predicted cycle time of verifying ``nodes`` (ancestor-closed, with the root) after
        drafting ``draft_levels`` levels."""
        nodes = check_nodes(tree, nodes)
        experts, cached = check_experts(tree, experts, cached)
        hits, misses = self.union_counts(experts, nodes, cached)
        return self.time_s(draft_levels, nodes.size, hits, misses)

    # ---------------------------------------------------------------- persistence
    def to_dict(self) -> dict:
        return asdict(self)

    def check_cycle_time(self, source: str) -> "CostModel":
        """This model, refused (naming ``source``) when a cycle could take 0 s under it: no base,
        node or expert time, where a throughput would be tokens per 0 s and the search has nothing
        to divide by. A user's profile or ``--cost`` goes through this; the library's own models
        (a test's free model) need not. So is a miss cheaper than a hit: a miss is a hit plus the
        expert's copy (a fitted profile holds it by construction)."""
        from .errors import SpecFitError

        if not self.base_s + self.per_node_s + min(self.hit_s, self.miss_s) > 0:
            raise SpecFitError(f"{source}: predicts cycles of 0 s (base_s, per_node_s and hit_s or miss_s are all 0); "
                               f"expected base_s, per_node_s or both expert costs > 0")
        if self.miss_s < self.hit_s:
            raise SpecFitError(f"{source}: miss_s {self.miss_s:g} is below hit_s {self.hit_s:g}; expected miss_s >= "
                               "hit_s (a miss is a hit plus the expert's copy to the device)")
        # beyond these a throughput leaves float64: cycles of 1e-310 s make the search's ratio inf
        # (it keeps the root alone), terms of 1e306 s overflow a cycle's sum. A single tiny term
        # (a fit's 1e-18) is harmless beside the others
        terms = {name: getattr(self, name) for name in PARAM_NAMES}
        if max(terms.values()) < CYCLE_RANGE_S[0]:
            raise SpecFitError(f"{source}: every term is below {CYCLE_RANGE_S[0]:g} s ({max(terms.values()):g} the "
                               f"largest); expected a cycle's time in seconds")
        name = max(terms, key=terms.get)
        if terms[name] > CYCLE_RANGE_S[1]:
            raise SpecFitError(f"{source}: {name} {terms[name]:g} s; expected at most {CYCLE_RANGE_S[1]:g} s")
        return self

    @classmethod
    def from_dict(cls, d: dict, source: str = "cost model") -> "CostModel":
        if not isinstance(d, dict):
            raise ValueError(f"{source}: expected a JSON object with the cost-model parameters, got {type(d).__name__}")
        required = ("base_s", "per_node_s", "hit_s", "miss_s")
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError(f"{source}: missing cost-model field(s) {missing}")
        known = [f.name for f in fields(cls)]
        unknown = [k for k in d if k not in known]
        if unknown:      # a misspelt term would be read as 0 s without a word
            raise ValueError(f"{source}: unknown cost-model field(s) {unknown}; expected {', '.join(known)}")
        try:
            return cls(**d)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None
