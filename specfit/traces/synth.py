"""Synthetic position-indexed traces, and the tree builder that importers share.

A synthetic trace is built in three steps, each a documented model with checked statistics:

1. reference outputs: Zipf-distributed token ids, one sequence per prompt;
2. a drafted tree at every position (:mod:`specfit.traces.drafter`): probabilities, tokens and the
   target's verdicts, with the reference path inside it;
3. routing (:mod:`specfit.traces.routing`): the reference tokens' experts as a sequence; each
   drafted node's experts level by level: a node carrying the true next token at its parent
   gets that token's experts (the same token in the same context routes the same); an on-path
   node's are the reference's; any other node is a sibling of the true next token.

The statistics the generator was asked for and the ones it produced are both kept in the trace
metadata (``parameters`` and ``statistics``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import numpy as np

from .. import __version__
from ..calibrate.presets import SHAPES
from ..errors import SpecFitError
from .drafter import DrafterParams, draft_tree
from .format import Trace
from .routing import RoutingModel, TokenSampler, zipf_popularity
from .summary import trace_statistics

__all__ = ["MODEL_SHAPES", "WORKLOADS", "RoutingParams", "synthesize", "synthesize_and_model", "synthesis_record",
           "build_trees", "with_drafter_overrides"]

# the calibration presets' shapes, plus the vocabulary size that synthetic token ids need
_VOCAB_SIZES = {"qwen3-30b-a3b": 151936, "olmoe-1b-7b": 50304, "mixtral-8x7b": 32000}
MODEL_SHAPES = {name: {**{k: v for k, v in shape.to_dict().items() if k != "hidden_size"},
                       "vocab_size": _VOCAB_SIZES[name]} for name, shape in SHAPES.items()}

# drafter confidence per workload: full trees of width 3-4 commit more tokens per cycle from chat to
# math to code, around the 2-3 reported for EAGLE-3 on Qwen3-30B-A3B (traces/README.md, "Synthetic
# traces", has what they commit)
WORKLOADS = {
    "chat": DrafterParams(top1_prob=0.55, depth_decay=0.94),
    "math": DrafterParams(top1_prob=0.63, depth_decay=0.95),
    "code": DrafterParams(top1_prob=0.68, depth_decay=0.96),
}


@dataclass(frozen=True)
class RoutingParams:
    """Target routing statistics of a synthetic trace (see :mod:`specfit.traces.routing`)."""

    popularity_zipf: float = 0.7     # Zipf exponent of expert popularity (OLMoE layers: 0.5-0.85)
    consecutive_reuse: float = 0.45  # OLMoE decode routing: 0.45
    token_affinity: float = 0.72     # OLMoE decode routing: 0.72
    sibling_reuse: float = 0.3       # not observable in routing logs; bounded by the two above
    token_zipf: float = 1.0          # Zipf exponent of token frequencies

    def __post_init__(self) -> None:
        for name, option in (("popularity_zipf", "--popularity-zipf"), ("token_zipf", "--token-zipf")):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise SpecFitError(f"{option}: expected a finite Zipf exponent >= 0, got {value}")
        for name in ("consecutive_reuse", "token_affinity", "sibling_reuse"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:          # (NaN fails this too)
                raise SpecFitError(f"--{name.replace('_', '-')}: expected a fraction in [0, 1], got {value}")

    def to_dict(self) -> dict:
        return asdict(self)


def build_trees(reference_tokens: list[np.ndarray], reference_experts: list[np.ndarray], routing: RoutingModel,
                drafter: DrafterParams, tokens: TokenSampler, rng: np.random.Generator) -> dict:
    """Drafted, routed trees at every position of each reference sequence.

    ``reference_tokens[s]`` is sequence s's output ``[P + 1]`` (position t's root is token t and
    its next token t + 1), ``reference_experts[s]`` its routing ``[P + 1, layers, top_k]``.
    Returns the node and cycle arrays of a :class:`Trace` (without metadata).
    """
    cycles = []   # per sequence: the concatenated trees of its positions
    for ref_tok, ref_exp in zip(reference_tokens, reference_experts):
        P = ref_tok.size - 1
        trees = [draft_tree(ref_tok[t:], drafter, tokens, rng) for t in range(P)]
        sizes = np.array([tree.parent.size for tree in trees])
        start = np.r_[0, np.cumsum(sizes)[:-1]]
        position = np.repeat(np.arange(P), sizes)
        cat = {name: np.concatenate([getattr(tree, name) for tree in trees])
               for name in ("parent", "depth", "token", "draft_logprob", "path_prob", "verdict", "on_path")}
        gparent = np.where(cat["parent"] >= 0, cat["parent"] + start[position], -1)
        experts = np.full((cat["parent"].size,) + ref_exp.shape[1:], -1, dtype=np.int64)
        on = np.flatnonzero(cat["on_path"])
        experts[on] = ref_exp[position[on] + cat["depth"][on]]
        # route level by level: a level's parents are routed already
        for d in range(1, int(cat["depth"].max(initial=0)) + 1):
            nodes = np.flatnonzero((cat["depth"] == d) & ~cat["on_path"])
            if nodes.size == 0:
                continue
            parents, which = np.unique(gparent[nodes], return_inverse=True)
            # the true next token's experts at each expanded parent (shared by its children)
            true_next = np.empty((parents.size,) + ref_exp.shape[1:], dtype=np.int64)
            p_on = cat["on_path"][parents]
            true_next[p_on] = ref_exp[position[parents[p_on]] + d]
            if (~p_on).any():
                off = parents[~p_on]
                true_next[~p_on] = routing.next_token(experts[off], cat["verdict"][off], rng)
            anchor = true_next[which]
            is_next = cat["token"][nodes] == cat["verdict"][gparent[nodes]]
            experts[nodes[is_next]] = anchor[is_next]
            if (~is_next).any():
                experts[nodes[~is_next]] = routing.sibling(anchor[~is_next], cat["token"][nodes[~is_next]], rng)
        cycles.append((sizes, cat, experts.astype(np.int16)))     # the trace's dtype: a quarter of the memory kept
    sizes = np.concatenate([c[0] for c in cycles])
    cat = {name: np.concatenate([c[1][name] for c in cycles]) for name in cycles[0][1]}
    return {
        "offsets": np.r_[0, np.cumsum(sizes)].astype(np.int64),
        "sequence": np.repeat(np.arange(len(cycles)), [c[0].size for c in cycles]).astype(np.int32),
        "position": np.concatenate([np.arange(c[0].size) for c in cycles]).astype(np.int32),
        "parent": cat["parent"].astype(np.int16), "depth": cat["depth"].astype(np.int16),
        "token": cat["token"].astype(np.int32), "draft_logprob": cat["draft_logprob"].astype(np.float32),
        "path_prob": cat["path_prob"], "verdict": cat["verdict"].astype(np.int32),
        "true_experts": np.concatenate([c[2] for c in cycles]),
    }


def synthesize(shape: str, workload: str, n_tokens: int, seed: int = 0, sequence_tokens: int = 128,
               routing: RoutingParams = RoutingParams(), drafter: DrafterParams | None = None) -> Trace:
    """A synthetic position-indexed trace of ``n_tokens`` positions (split into sequences of
    ``sequence_tokens``) for a model shape of :data:`MODEL_SHAPES`.

    ``drafter`` defaults to the workload's parameters (:data:`WORKLOADS`); other workload names
    are allowed when ``drafter`` is given.
    """
    return synthesize_and_model(shape, workload, n_tokens, seed, sequence_tokens, routing, drafter)[0]


def synthesize_and_model(shape: str, workload: str, n_tokens: int, seed: int = 0, sequence_tokens: int = 128,
                         routing: RoutingParams = RoutingParams(),
                         drafter: DrafterParams | None = None) -> tuple[Trace, RoutingModel]:
    """:func:`synthesize`, and the routing model that drew every node's experts."""
    if shape not in MODEL_SHAPES:
        raise SpecFitError(f"--shape: unknown model shape {shape!r}; expected one of {sorted(MODEL_SHAPES)}")
    if drafter is None:
        if workload not in WORKLOADS:
            raise SpecFitError(f"--workload: unknown workload {workload!r}; expected one of {sorted(WORKLOADS)} "
                               "(or give the drafter statistics explicitly)")
        drafter = WORKLOADS[workload]
    if n_tokens < 1:
        raise SpecFitError(f"--tokens: expected at least 1 position, got {n_tokens}")
    if sequence_tokens < 1:
        raise SpecFitError(f"--sequence-tokens: expected at least 1 position a sequence, got {sequence_tokens}")
    model = MODEL_SHAPES[shape]
    rng = np.random.default_rng(seed)
    token_sampler = TokenSampler(model["vocab_size"], routing.token_zipf, rng)
    pop = zipf_popularity(model["n_layers"], model["n_experts"], routing.popularity_zipf, rng)
    router = RoutingModel(pop, routing.consecutive_reuse, routing.token_affinity, routing.sibling_reuse,
                          model["top_k"], model["vocab_size"], seed=seed).calibrate(token_sampler, rng)
    lengths = [sequence_tokens] * (n_tokens // sequence_tokens)
    if n_tokens % sequence_tokens:
        lengths.append(n_tokens % sequence_tokens)
    ref_tokens = [token_sampler.sample(n + 1, rng) for n in lengths]
    ref_experts = [router.sequences(t[None], rng)[0] for t in ref_tokens]
    arrays = build_trees(ref_tokens, ref_experts, router, drafter, token_sampler, rng)
    meta = synthesis_record(shape, workload, seed, sequence_tokens, routing, drafter)
    meta["parameters"].update(fitted={
        "popularity_power": router.popularity_power_.round(4).tolist(),
        "token_prob": router.token_prob_.round(4).tolist(),
        "consecutive_prob": router.consecutive_prob_.round(4).tolist(),
        "sibling_prob": router.sibling_prob_.round(4).tolist()},
        targets={"popularity_skew": float(router.popularity_skew.mean()),
                 "consecutive_reuse": routing.consecutive_reuse, "token_affinity": routing.token_affinity,
                 "sibling_reuse": routing.sibling_reuse})
    trace = Trace(meta=meta, **arrays)
    trace.meta["statistics"] = trace_statistics(trace)
    return trace, router


def synthesis_record(shape: str, workload: str, seed: int = 0, sequence_tokens: int = 128,
                     routing: RoutingParams = RoutingParams(), drafter: DrafterParams | None = None) -> dict:
    """The metadata of a trace :func:`synthesize` makes with these arguments, but for what it fits
    and measures: what the trace was made with, so a kept trace can be told from a stale one."""
    model = MODEL_SHAPES[shape]
    return {
        "model": {k: model[k] for k in ("name", "n_layers", "n_experts", "top_k", "expert_bytes", "vocab_size")},
        "drafter": {"name": "synthetic-eagle3", **(drafter or WORKLOADS[workload]).to_dict()},
        "workload": workload,
        "recording": {"kind": "synthetic", "position_indexed": True, "full_verification": True,
                      "tool": f"specfit {__version__} traces synth", "seed": seed, "sequence_tokens": sequence_tokens},
        "provenance": {"real": [], "synthesised": ["reference tokens", "routing", "draft trees", "draft probabilities",
                                                   "verdicts"]},
        "parameters": {"routing": routing.to_dict()},
    }


def with_drafter_overrides(workload: str, **overrides) -> DrafterParams:
    """The workload's drafter parameters with the given (non-None) fields replaced."""
    base = WORKLOADS.get(workload, DrafterParams())
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})
