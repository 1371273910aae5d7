"""Benchmark: exact search (Dinkelbach + max-weight closure) vs the greedy baseline.

Trees are EAGLE-style (top-k frontier expansion by cumulative probability), routing is correlated
(a child keeps about half of its parent's experts per layer, popular experts are drawn more), the
cache holds a quarter of each layer, and costs follow three hardware presets. Prints, per tree
size and cost preset: median / p90 / max solve time of the exact search (wall clock, and the
thread's CPU time, which a loaded machine inflates less) and of greedy, and the throughput gap
greedy leaves (exact / greedy - 1); then the goals next to the figures of the code before the
compiled kernels. The first call (numba compiling, or loading its on-disk cache) is timed apart.

``--greedy-growth 250,1000,2000`` also times the greedy baseline where it is slowest: wide trees
that it grows node by node to the end (every edge near-certain, experts nearly free), each step
pricing every frontier node, next to the exact search on the same trees.

    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/bench_search.py [--trees 200] [--sizes 16,32,64,128,256] \
        [--greedy-growth 250,1000,2000]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from specfit import CostModel, DraftTree, best_subtree, greedy_subtree

LAYERS, EXPERTS, TOP_K = 48, 128, 8

PRESETS = {
    # miss = 9.44 MB expert over the link + compute; hit = compute of a resident expert
    "pcie4": CostModel(base_s=3e-3, per_node_s=4e-5, hit_s=1.5e-5, miss_s=4.0e-4, draft_level_s=8e-4),
    "pcie5": CostModel(base_s=3e-3, per_node_s=4e-5, hit_s=1.5e-5, miss_s=2.0e-4, draft_level_s=8e-4),
    "gh200": CostModel(base_s=3e-3, per_node_s=4e-5, hit_s=1.5e-5, miss_s=4.3e-5, draft_level_s=8e-4),
    # every expert on the device (no offload): large trees pay, so the max-flow path is exercised
    "resident": CostModel(base_s=8e-3, per_node_s=2e-5, hit_s=2e-6, miss_s=2e-6, draft_level_s=5e-4),
}


def eagle_tree(rng: np.random.Generator, n_nodes: int, top_k: int = 8) -> DraftTree:
    """Level-by-level expansion: each frontier node proposes top_k children, the global top_k by
    path probability form the next frontier, until n_nodes nodes exist."""
    parents, probs = [-1], [1.0]
    frontier = [0]
    while len(parents) < n_nodes:
        cands = []
        for f in frontier:
            q = rng.dirichlet(np.full(top_k, 0.3))
            q = np.sort(q)[::-1] * rng.uniform(0.6, 0.95)
            cands += [(probs[f] * x, f) for x in q]
        cands.sort(key=lambda c: -c[0])
        frontier = []
        for p, f in cands[: min(top_k, n_nodes - len(parents))]:
            parents.append(f)
            probs.append(p)
            frontier.append(len(parents) - 1)
    return DraftTree(parents=np.array(parents), path_probs=np.array(probs))


def correlated_experts(rng: np.random.Generator, tree: DraftTree, keep: float = 0.5) -> np.ndarray:
    popularity = rng.dirichlet(np.full(EXPERTS, 0.5), size=LAYERS)  # skewed per layer
    out = np.empty((tree.n_nodes, LAYERS, TOP_K), dtype=np.int64)
    for v in range(tree.n_nodes):
        for layer in range(LAYERS):
            if v == 0:
                out[v, layer] = rng.choice(EXPERTS, TOP_K, replace=False, p=popularity[layer])
                continue
            parent = out[tree.parents[v], layer]
            kept = parent[rng.random(TOP_K) < keep]
            p = popularity[layer].copy()
            p[kept] = 0
            fresh = rng.choice(EXPERTS, TOP_K - kept.size, replace=False, p=p / p.sum())
            out[v, layer] = np.concatenate([kept, fresh])
    return out


def make_case(rng, n_nodes):
    tree = eagle_tree(rng, n_nodes)
    experts = correlated_experts(rng, tree)
    cached = np.zeros((LAYERS, EXPERTS), dtype=bool)
    for layer in range(LAYERS):
        cached[layer, rng.choice(EXPERTS, EXPERTS // 4, replace=False)] = True
        cached[layer, experts[0, layer, : TOP_K // 2]] = True  # recent tokens' experts are warm
    return tree, experts, cached


def wide_case(n_nodes: int, seed: int = 1):
    """A tree the greedy grows to the end: parents among the 400 nodes before each, every edge
    0.97-0.999 likely, experts all but free (the arguments of greedy_subtree and best_subtree)."""
    rng = np.random.default_rng(seed)
    parents = np.array([-1] + [int(rng.integers(max(0, v - 400), v)) for v in range(1, n_nodes)])
    probs = np.ones(n_nodes)
    for v in range(1, n_nodes):
        probs[v] = probs[parents[v]] * rng.uniform(0.97, 0.999)
    cost = CostModel(base_s=3e-3, per_node_s=1e-6, hit_s=1e-7, miss_s=1e-7, draft_level_s=8e-4)
    return (DraftTree(parents=parents, path_probs=probs), rng.integers(0, EXPERTS, (n_nodes, LAYERS, TOP_K)),
            np.zeros((LAYERS, EXPERTS), dtype=bool), cost, 2)


def greedy_growth(sizes: list[int]) -> Table:
    """The greedy baseline's and the exact search's time on :func:`wide_case` trees."""
    table = Table(title="The greedy baseline grown to the end (wide trees)")
    for col in ("nodes", "greedy s", "greedy nodes", "exact ms", "exact nodes"):
        table.add_column(col, justify="right")
    for n in sizes:
        case = wide_case(n)
        greedy, greedy_s, _ = timed(greedy_subtree, *case)
        exact, exact_s, _ = timed(best_subtree, *case)
        table.add_row(str(n), f"{greedy_s:.3f}", str(greedy.n_nodes), f"{exact_s * 1e3:.1f}", str(exact.n_nodes))
    return table


def timed(fn, *args):
    """(result, wall seconds, thread CPU seconds)."""
    cpu, wall = time.thread_time(), time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - wall, time.thread_time() - cpu


# Medians of the search before the compiled kernels (benchmarks/RESULTS.md, same benchmark, 200
# trees, one quiet core, load average 0.8) and the goals of the compiled core (ms; first bar).
BEFORE_MS = {(64, "pcie4"): 1.05, (64, "pcie5"): 0.98, (64, "gh200"): 1.35, (64, "resident"): 3.29,
             (256, "pcie4"): 3.97, (256, "pcie5"): 4.32, (256, "gh200"): 7.05, (256, "resident"): 9.41}
GOAL_MS = {(64, "pcie4"): (0.35, 0.5), (64, "pcie5"): (0.35, 0.5), (64, "gh200"): (0.35, 0.5),
           (64, "resident"): (2.0, None), (256, "pcie4"): (5.0, None), (256, "pcie5"): (5.0, None),
           (256, "gh200"): (5.0, None), (256, "resident"): (5.0, None)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", type=int, default=200, help="random trees per size")
    ap.add_argument("--sizes", default="16,32,64,128,256")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--greedy-growth", default="", help="node counts of wide trees the greedy grows to the end")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    load_before = os.getloadavg()[0]

    warm_tree, warm_experts, warm_cached = make_case(np.random.default_rng(args.seed), 8)
    _, first_s, _ = timed(best_subtree, warm_tree, warm_experts, warm_cached, PRESETS["pcie4"], 1)
    _, greedy_first_s, _ = timed(greedy_subtree, warm_tree, warm_experts, warm_cached, PRESETS["pcie4"], 1)

    table = Table(title=f"Search: {LAYERS} layers, top-{TOP_K} of {EXPERTS} experts, {args.trees} trees per row")
    for col in ("nodes", "preset", "exact median ms", "exact median cpu ms", "exact p90 ms", "exact max ms",
                "greedy median ms", "chosen nodes (median)", "greedy gap median %", "greedy gap max %"):
        table.add_column(col, justify="right")
    medians = {}
    for n in sizes:
        rng = np.random.default_rng(args.seed + n)
        cases = [make_case(rng, n) for _ in range(args.trees)]
        for name, cost in PRESETS.items():
            exact_s, exact_cpu, greedy_s, gaps, chosen = [], [], [], [], []
            for tree, experts, cached in cases:
                best, dt, cpu = timed(best_subtree, tree, experts, cached, cost, int(tree.max_depth))
                exact_s.append(dt)
                exact_cpu.append(cpu)
                if n <= 256:  # each greedy step prices the whole frontier: skip it on larger trees
                    greedy, dt, _ = timed(greedy_subtree, tree, experts, cached, cost, int(tree.max_depth))
                    greedy_s.append(dt)
                    gaps.append(best.throughput / greedy.throughput - 1)
                chosen.append(best.n_nodes)
            ms = np.array(exact_s) * 1e3
            gap = np.array(gaps) * 100 if gaps else np.array([np.nan])
            medians[n, name] = (float(np.median(ms)), float(np.median(exact_cpu)) * 1e3)
            table.add_row(
                str(n), name, f"{np.median(ms):.3f}", f"{medians[n, name][1]:.3f}", f"{np.percentile(ms, 90):.3f}",
                f"{ms.max():.2f}", f"{np.median(greedy_s) * 1e3:.3f}" if greedy_s else "-", f"{np.median(chosen):.0f}",
                f"{np.median(gap):.2f}", f"{np.max(gap):.2f}",
            )
    console = Console(width=160)
    console.print(table)
    goals = Table(title="Goals: median ms, before (the code without compiled kernels) and now")
    for col in ("nodes", "preset", "before", "goal (first bar)", "now", "now cpu", "met"):
        goals.add_column(col, justify="right")
    for key, (goal, bar) in GOAL_MS.items():
        if key not in medians:
            continue
        wall, cpu = medians[key]
        met = "yes" if wall <= goal else ("first bar" if bar is not None and wall <= bar else "no")
        goals.add_row(str(key[0]), key[1], f"{BEFORE_MS[key]:.2f}", f"<= {goal}" + (f" ({bar})" if bar else ""),
                      f"{wall:.3f}", f"{cpu:.3f}", met)
    console.print(goals)
    if args.greedy_growth:
        console.print(greedy_growth([int(s) for s in args.greedy_growth.split(",")]))
    console.print(f"first call (compile or load the cached kernels): best_subtree {first_s:.2f} s, greedy "
                  f"{greedy_first_s:.2f} s; load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")


if __name__ == "__main__":
    main()
