"""Checking a trace against every invariant the simulator relies on (``specfit traces validate``,
and every :func:`~specfit.traces.format.read_trace`): one :class:`~specfit.errors.SpecFitError`
naming the first violated field, and the cycle and node where it applies."""

from __future__ import annotations

import numpy as np

from .. import kernels
from ..errors import SpecFitError
from ..io import json_text
from ..tree import bad_path_probs

__all__ = ["validate_trace", "check_meta", "prompt_passes", "REQUIRED_META", "REQUIRED_MODEL"]

REQUIRED_META = ("model", "drafter", "workload", "recording", "provenance")
REQUIRED_MODEL = ("name", "n_layers", "n_experts", "top_k", "expert_bytes")
MAX_EXPERTS = int(np.iinfo(np.int16).max) + 1     # a trace holds expert ids as int16 in memory


def check_meta(meta: dict, source: str) -> None:
    missing = [k for k in REQUIRED_META if k not in meta]
    if missing:
        raise SpecFitError(f"{source}: metadata is missing field(s) {missing}")
    # readers look keys up in these (recording.position_indexed, provenance.real, ...)
    for key in ("recording", "provenance"):
        if not isinstance(meta[key], dict):
            raise SpecFitError(f"{source}: metadata field {key!r} must be a JSON object, got {json_text(meta[key])}")
    model = meta["model"]
    if not isinstance(model, dict) or any(k not in model for k in REQUIRED_MODEL):
        raise SpecFitError(f"{source}: metadata field 'model' must hold {list(REQUIRED_MODEL)}")
    for k in ("n_layers", "n_experts", "top_k"):
        if not _is_integer(model[k]) or model[k] <= 0:
            raise SpecFitError(f"{source}: metadata model.{k} must be a positive integer, got {json_text(model[k])}")
    if model["n_experts"] > MAX_EXPERTS:
        raise SpecFitError(f"{source}: metadata model.n_experts is {model['n_experts']}; expected at most {MAX_EXPERTS} "
                           f"(a trace holds expert ids as int16)")
    if model["top_k"] > model["n_experts"]:
        raise SpecFitError(f"{source}: metadata model.top_k ({model['top_k']}) exceeds model.n_experts")
    # the optional sizes too: a reader takes them as they are (a profile's shape, a vocabulary check)
    for k in ("expert_bytes", "hidden_size", "shared_expert_bytes", "vocab_size"):
        if k in model and (not _is_integer(model[k]) or model[k] < (1 if k == "vocab_size" else 0)):
            expected = "a positive" if k == "vocab_size" else "a non-negative"
            raise SpecFitError(f"{source}: metadata model.{k} must be {expected} integer, got {json_text(model[k])}")
    # lists readers join or search (`traces inspect`, the predictors a trace cannot fit)
    for where, key in (("provenance", "real"), ("provenance", "synthesised"), ("recording", "unfittable_predictors")):
        value = meta[where].get(key, [])
        wrong = [v for v in value if not isinstance(v, str)] if isinstance(value, list) else [value]
        if wrong:
            got = f"a list holding {json_text(wrong[0])}" if isinstance(value, list) else json_text(value)
            raise SpecFitError(f"{source}: metadata {where}.{key} must be a list of strings, got {got}")
    position_indexed = meta["recording"].get("position_indexed", False)
    if not isinstance(position_indexed, bool):
        raise SpecFitError(f"{source}: metadata recording.position_indexed must be true or false, got "
                           f"{json_text(position_indexed)}")


def _is_integer(value) -> bool:
    """A JSON integer (a boolean is none: ``true`` would read as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)



def validate_trace(trace, source: str = "trace") -> dict:
    """Check every invariant the simulator relies on in ``trace`` (a
    :class:`~specfit.traces.format.Trace`); returns a few counts for the report.

    Raises :class:`SpecFitError` naming the first violated field (and cycle where it applies).
    """
    check_meta(trace.meta, source)
    n, C = trace.n_nodes, trace.n_cycles
    L, k, E = trace.n_layers, trace.top_k, trace.n_experts
    off = trace.offsets
    if C < 1 or off[0] != 0 or off[-1] != n or np.any(np.diff(off) < 1):
        raise SpecFitError(f"{source}: cycle offsets must split the {n} node rows into non-empty cycles")
    for name in ("parent", "depth", "token", "draft_logprob", "path_prob", "verdict"):
        if getattr(trace, name).shape != (n,):
            raise SpecFitError(f"{source}: '{name}' must have one value per node ({n}), got {getattr(trace, name).shape}")
    for name in ("sequence", "position"):
        if getattr(trace, name).shape != (C,):
            raise SpecFitError(f"{source}: '{name}' must have one value per cycle ({C})")
    cyc = trace.cycle_of_node
    local = np.arange(n) - off[cyc]
    root = local == 0

    def fail(field_name: str, rows: np.ndarray, what: str) -> None:
        i = int(np.flatnonzero(rows)[0])
        raise SpecFitError(f"{source}: column '{field_name}' {what} (cycle {int(cyc[i])}, node {int(local[i])})")

    parent = trace.parent.astype(np.int64)
    if np.any(parent[root] != -1):
        fail("parent", root & (parent != -1), "must be -1 at each cycle's root")
    if np.any((parent[~root] < 0) | (parent[~root] >= local[~root])):
        fail("parent", ~root & ((parent < 0) | (parent >= local)), "must point to an earlier node of the same cycle")
    gparent = np.where(root, 0, parent + off[cyc])   # global row of each node's parent
    depth = trace.depth.astype(np.int64)
    expected_depth = np.zeros(n, dtype=np.int64)
    # parents precede children, so one pass per level settles every depth
    for _ in range(int(depth.max(initial=0)) + 1):
        expected_depth = np.where(root, 0, expected_depth[gparent] + 1)
    if np.any(depth != expected_depth):
        fail("depth", depth != expected_depth, "must equal the parent's depth + 1 (root 0)")
    if not _depth_sorted_per_cycle(depth, off):
        # policies see a tree level by level: the first levels must be a prefix of the rows
        raise SpecFitError(f"{source}: column 'depth' must be non-decreasing within each cycle (nodes in drafting order)")
    logprob = trace.draft_logprob.astype(np.float64)
    bad = ~np.isfinite(logprob) | (logprob > 1e-6)     # float32 rounding may leave a certain token at +1e-7
    if bad.any():
        fail("draft_logprob", bad, "must be a finite log-probability (<= 0)")
    bad = bad_path_probs(trace.path_prob, gparent, root)
    if bad is not None:
        fail("path_prob", bad[0], {"range": "must be a probability in [0, 1]", "root": "must be 1 at the root",
                                   "rising": "must not exceed the parent's path_prob"}[bad[1]])
    if np.any(trace.token < 0):
        fail("token", trace.token < 0, "must be a non-negative token id")
    # with the model's vocabulary known, a token or verdict past it is no token of that model
    vocab = trace.model.get("vocab_size") if isinstance(trace.model, dict) else None
    if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0:
        for name, ids in (("token", trace.token), ("verdict", trace.verdict)):
            if np.any(ids >= vocab):
                fail(name, ids >= vocab, f"must hold token ids below the model's vocab_size {vocab}")
    # siblings must carry distinct tokens: greedy acceptance then accepts at most one child. A
    # sibling group is its parent's row: sorted by (row, token), a repeat sits next to its twin
    rows, tokens = gparent[~root], trace.token.astype(np.int64)[~root]
    order = np.lexsort((tokens, rows))
    rows, tokens = rows[order], tokens[order]
    if np.any((rows[1:] == rows[:-1]) & (tokens[1:] == tokens[:-1])):
        raise SpecFitError(f"{source}: column 'token' repeats a token among siblings; drafted siblings must be distinct tokens")
    for name, experts in (("true_experts", trace.true_experts), ("predicted_experts", trace.predicted_experts)):
        if experts is None:
            continue
        if experts.shape != (n, L, k):
            raise SpecFitError(f"{source}: '{name}' must have shape [nodes, layers, top_k] = [{n}, {L}, {k}], got {list(experts.shape)}")
        out_of_range, repeated = kernels.bitsets.first_bad_routing(experts, E)
        if out_of_range >= 0:
            fail(name, np.arange(n) == out_of_range, f"must hold expert ids in [0, {E})")
        if repeated >= 0:
            fail(name, np.arange(n) == repeated, "repeats an expert within one layer's top-k")
    if trace.true_expert_weights is not None:
        weights = trace.true_expert_weights
        if weights.shape != (n, L, k):
            raise SpecFitError(f"{source}: 'true_expert_weights' must have shape [nodes, layers, top_k] = [{n}, {L}, {k}], "
                               f"got {list(weights.shape)}")
        flat = weights.reshape(n, -1)
        # a row is unknown when all of it is NaN (the file stores it as null); a known row with a
        # NaN anywhere, its first slot too, is bad. Per-row reductions, no [nodes, layers, top_k]
        # temporaries: fmax skips NaN (NaN only for a row of NaN), a NaN makes the minimum NaN
        # (not >= 0), an infinity the maximum or the minimum infinite
        has = ~np.isnan(np.fmax.reduce(flat, axis=1))
        low, high = flat.min(axis=1), flat.max(axis=1)
        bad = has & ~((low >= 0) & (high < np.inf))
        if bad.any():
            fail("true_expert_weights", bad, "must hold finite, non-negative router weights")
        if (has & ~trace.true_known).any():
            fail("true_expert_weights", has & ~trace.true_known, "is set where 'true_experts' is unknown")
    counts = {"cycles": C, "nodes": n, "verdicts_known": int(trace.verdict_known.sum()),
              "true_experts_known": int(trace.true_known.sum())}
    if trace.position_indexed:
        _validate_position_indexed(trace, source)
    prompt_passes(trace, source)
    return counts


def prompt_passes(trace, source: str) -> dict[int, np.ndarray]:
    """Each recorded sequence's prompt passes, the experts each made resident before the
    sequence's first cycle, in the order they ran (a live recording's
    ``recording.prefill_sequences`` / ``prefill_experts`` / ``prefill_pass_counts``): sequence id
    -> bool ``[passes, layers, experts]``. ``prefill_experts`` holds one entry per pass, sequence by
    sequence, and ``prefill_pass_counts`` how many are each sequence's (a prompt run in chunks has
    one pass per chunk); without it each sequence has one (as an older SpecFit recorded them).
    Empty for a trace that records none (synthetic, imported, or recorded by an older SpecFit
    still). Checked: one list of expert ids in range per layer in each pass."""
    recording = trace.meta.get("recording") or {}
    sequences, experts = recording.get("prefill_sequences"), recording.get("prefill_experts")
    counts = recording.get("prefill_pass_counts")
    if sequences is None and experts is None and counts is None:
        return {}
    where = f"{source}: metadata recording.prefill_sequences / prefill_experts / prefill_pass_counts"
    if not (isinstance(sequences, list) and isinstance(experts, list)
            and all(isinstance(s, int) and not isinstance(s, bool) for s in sequences)):
        raise SpecFitError(f"{where}: expected two lists, sequence ids and their prompt passes' experts per layer")
    if counts is None:
        counts = [1] * len(sequences)
    if not (isinstance(counts, list) and len(counts) == len(sequences)
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in counts)
            and sum(counts) == len(experts)):
        raise SpecFitError(f"{where}: expected one prefill_experts entry per prompt pass: each sequence's number of "
                           f"passes (>= 1) in prefill_pass_counts, one per sequence, adding up to the "
                           f"{len(experts)} entries (without prefill_pass_counts, one entry per sequence)")
    L, E = trace.n_layers, trace.n_experts
    passes = {}
    ends = np.cumsum(counts).tolist()
    for sequence, count, end in zip(sequences, counts, ends):
        entries = experts[end - count:end]
        if entries == [None]:         # a sequence whose prompt pass was not recorded
            continue
        masks = np.zeros((count, L, E), dtype=bool)
        for i, layers in enumerate(entries):
            ok = isinstance(layers, list) and len(layers) == L and all(
                isinstance(ids, list) and all(isinstance(e, int) and not isinstance(e, bool) and 0 <= e < E for e in ids)
                for ids in layers)
            if not ok:
                entry = f"sequence {sequence}'s entry" if count == 1 else f"sequence {sequence}'s pass {i}"
                raise SpecFitError(f"{where}: {entry} must hold {L} lists (one per layer) of expert ids in [0, {E})")
            for layer, ids in enumerate(layers):
                masks[i, layer, ids] = True
        passes[sequence] = masks
    return passes


def _depth_sorted_per_cycle(depth: np.ndarray, off: np.ndarray) -> bool:
    d = np.diff(depth.astype(np.int64))
    boundary = np.zeros(d.size, dtype=bool)
    boundary[off[1:-1] - 1] = True
    return bool(np.all((d >= 0) | boundary))


def _validate_position_indexed(trace, source: str) -> None:
    """A full trace: every node verified (verdict and true experts known), one cycle per position
    of each sequence, and consecutive roots spelling the reference output."""
    if not trace.verdict_known.all():
        raise SpecFitError(f"{source}: column 'verdict' has nulls or negative token ids; a position-indexed trace needs "
                           f"every node's verdict")
    if not trace.true_known.all():
        raise SpecFitError(f"{source}: column 'true_experts' has nulls; a position-indexed trace needs every node's true experts")
    seq, pos = trace.sequence.astype(np.int64), trace.position.astype(np.int64)
    same = seq[1:] == seq[:-1]
    if np.any(same & (pos[1:] != pos[:-1] + 1)) or np.any(~same & (pos[1:] != 0)) or pos[0] != 0:
        raise SpecFitError(f"{source}: columns 'sequence'/'position' must list positions 0, 1, 2, ... of each sequence "
                           "in order (one cycle per position)")
    if np.unique(seq[np.r_[True, ~same]]).size != int(np.sum(np.r_[True, ~same])):
        raise SpecFitError(f"{source}: column 'sequence' must keep each sequence's cycles together")
    roots = trace.offsets[:-1]
    root_verdict, next_root_token = trace.verdict[roots[:-1]], trace.token[roots[1:]]
    bad = same & (root_verdict != next_root_token)
    if bad.any():
        c = int(np.flatnonzero(bad)[0])
        raise SpecFitError(f"{source}: column 'verdict' at the root of cycle {c} ({int(root_verdict[c])}) must equal the "
                           f"root token of the next position ({int(next_root_token[c])}); the roots spell the reference output")
    # a node may only be accepted where the reference still has a next token
    last = np.r_[~same, True]
    remaining = np.zeros(trace.n_cycles, dtype=np.int64)   # positions left after this one in its sequence
    for c in range(trace.n_cycles - 1, -1, -1):
        remaining[c] = 0 if last[c] else remaining[c + 1] + 1
    for c in np.flatnonzero(remaining < int(trace.depth.max(initial=0))):
        tree = trace.tree(int(c))
        path = tree.accepted_path(trace.verdict[trace.rows(int(c))])
        if path.size - 1 > remaining[c]:
            raise SpecFitError(f"{source}: cycle {int(c)} accepts {path.size - 1} draft tokens but only "
                               f"{int(remaining[c])} reference tokens follow its position")
