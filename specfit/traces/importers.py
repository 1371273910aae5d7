"""Importers: real routing logs -> position-indexed traces.

A routing log records, for each decoded token, the experts the target's router picked at every
MoE layer. That is exactly the committed path of a trace; the draft trees around it are not in the
log, so they are synthesised (:mod:`specfit.traces.drafter`) and the off-path nodes' experts are
drawn from a :class:`~specfit.traces.routing.RoutingModel` calibrated to the log's own per-layer
statistics (popularity, consecutive reuse, token affinity). The trace metadata lists what is real
and what is synthesised.

Input layouts:

- ``.npz`` with ``expert_ids [tokens, layers, top_k]``, ``sequence_id [tokens]``,
  ``token_id [tokens]`` and optionally ``generated_token_index [tokens]`` (rows in decode order);
- ``.jsonl`` with one record per token and layer:
  ``{"sequence_id": 3, "token_index": 17, "token_id": 1045, "layer": 0, "experts": [5, 9, ...]}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from .. import __version__
from ..errors import SpecFitError
from .drafter import DrafterParams
from .format import Trace
from .routing import RoutingModel, TokenSampler
from .stats import consecutive_reuse, popularity, same_token_reuse
from .summary import trace_statistics
from .synth import MODEL_SHAPES, WORKLOADS, build_trees

__all__ = ["RoutingLog", "read_routing_log", "import_routing", "model_for_log", "dump_jsonl"]

JSONL_FIELDS = ("sequence_id", "token_index", "token_id", "layer", "experts")


@dataclass
class RoutingLog:
    """Decode routing: ``experts [tokens, layers, top_k]``, ``tokens [tokens]``,
    ``sequence [tokens]`` (rows of a sequence consecutive, in decode order)."""

    experts: np.ndarray
    tokens: np.ndarray
    sequence: np.ndarray
    source: str

    def select(self, rows: np.ndarray) -> "RoutingLog":
        return RoutingLog(self.experts[rows], self.tokens[rows], self.sequence[rows], self.source)


def read_routing_log(path: str | Path) -> RoutingLog:
    """Read an ``.npz`` or ``.jsonl`` routing log (see the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise SpecFitError(f"{path}: no such routing log")
    if path.suffix == ".npz":
        return _read_npz(path)
    if path.suffix in (".jsonl", ".json"):
        return _read_jsonl(path)
    raise SpecFitError(f"{path}: unknown routing-log format; expected a .npz or .jsonl file")


def _read_npz(path: Path) -> RoutingLog:
    try:
        data = np.load(path, allow_pickle=False)   # never unpickle a user file
    except (OSError, ValueError) as exc:
        raise SpecFitError(f"{path}: not a readable .npz file ({exc})") from None
    missing = [k for k in ("expert_ids", "sequence_id", "token_id") if k not in data.files]
    if missing:
        raise SpecFitError(f"{path}: missing array(s) {missing}; expected expert_ids [tokens, layers, top_k], "
                           "sequence_id [tokens], token_id [tokens]")
    experts = data["expert_ids"]
    if experts.ndim != 3 or not np.issubdtype(experts.dtype, np.integer):
        raise SpecFitError(f"{path}: array 'expert_ids' must be integers [tokens, layers, top_k], got {experts.dtype} {experts.shape}")
    seq, tok = data["sequence_id"], data["token_id"]
    if seq.shape != (experts.shape[0],) or tok.shape != (experts.shape[0],):
        raise SpecFitError(f"{path}: arrays 'sequence_id' and 'token_id' must have one entry per row of expert_ids ({experts.shape[0]})")
    order = np.arange(experts.shape[0])
    if "generated_token_index" in data.files:
        # rows are in decode order already; a stable sort only guards against interleaved logs
        order = np.lexsort((data["generated_token_index"], _first_seen_rank(seq)))
    return RoutingLog(experts[order].astype(np.int64), tok[order].astype(np.int64), seq[order].astype(np.int64), str(path))


def _first_seen_rank(seq: np.ndarray) -> np.ndarray:
    _, first, inverse = np.unique(seq, return_index=True, return_inverse=True)
    return np.argsort(np.argsort(first))[inverse]


def _read_jsonl(path: Path) -> RoutingLog:
    try:
        df = pd.read_json(path, lines=True)
    except ValueError as exc:
        raise SpecFitError(f"{path}: not valid JSON lines ({exc})") from None
    missing = [f for f in JSONL_FIELDS if f not in df.columns]
    if missing:
        raise SpecFitError(f"{path}: records miss field(s) {missing}; expected one record per token and layer with {list(JSONL_FIELDS)}")
    k = df["experts"].map(len)
    if k.nunique() != 1:
        raise SpecFitError(f"{path}: field 'experts' must list the same number (top_k) of experts in every record")
    layers = np.sort(df["layer"].unique())
    if not np.array_equal(layers, np.arange(layers.size)):
        raise SpecFitError(f"{path}: field 'layer' must cover 0..L-1, got {layers.tolist()[:8]}...")
    # sequences keep the order in which the file first lists them, tokens their index
    df["sequence_rank"] = _first_seen_rank(df["sequence_id"].to_numpy())
    df = df.sort_values(["sequence_rank", "token_index", "layer"], kind="stable")
    counts = df.groupby(["sequence_id", "token_index"]).size()
    if (counts != layers.size).any():
        bad = counts[counts != layers.size].index[0]
        raise SpecFitError(f"{path}: token {bad} has {int(counts[bad])} layer records; expected {layers.size}")
    experts = np.stack(df["experts"].to_numpy()).reshape(-1, layers.size, int(k.iloc[0]))
    firsts = df[df["layer"] == 0]
    return RoutingLog(experts.astype(np.int64), firsts["token_id"].to_numpy().astype(np.int64),
                      firsts["sequence_id"].to_numpy().astype(np.int64), str(path))


def import_routing(log: RoutingLog, model: dict, workload: str = "imported", drafter: DrafterParams | None = None,
                   sibling_reuse: float = 0.3, seed: int = 0, max_tokens: int | None = None) -> Trace:
    """A position-indexed trace whose committed path is the log's real routing.

    ``model`` gives the shape metadata (``name``, ``n_experts``, ``expert_bytes``, ``vocab_size``;
    ``n_layers`` and ``top_k`` must match the log). ``max_tokens`` keeps the first positions only.
    """
    T, L, k = log.experts.shape
    if model["n_layers"] != L or model["top_k"] != k:
        raise SpecFitError(f"{log.source}: the log has {L} layers x top-{k}, the model shape "
                           f"{model['name']!r} expects {model['n_layers']} x top-{model['top_k']}")
    E = int(model["n_experts"])
    if log.experts.min() < 0 or log.experts.max() >= E:
        raise SpecFitError(f"{log.source}: expert ids must be in [0, {E}) for {model['name']!r}")
    drafter = drafter or WORKLOADS.get(workload, WORKLOADS["chat"])
    rng = np.random.default_rng(seed)
    vocab = max(int(model.get("vocab_size", 0)), int(log.tokens.max()) + 1)
    token_sampler = TokenSampler(vocab, 1.0, rng)
    reuse = consecutive_reuse(log.experts, log.sequence)
    affinity = same_token_reuse(log.experts, log.tokens)   # NaN when no token repeats
    router = RoutingModel(popularity(log.experts, E), np.nan_to_num(reuse, nan=0.0),
                          np.where(np.isfinite(affinity), affinity, np.nan_to_num(reuse, nan=0.0)),
                          sibling_reuse, k, vocab, seed=seed)
    router.calibrate(token_sampler, rng)
    ref_tokens, ref_experts = [], []
    budget = np.inf if max_tokens is None else int(max_tokens)
    for s in pd.unique(log.sequence):
        rows = np.flatnonzero(log.sequence == s)
        if rows.size < 2 or budget <= 0:
            continue
        rows = rows[: int(min(rows.size, budget + 1))]
        budget -= rows.size - 1
        ref_tokens.append(log.tokens[rows])
        ref_experts.append(log.experts[rows])
    if not ref_tokens:
        raise SpecFitError(f"{log.source}: no sequence has two or more tokens; nothing to import")
    arrays = build_trees(ref_tokens, ref_experts, router, drafter, token_sampler, rng)
    meta = {
        "model": {key: model[key] for key in ("name", "n_layers", "n_experts", "top_k", "expert_bytes", "vocab_size")
                  if key in model},
        "drafter": {"name": "synthetic-eagle3", **drafter.to_dict()},
        "workload": workload,
        "recording": {"kind": "imported", "position_indexed": True, "full_verification": True,
                      "tool": f"specfit {__version__} traces import-routing", "source": Path(log.source).name,
                      "seed": seed},
        "provenance": {
            "real": ["reference tokens", "experts of the reference tokens (every root and on-path node)"],
            "synthesised": ["draft trees", "draft probabilities", "off-path draft tokens", "off-path verdicts",
                            "off-path nodes' experts (routing model calibrated to this log's statistics)"]},
        "parameters": {"fitted": {"token_prob": router.token_prob_.round(4).tolist(),
                                  "consecutive_prob": router.consecutive_prob_.round(4).tolist(),
                                  "sibling_prob": router.sibling_prob_.round(4).tolist()},
                       "sibling_reuse": sibling_reuse},
    }
    trace = Trace(meta=meta, **arrays)
    trace.meta["statistics"] = trace_statistics(trace)
    return trace


def model_for_log(log: RoutingLog, shape: str | None) -> dict:
    """The model metadata for a log: a named shape, or one inferred from the log alone."""
    if shape is not None:
        if shape not in MODEL_SHAPES:
            raise SpecFitError(f"--shape: unknown model shape {shape!r}; expected one of {sorted(MODEL_SHAPES)}")
        return dict(MODEL_SHAPES[shape])
    T, L, k = log.experts.shape
    for m in MODEL_SHAPES.values():
        if (m["n_layers"], m["top_k"]) == (L, k) and log.experts.max() < m["n_experts"]:
            return dict(m)
    raise SpecFitError(f"{log.source}: no known model shape has {L} layers x top-{k}; pass --shape")


def dump_jsonl(log: RoutingLog, path: str | Path) -> None:
    """Write ``log`` in the JSONL layout (one record per token and layer)."""
    position = np.zeros(log.sequence.size, dtype=np.int64)
    for s in np.unique(log.sequence):
        rows = np.flatnonzero(log.sequence == s)
        position[rows] = np.arange(rows.size)
    with open(path, "w") as f:
        for i in range(log.sequence.size):
            for layer in range(log.experts.shape[1]):
                f.write(json.dumps({"sequence_id": int(log.sequence[i]), "token_index": int(position[i]),
                                    "token_id": int(log.tokens[i]), "layer": layer,
                                    "experts": log.experts[i, layer].tolist()}) + "\n")
