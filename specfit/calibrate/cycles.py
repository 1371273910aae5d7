"""Measured verification cycles and draft levels: the data the cycle-time predictor is fitted to.

``probe_cycles`` runs real target passes over draft trees through the offloaded model at several
expert-cache sizes, so the node count, the hits and the misses all vary, and records for each pass
what the cost model sees (nodes, hits, misses) and the measured time. In a random tree the union of
experts grows with the node count (until it covers the layer), so those passes alone cannot tell
what a node costs from what its experts cost: a fit trades ``per_node_s`` against ``hit_s``, and
on a noisy machine often lands on ``per_node_s = 0``. So each cache size also gets *star* trees
(:func:`star_tree`): the root and identical children, whose union is that of two nodes at every
size (up to twice the largest random tree), which measure the cost of a node with the experts held
fixed: their slope per node (:func:`star_node_cost`) is also the value the fit holds ``per_node_s``
at when the passes together cannot identify it. ``probe_draft`` times one draft level of an
EAGLE-3-shaped drafter layer over a frontier of ``width`` nodes. ``probe_layer_parts`` times the
layers a stand-in with fewer layers than its shape lacks.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import SpecFitError
from ..experts.cache import ExpertCache
from ..runtime.decoder import check_finite_logits, device_now
from ..runtime.devices import free_device_bytes, to_host
from ..runtime.model import MoETransformer, causal_mask, routing_plan
from ..runtime.offload import ExpertOffload
from ..tree import DraftTree
from .probes import median_time_s

__all__ = ["random_tree", "star_tree", "probe_trees", "star_node_cost", "probe_cycles", "fit_capacities",
           "PROBE_RESERVE_BYTES", "probe_draft", "probe_drafter_levels", "cycles_features", "probe_layer_parts", "part_line"]


def random_tree(rng: np.random.Generator, n_nodes: int, vocab_size: int, max_depth: int = 8) -> DraftTree:
    """A random tree of ``n_nodes`` in level order (each node's parent is an earlier node no
    deeper than ``max_depth - 1``), random tokens, path probabilities halving per level."""
    parents = np.full(n_nodes, -1, dtype=np.int64)
    depth = np.zeros(n_nodes, dtype=np.int64)
    for v in range(1, n_nodes):
        candidates = np.flatnonzero(depth[:v] < max_depth)
        parents[v] = rng.choice(candidates)
        depth[v] = depth[parents[v]] + 1
    order = np.argsort(depth, kind="stable")           # level order keeps parents before children
    rank = np.empty_like(order)
    rank[order] = np.arange(n_nodes)
    parents = np.where(parents[order] >= 0, rank[np.maximum(parents[order], 0)], -1)
    return DraftTree(parents=parents, path_probs=0.5 ** depth[order].astype(np.float64),
                     tokens=rng.integers(0, vocab_size, n_nodes))


def star_tree(rng: np.random.Generator, n_nodes: int, vocab_size: int) -> DraftTree:
    """The root and ``n_nodes - 1`` children that all carry one token. Each child sees the same
    context (the prefix, the root, itself) at the same position, so every child routes alike and a
    pass over the tree uses the experts of two nodes at every size: the time it adds per child is
    the cost of a node (attention, the dense layers, its rows in the experts' matmuls) with the
    union held fixed."""
    root, child = rng.integers(0, vocab_size, 2)
    parents = np.r_[-1, np.zeros(n_nodes - 1, dtype=np.int64)]
    return DraftTree(parents=parents, path_probs=np.r_[1.0, np.full(n_nodes - 1, 0.5)],
                     tokens=np.r_[root, np.full(n_nodes - 1, child)].astype(np.int64))


def probe_trees(node_counts, repeats: int) -> list[tuple[str, int]]:
    """(kind, nodes) of the trees one cache size is probed with: ``repeats`` random trees per node
    count, and one star tree (:func:`star_tree`) per node count above 1 and at twice the largest:
    a star adds nodes without experts, so its passes can reach further for the slope per node."""
    stars = sorted({int(n) for n in node_counts if n > 1} | {2 * int(max(node_counts))})
    return [("random", int(n)) for n in node_counts for _ in range(repeats)] + [("star", n) for n in stars]


def star_node_cost(rows: list[dict], hit_s: float = 0.0, transfer_s: float = 0.0) -> float | None:
    """The cost of a node as the star-tree passes of :func:`probe_cycles` measure it: the
    Theil-Sen slope (the median of the pairwise slopes, robust to a disturbed pass) of their
    seconds on their node count, after taking off what their experts cost at ``hit_s`` per expert
    and ``transfer_s`` per miss (the direct probes' values: a star's union does not grow with its
    size, but each star routes its own tokens). None without stars of two sizes or with a
    non-finite slope; never below 0."""
    from scipy.stats import theilslopes

    stars = [r for r in rows if r.get("tree") == "star"]
    n = np.array([r["n_nodes"] for r in stars], dtype=np.float64)
    if np.unique(n).size < 2:
        return None
    t = np.array([r["seconds"] - hit_s * (r["hits"] + r["misses"]) - transfer_s * r["misses"] for r in stars])
    slope = float(theilslopes(t, n).slope)
    return max(slope, 0.0) if np.isfinite(slope) else None


# device memory a probe leaves free beside its expert cache: the activations of a probe pass
# (a few MB) and the allocator's rounding, with room to spare
PROBE_RESERVE_BYTES = 1 << 30


def fit_capacities(capacities, n_layers: int, n_experts: int, expert_bytes: int,
                   budget_bytes: int | None) -> list[int]:
    """The per-layer cache sizes to probe: each of ``capacities`` clipped to the largest whose
    slots and staging buffers fit in ``budget_bytes`` (None: no limit), ascending, distinct."""
    def device_bytes(capacity):
        return (capacity * n_layers + ExpertCache.staging_buffers(capacity, n_experts)) * expert_bytes

    wanted = sorted({min(int(c), n_experts) for c in capacities})
    if budget_bytes is None:
        return wanted
    if device_bytes(0) > budget_bytes:
        raise SpecFitError(f"calibrate: the device has {budget_bytes / 2**30:.2f} GiB free beyond a reserve of "
                           f"{PROBE_RESERVE_BYTES / 2**30:.0f} GiB, less than two experts' staging buffers "
                           f"({device_bytes(0) / 2**30:.2f} GiB)")
    fits = max(c for c in range(n_experts + 1) if device_bytes(c) <= budget_bytes)
    return sorted({min(c, fits) for c in wanted})


@torch.inference_mode()
def probe_cycles(model: MoETransformer, capacities, node_counts=(1, 2, 4, 8, 16, 32), repeats: int = 3,
                 context_len: int = 64, seed: int = 0, progress: Callable[[], None] | None = None) -> list[dict]:
    """Target verification passes over random trees, per expert-cache size.

    Device memory: the model's own offload is released while the probes run (it is restored,
    empty, at the end) and each probe's cache is released before the next is allocated, so at
    most one cache is on the device at a time; cache sizes are clipped to what the device has
    free (:func:`~specfit.runtime.devices.free_device_bytes`, less :data:`PROBE_RESERVE_BYTES`).

    Rows: ``capacity`` (as probed), ``tree`` (``random`` or ``star``, :func:`probe_trees`),
    ``n_nodes``, ``hits``, ``misses``, ``bytes_h2d``, ``seconds`` (the pass, between device
    synchronisations), ``transfer_stall_s`` (how long compute waited for expert copies within it),
    ``copy_busy_s`` (the spans of its copy bursts), ``draft_levels`` (always 0: drafting is probed
    apart).
    """
    rng = np.random.default_rng(seed)
    host = model.offload.host
    device = model.device
    model.setup_kv_cache(max(model.max_seq_len, context_len + max(n for _, n in probe_trees(node_counts, repeats))))
    rows = []
    original = model.offload
    original.release()
    _return_cached_memory(device)
    try:
        free = free_device_bytes(device)
        budget = None if free is None else free - PROBE_RESERVE_BYTES
        for capacity in fit_capacities(capacities, host.n_layers, host.n_experts, host.expert_bytes, budget):
            offload = ExpertOffload(host, capacity, device=device)
            model.attach_offload(offload)
            try:
                rows += _probe_one_cache(model, offload, rng, capacity, node_counts, repeats, context_len, progress)
            finally:
                offload.release()
                _return_cached_memory(device)
    finally:
        original.allocate()
        model.attach_offload(original)
    return rows


def _probe_one_cache(model, offload, rng, capacity, node_counts, repeats, context_len, progress) -> list[dict]:
    device, vocab = model.device, model.config.vocab_size
    context = rng.integers(0, vocab, context_len)
    out = model(context, np.arange(context_len), causal_mask(0, context_len))     # prefill, warms the cache
    # a checkpoint with NaN weights would time passes that mean nothing (its routing collapses)
    check_finite_logits(model, out.logits, "a calibration pass (random tokens)")
    rows = []
    plan = probe_trees(node_counts, repeats)
    for i in rng.permutation(len(plan)):
        kind, n = plan[i]
        tree = (star_tree if kind == "star" else random_tree)(rng, n, vocab)
        mask = tree.attention_mask(prefix_len=context_len)
        start = device_now(device)
        out = model(tree.tokens, tree.positions(context_len), mask)
        seconds = device_now(device) - start
        timing = offload.pass_timing()
        c = out.offload
        rows.append({"capacity": int(capacity), "tree": kind, "n_nodes": int(n), "hits": c.total_hits,
                     "misses": c.total_misses, "bytes_h2d": c.total_bytes_h2d, "draft_levels": 0,
                     "seconds": seconds, "transfer_stall_s": timing.stall_s, "copy_busy_s": timing.copy_busy_s})
        if progress:
            progress()
    return rows


def _return_cached_memory(device: torch.device) -> None:
    # blocks freed by a released cache stay with PyTorch's allocator; hand them back so that the
    # next, larger cache can be allocated in one piece
    if device.type == "cuda":
        torch.cuda.empty_cache()


def cycles_features(rows: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(features, seconds) of cycle rows, in :meth:`CostModel.features` order."""
    from ..costmodel import CostModel

    X = CostModel.features([r["draft_levels"] for r in rows], [r["n_nodes"] for r in rows],
                           [r["hits"] for r in rows], [r["misses"] for r in rows])
    return X, np.array([r["seconds"] for r in rows], dtype=np.float64)


@torch.inference_mode()
def probe_layer_parts(model: MoETransformer, token_counts=(1, 16), context_len: int = 64,
                      repeats: int = 7) -> list[dict]:
    """Time one layer of each kind a pass over ``n`` new tokens runs: an MoE layer without its
    routed experts (attention, norms, the router with its host synchronisation, a shared expert;
    the routed experts are the profile's hits and misses) and, where the model has one, a dense
    layer (DeepSeek-V2's first). A stand-in with fewer layers than its shape lacks whole layers
    of these kinds and nothing else (:func:`~specfit.calibrate.calibrate_job.scale_to_depth`).
    Rows: ``part`` (``moe_layer`` or ``dense_layer``), ``tokens``, ``seconds``."""
    device = model.device
    model.setup_kv_cache(max(model.max_seq_len, context_len + max(token_counts)))
    moe = next(layer for layer in model.layers if layer.moe is not None)
    dense = next((layer for layer in model.layers if layer.moe is None), None)

    def moe_without_experts(x, cos, sin, mask):
        x = x + moe.self_attn(moe.input_layernorm(x), cos, sin, context_len, mask)
        h = moe.post_attention_layernorm(x)
        _, expert_ids = moe.moe.route(h)
        routing_plan(to_host(expert_ids))
        return x + moe.shared_expert(h) if moe.shared_expert is not None else x

    rows = []
    for n in token_counts:
        positions = torch.arange(context_len, context_len + n, device=device)
        mask = model._additive_mask(torch.ones(n, context_len + n, dtype=torch.bool, device=device), positions,
                                    context_len)
        cos, sin = model.rope(positions)
        x = model.embed_tokens(torch.zeros(n, dtype=torch.long, device=device))
        parts = {"moe_layer": lambda: moe_without_experts(x, cos, sin, mask)}
        if dense is not None:
            parts["dense_layer"] = lambda: dense(x, cos, sin, context_len, mask)
        for part, run in parts.items():
            rows.append({"part": part, "tokens": int(n), "seconds": median_time_s(run, device, repeats)})
    return rows


def part_line(rows: list[dict], part: str) -> tuple[float, float]:
    """(seconds at no token, seconds per token) of one part of :func:`probe_layer_parts`: the
    line through its smallest and largest token count, clipped at 0; (0, 0) where it was not timed."""
    points = sorted((r["tokens"], r["seconds"]) for r in rows if r["part"] == part)
    if not points:
        return 0.0, 0.0
    (n0, t0), (n1, t1) = points[0], points[-1]
    per_token = max((t1 - t0) / (n1 - n0), 0.0) if n1 > n0 else 0.0
    return max(t0 - per_token * n0, 0.0), per_token


@torch.inference_mode()
def probe_draft(hidden_size: int, draft_vocab: int, device: torch.device, dtype: torch.dtype,
                widths=(1, 4, 8), repeats: int = 7, seed: int = 0) -> list[dict]:
    """Time one draft level over ``width`` frontier nodes with a stand-in of the EAGLE-3
    drafter's shape: one decoder layer whose attention projections take ``2 * hidden`` inputs, a
    SwiGLU MLP of ``3 * hidden`` and an lm_head over ``draft_vocab`` tokens, then the top-k.
    Rows: ``width``, ``seconds``.
    """
    rows = []
    gen = torch.Generator().manual_seed(seed)
    H, inner = hidden_size, 3 * hidden_size

    def weight(rows_, cols):
        return (torch.randn(rows_, cols, generator=gen) / cols**0.5).to(device=device, dtype=dtype)

    qkv, o = weight(3 * H, 2 * H), weight(H, H)
    gate_up, down = weight(2 * inner, H), weight(H, inner)
    lm_head = weight(draft_vocab, H)
    for width in widths:
        x = torch.randn(width, 2 * H, generator=gen).to(device=device, dtype=dtype)

        def level():
            q, k, v = (x @ qkv.T).chunk(3, dim=-1)
            attn = torch.softmax((q @ k.T) / H**0.5, dim=-1) @ v
            h = attn @ o.T
            g, u = (h @ gate_up.T).chunk(2, dim=-1)
            h = h + (F.silu(g) * u) @ down.T
            return (h @ lm_head.T).topk(min(8, draft_vocab), dim=-1)

        rows.append({"width": int(width), "seconds": median_time_s(level, device, repeats)})
    return rows


@torch.inference_mode()
def probe_drafter_levels(model: MoETransformer, drafter, top_k: int = 4, levels: int = 4, repeats: int = 5,
                         context_len: int = 32, seed: int = 0) -> list[dict]:
    """Time real draft levels: the target prefills a random context (its captured features feed
    the drafter), then EAGLE-2/3 dynamic trees of ``top_k`` are grown ``levels`` deep, each level
    timed with the tree's own bookkeeping, as the speculative decoder pays it.
    Rows: ``level``, ``width`` (nodes expanded), ``seconds`` (median over ``repeats`` trees)."""
    from ..runtime.drafting import DrafterSession, TreeDraft

    rng = np.random.default_rng(seed)
    device = model.device
    context = rng.integers(0, model.config.vocab_size, context_len)
    model.setup_kv_cache(max(model.max_seq_len, context_len + 1))
    out = model(context, np.arange(context_len), causal_mask(0, context_len))
    root = int(out.logits[-1].argmax())
    session = DrafterSession(drafter, context_len + levels * top_k * top_k + 1)
    root_output = session.commit(out.hidden, torch.tensor([*context[1:].tolist(), root]))
    samples: dict[int, list[float]] = {}
    widths: dict[int, int] = {}
    for _ in range(repeats + 1):                       # the first tree warms up
        tree = TreeDraft(session, root, lambda: root_output, top_k, levels)
        times = []
        for _ in range(levels):                        # level 1: the root entry's top-k
            start = device_now(device)
            width = max(len(tree.frontier), 1)
            tree.grow()
            times.append(device_now(device) - start)
            widths[len(times)] = width
        for level, seconds in enumerate(times, start=1):
            samples.setdefault(level, []).append(seconds)
    return [{"level": level, "width": widths[level], "seconds": float(np.median(t[1:]))} for level, t in samples.items()]
