"""Importers: real routing logs -> position-indexed traces.

A routing log (any layout of :mod:`specfit.traces.routing_logs`) records, for each decoded token,
the experts the target's router picked at every MoE layer. That is exactly the committed path of a
trace; the draft trees around it are not in the log, so they are synthesised
(:mod:`specfit.traces.drafter`) and the off-path nodes' experts are drawn from a
:class:`~specfit.traces.routing.RoutingModel` calibrated to the log's own per-layer statistics
(popularity, consecutive reuse, token affinity). The trace metadata lists what is real and what
is synthesised.

Router weights, when the log has them, go into the trace's ``true_expert_weights`` for the
reference path (the off-path nodes' experts are synthesised, so their weights are unknown). A log
without token ids (per-sequence npz logs) is imported with synthesised reference tokens; the
metadata then says ``recording.token_ids: "synthesised"`` and lists under
``recording.unfittable_predictors`` the predictors that learn from token ids (``affinity``), and
the routing model's token affinity falls back to the log's consecutive reuse.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from .. import __version__
from ..errors import SpecFitError, check_seed
from .drafter import DrafterParams
from .format import Trace
from .routing import RoutingModel, TokenSampler
from .routing_logs import JSONL_FIELDS, RoutingLog, dump_jsonl, read_routing_log
from .stats import consecutive_reuse, popularity, same_token_reuse
from .summary import trace_statistics
from .synth import MODEL_SHAPES, WORKLOADS, build_trees

__all__ = ["RoutingLog", "read_routing_log", "import_routing", "import_routing_and_model", "check_import_options",
           "check_log_fits", "model_for_log", "model_from_config", "dump_jsonl", "JSONL_FIELDS", "TOKEN_PREDICTORS"]

# predictors that learn a token -> experts table: meaningless on synthesised token ids
TOKEN_PREDICTORS = ("affinity",)


def _option_name(key: str) -> str:
    return "--" + key.replace("_", "-")


def check_import_options(sequences: int | None = None, max_tokens: int | None = None, seed: int = 0,
                         sibling_reuse: float = 0.3, name=_option_name) -> None:
    """The import's options in range, before any work: ``specfit traces import-routing``'s options
    and a sweep spec's routing entry. ``name(key)`` is how an error names the option
    (``--max-tokens``, or a spec's ``sweep.toml: routing[0]: field 'max_tokens'``)."""
    if sequences is not None and sequences < 1:
        raise SpecFitError(f"{name('sequences')}: expected >= 1, got {sequences}")
    if max_tokens is not None and max_tokens < 1:
        raise SpecFitError(f"{name('max_tokens')}: expected >= 1 position, got {max_tokens}")
    check_seed(seed, name("seed"))
    if not 0.0 <= sibling_reuse <= 1.0:
        raise SpecFitError(f"{name('sibling_reuse')}: expected a fraction in [0, 1], got {sibling_reuse:g}")


def import_routing(log: RoutingLog, model: dict, workload: str = "imported", drafter: DrafterParams | None = None,
                   sibling_reuse: float = 0.3, seed: int = 0, max_tokens: int | None = None) -> Trace:
    """A position-indexed trace whose committed path is the log's real routing.

    ``model`` gives the shape metadata (``name``, ``n_experts``, ``expert_bytes``, ``vocab_size``;
    ``n_layers`` and ``top_k`` must match the log). ``max_tokens`` keeps the first positions only.
    """
    return import_routing_and_model(log, model, workload, drafter, sibling_reuse, seed, max_tokens)[0]


def import_routing_and_model(log: RoutingLog, model: dict, workload: str = "imported",
                             drafter: DrafterParams | None = None, sibling_reuse: float = 0.3, seed: int = 0,
                             max_tokens: int | None = None) -> tuple[Trace, RoutingModel]:
    """:func:`import_routing`, and the routing model calibrated to the log that drew the off-path
    nodes' experts (what a predictor of those nodes could know at best, short of the draws)."""
    T, L, k = log.experts.shape
    check_log_fits(log, model, log.source)
    E = int(model["n_experts"])
    drafter = drafter or WORKLOADS.get(workload, WORKLOADS["chat"])
    rng = np.random.default_rng(seed)
    known_tokens = log.token_ids_known
    vocab = int(model.get("vocab_size", 0))
    if known_tokens:
        vocab = max(vocab, int(log.tokens.max()) + 1)
    elif vocab <= 0:
        raise SpecFitError(f"{log.source}: the log has no token ids and the model shape {model['name']!r} no "
                           f"vocab_size to synthesise them from")
    token_sampler = TokenSampler(vocab, 1.0, rng)
    tokens = log.tokens if known_tokens else _synthesised_tokens(log, token_sampler, rng)
    reuse = consecutive_reuse(log.experts, log.sequence)
    # NaN when no token repeats, and meaningless without token ids: then the temporal reuse stands in
    affinity = same_token_reuse(log.experts, tokens) if known_tokens else np.full(L, np.nan)
    router = RoutingModel(popularity(log.experts, E), np.nan_to_num(reuse, nan=0.0),
                          np.where(np.isfinite(affinity), affinity, np.nan_to_num(reuse, nan=0.0)),
                          sibling_reuse, k, vocab, seed=seed)
    router.calibrate(token_sampler, rng)
    ref_tokens, ref_experts, ref_weights, kept, too_short = [], [], [], [], 0
    budget = np.inf if max_tokens is None else int(max_tokens)
    for s in pd.unique(log.sequence):
        rows = np.flatnonzero(log.sequence == s)
        too_short += rows.size < 2
        if rows.size < 2 or budget <= 0:
            continue
        rows = rows[: int(min(rows.size, budget + 1))]
        budget -= rows.size - 1
        kept.append(int(s))
        ref_tokens.append(tokens[rows])
        ref_experts.append(log.experts[rows])
        if log.weights is not None:
            ref_weights.append(log.weights[rows])
    if not ref_tokens:
        raise SpecFitError(f"{log.source}: no sequence has two or more tokens; nothing to import")
    arrays = build_trees(ref_tokens, ref_experts, router, drafter, token_sampler, rng)
    real = ["experts of the reference tokens (every root and on-path node)"]
    synthesised = ["draft trees", "draft probabilities", "off-path draft tokens", "off-path verdicts",
                   "off-path nodes' experts (routing model calibrated to this log's statistics)"]
    if known_tokens:
        real.insert(0, "reference tokens")
    else:
        synthesised.insert(0, "reference tokens (the log has no token ids)")
    if log.weights is not None:
        real.append("router weights of the reference tokens' experts")
    recording = {"kind": "imported", "position_indexed": True, "full_verification": True,
                 "tool": f"specfit {__version__} traces import-routing", "source": Path(log.source).name,
                 "layout": log.layout, "seed": seed, "token_ids": "real" if known_tokens else "synthesised",
                 "router_weights": log.weights is not None,
                 # the trace numbers its sequences 0, 1, ...: the log's id of each, and the log's
                 # sequences of one token (no cycle to make) left out
                 "source_sequence_ids": kept, "one_token_sequences_skipped": int(too_short)}
    if not known_tokens:
        recording["unfittable_predictors"] = list(TOKEN_PREDICTORS)
    meta = {
        "model": {key: model[key] for key in ("name", "n_layers", "n_experts", "top_k", "expert_bytes", "vocab_size")
                  if key in model},
        "drafter": {"name": "synthetic-eagle3", **drafter.to_dict()},
        "workload": workload,
        "recording": recording,
        "provenance": {"real": real, "synthesised": synthesised},
        "parameters": {"fitted": {"token_prob": router.token_prob_.round(4).tolist(),
                                  "consecutive_prob": router.consecutive_prob_.round(4).tolist(),
                                  "sibling_prob": router.sibling_prob_.round(4).tolist()},
                       "sibling_reuse": sibling_reuse,
                       # the one statistic of an import's draft nodes the user sets (the table's target)
                       "targets": {"sibling_reuse": sibling_reuse}},
    }
    trace = Trace(meta=meta, **arrays)
    if log.weights is not None:
        trace.true_expert_weights = _reference_weights(trace, ref_weights)
    trace.meta["statistics"] = trace_statistics(trace)
    return trace, router


def check_log_fits(log: RoutingLog, model: dict, where: str) -> None:
    """The log is one of ``model``'s: its layers and top-k, expert ids below its experts, token ids
    below its vocabulary. ``where`` starts an error (the log, or the option that named the model)."""
    T, L, k = log.experts.shape
    if model["n_layers"] != L or model["top_k"] != k:
        raise SpecFitError(f"{where}: the log has {L} layers x top-{k}, the model shape "
                           f"{model['name']!r} expects {model['n_layers']} MoE layers x top-{model['top_k']}")
    E = int(model["n_experts"])
    if log.experts.size and (log.experts.min() < 0 or log.experts.max() >= E):
        # where the first one is: its token (sequence, and token within it), layer and id
        row, layer, slot = (int(i) for i in np.argwhere((log.experts < 0) | (log.experts >= E))[0])
        token = row - int(np.flatnonzero(log.sequence == log.sequence[row])[0])
        raise SpecFitError(f"{where}: expert ids must be in [0, {E}) for {model['name']!r}; got "
                           f"{int(log.experts[row, layer, slot])} at sequence {int(log.sequence[row])}, its token "
                           f"{token}, layer {layer}")
    vocab = int(model.get("vocab_size", 0))
    if log.token_ids_known and vocab > 0 and int(log.tokens.max()) >= vocab:
        # the trace would name the model's vocabulary and hold tokens past it (its writer refuses them)
        row = int(np.argmax(log.tokens >= vocab))
        raise SpecFitError(f"{where}: token id {int(log.tokens[row])} (sequence {int(log.sequence[row])}, its "
                           f"token {int(row - np.flatnonzero(log.sequence == log.sequence[row])[0])}) is not below "
                           f"the vocab_size {vocab} of the model shape {model['name']!r}; expected the log of that "
                           f"model (or a shape with its vocab_size)")


def _synthesised_tokens(log: RoutingLog, sampler: TokenSampler, rng: np.random.Generator) -> np.ndarray:
    return sampler.sample(log.sequence.size, rng).astype(np.int64)


def _reference_weights(trace: Trace, ref_weights: list[np.ndarray]) -> np.ndarray:
    """Router weights of the on-path nodes (a cycle's root and its nodes that spell the reference),
    NaN elsewhere: the node at depth d of position p's tree is the reference token p + d."""
    n = trace.n_nodes
    cycle = trace.cycle_of_node
    roots = trace.offsets[:-1]
    local_parent = trace.parent.astype(np.int64)
    gparent = np.where(local_parent >= 0, local_parent + trace.offsets[cycle], 0)
    on_path = np.zeros(n, dtype=bool)
    on_path[roots] = True
    for _ in range(int(trace.depth.max(initial=0))):   # parents precede children: one pass per level
        on_path = on_path | ((local_parent >= 0) & on_path[gparent] & (trace.token == trace.verdict[gparent]))
    weights = np.full(trace.true_experts.shape, np.nan, dtype=np.float32)
    rows = np.flatnonzero(on_path)
    seq = trace.sequence[cycle[rows]]
    index = trace.position[cycle[rows]].astype(np.int64) + trace.depth[rows].astype(np.int64)
    for s in np.unique(seq):
        pick = seq == s
        weights[rows[pick]] = ref_weights[int(s)][index[pick]]
    return weights


def model_for_log(log: RoutingLog, shape: str | None, option: str = "--shape",
                  fix: str = "pass --shape NAME or --model (the model's config.json)") -> dict:
    """The model metadata for a log: a named shape, or one inferred from the log alone; either
    checked against the log (:func:`check_log_fits`), so a sweep finds a mismatch before Ray
    starts. ``option`` names where the shape came from and ``fix`` what to do when none fits (a
    sweep spec's routing entry has a field, not the command's options)."""
    if shape is not None:
        if shape not in MODEL_SHAPES:
            raise SpecFitError(f"{option}: unknown model shape {shape!r}; expected one of {sorted(MODEL_SHAPES)}")
        model = dict(MODEL_SHAPES[shape])
        check_log_fits(log, model, f"{option}: {log.source}")
        return model
    T, L, k = log.experts.shape
    same = [m for m in MODEL_SHAPES.values() if (m["n_layers"], m["top_k"]) == (L, k)]
    largest = int(log.experts.max()) if log.experts.size else -1
    for m in same:
        if largest < m["n_experts"]:
            check_log_fits(log, m, log.source)
            return dict(m)
    if same:
        known = ", ".join(f"{m['name']}: {m['n_experts']} experts" for m in same)
        raise SpecFitError(f"{log.source}: expert id {largest} is out of range for every known model shape with {L} "
                           f"layers x top-{k} ({known}); {fix}")
    raise SpecFitError(f"{log.source}: no known model shape has {L} layers x top-{k}; {fix}")


def model_from_config(config_path: str | Path, dtype: str = "bfloat16") -> dict:
    """The model metadata of a Hugging Face ``config.json`` (or a model directory): its MoE
    layers, routed experts, top-k, bytes of one routed expert in ``dtype`` (the dtype its experts
    are offloaded in: bfloat16 on a GPU, float32 for `specfit decode` on a CPU) and vocabulary."""
    import torch

    from ..runtime.config import ModelConfig

    path = Path(config_path)
    config = ModelConfig.from_dir(path) if path.is_dir() else ModelConfig.from_file(path)
    return {"name": (path if path.is_dir() else path.parent).name, "n_layers": config.n_moe_layers,
            "n_experts": config.n_experts, "top_k": config.top_k, "expert_bytes": config.expert_bytes(getattr(torch, dtype)),
            "vocab_size": config.vocab_size}
