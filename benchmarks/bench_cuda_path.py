"""Benchmark: the host-side bookkeeping of one verification pass that the GPU waits for, before
and after issue 18's changes, at Qwen3-30B-A3B scale (48 layers, top-8 of 128 experts).

Per pass of a ``--nodes``-node tree with random routing, summed over the 48 layers:

- cache admission: ``admit`` of an [L, E] union with one row set (what the offload did per layer)
  against ``admit_layer`` (the layer's ids), per-layer (``--cache-experts`` slots per layer) and
  global (the same total) modes;
- routing bookkeeping: one ``np.nonzero`` scan per expert of the union (the old loop, which then
  made two uploads per expert) against :func:`~specfit.runtime.model.routing_plan` (one sort).

While the host does this the GPU idles (the routing read-back has synchronised it), so these
medians are GPU idle time per pass. One core, medians over ``--passes`` passes.

    OMP_NUM_THREADS=1 python benchmarks/bench_cuda_path.py [--nodes 60] [--passes 30]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specfit.experts.cache import ExpertCache  # noqa: E402
from specfit.runtime.model import routing_plan  # noqa: E402


def random_routing(rng, n_layers, n_tokens, n_experts, top_k):
    """int64 [L, T, k]: each token's top-k distinct experts at each layer."""
    return np.argsort(rng.random((n_layers, n_tokens, n_experts)), axis=-1)[..., :top_k].astype(np.int64)


def pass_time_s(fn, routing) -> float:
    start = time.perf_counter()
    for layer, expert_ids in enumerate(routing):
        fn(layer, expert_ids)
    return time.perf_counter() - start


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=60)
    parser.add_argument("--passes", type=int, default=30)
    parser.add_argument("--cache-experts", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    L, E, k = 48, 128, 8
    rng = np.random.default_rng(args.seed)
    passes = [random_routing(rng, L, args.nodes, E, k) for _ in range(args.passes)]

    def old_admit(cache):
        def run(layer, expert_ids):
            union = np.zeros((L, E), dtype=bool)
            union[layer, np.unique(expert_ids)] = True
            cache.admit(union)
        return run

    def new_admit(cache):
        return lambda layer, expert_ids: cache.admit_layer(layer, np.unique(expert_ids))

    def old_routing(layer, expert_ids):
        for expert in np.unique(expert_ids).tolist():
            np.nonzero(expert_ids.T == expert)

    def new_routing(layer, expert_ids):
        routing_plan(expert_ids)

    rows = []
    for mode, capacity in (("per_layer", args.cache_experts), ("global", args.cache_experts * L)):
        times = {}
        for name, make in (("before", old_admit), ("after", new_admit)):
            cache = ExpertCache(L, E, capacity, mode=mode)
            times[name] = float(np.median([pass_time_s(make(cache), routing) for routing in passes]))
        rows.append({"what": f"admit, {mode} ({capacity} slots)", **times})
    times = {name: float(np.median([pass_time_s(fn, routing) for routing in passes]))
             for name, fn in (("before", old_routing), ("after", new_routing))}
    rows.append({"what": "routing bookkeeping", **times})

    table = Table(title=f"host bookkeeping per pass: {args.nodes}-node tree, {L} layers, top-{k} of {E} "
                        f"(median of {args.passes} passes, one core)")
    for name in ("what", "before ms", "after ms", "ratio"):
        table.add_column(name, justify="left" if name == "what" else "right")
    for row in rows:
        table.add_row(row["what"], f"{row['before'] * 1e3:.2f}", f"{row['after'] * 1e3:.2f}",
                      f"{row['before'] / row['after']:.1f}x")
    Console(width=120).print(table)
    return rows


if __name__ == "__main__":
    main()
