"""Compare the synthetic routing model with a real routing log (the table in traces/README.md).

    python traces/compare_routing.py ../shared/data/olmoe-1b-7b-routing-general-coding.npz

Columns: the real log; the generator with its default targets (what ``specfit traces synth``
uses for an OLMoE shape); the generator calibrated to the log's own per-layer statistics (what
``specfit traces import-routing`` uses for off-path draft nodes). Both synthetic columns route the
log's own token sequence, so repeated tokens occur where they occur in the real text.
"""

from __future__ import annotations

import sys

import numpy as np

from specfit.traces.importers import read_routing_log
from specfit.traces.routing import RoutingModel, TokenSampler, zipf_popularity
from specfit.traces.stats import consecutive_reuse, lru_hit_rates, popularity, same_token_reuse, top_quarter_share
from specfit.traces.synth import RoutingParams

CAPACITIES = (8, 16, 32)


def routed(model: RoutingModel, log, rng) -> np.ndarray:
    out = np.empty_like(log.experts)
    for s in np.unique(log.sequence):
        rows = np.flatnonzero(log.sequence == s)
        out[rows] = model.sequences(log.tokens[rows][None], rng)[0]
    return out


def row(experts, log) -> dict:
    E = 64
    stats = {"popularity skew (top-quarter share)": top_quarter_share(popularity(experts, E)).mean(),
             "consecutive-token reuse": consecutive_reuse(experts, log.sequence).mean(),
             "same-token overlap (token affinity)": same_token_reuse(experts, log.tokens).mean()}
    for c, rate in lru_hit_rates(experts, E, CAPACITIES).items():
        stats[f"LRU hit rate, {c} of 64 experts/layer (AR decode)"] = rate
    return stats


def main(path: str) -> None:
    log = read_routing_log(path)
    L, E, k = log.experts.shape[1], 64, log.experts.shape[2]
    rng = np.random.default_rng(0)
    vocab = int(log.tokens.max()) + 1
    sampler = TokenSampler(vocab, 1.0, rng)
    defaults = RoutingParams()
    default_model = RoutingModel(zipf_popularity(L, E, defaults.popularity_zipf, rng), defaults.consecutive_reuse,
                                 defaults.token_affinity, defaults.sibling_reuse, k, vocab).calibrate(sampler, rng)
    fitted_model = RoutingModel(popularity(log.experts, E), consecutive_reuse(log.experts, log.sequence),
                                same_token_reuse(log.experts, log.tokens), defaults.sibling_reuse, k, vocab).calibrate(sampler, rng)
    columns = {"real OLMoE routing": row(log.experts, log),
               "synthetic (default targets)": row(routed(default_model, log, rng), log),
               "synthetic (fitted to the log)": row(routed(fitted_model, log, rng), log)}
    names = list(columns)
    print(f"{log.experts.shape[0]} tokens, {np.unique(log.sequence).size} sequences, {L} layers x {E} experts, top-{k}\n")
    print("| statistic (mean over layers) | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for stat in columns[names[0]]:
        print(f"| {stat} | " + " | ".join(f"{columns[n][stat]:.3f}" for n in names) + " |")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python traces/compare_routing.py ROUTING_LOG (.npz, .jsonl or .parquet)")
    main(sys.argv[1])
