"""Benchmark: tree speculative sampling's walk (``--temperature > 0``), this checkout beside a
baseline revision, on trees shaped like the live decoder's.

Each case is a drafted tree (top-4 children per node, the given levels), every node verified,
target logits that like the drafted tokens (so that drafts are accepted as often as rejected),
a vocabulary of the bundled model's size (2048) or Qwen3's (151,936). One call is the walk with
what it tells a policy that learns acceptance: this checkout's ``sample_accept`` (it returns the
edges), the baseline's ``sample_accept`` followed by its ``sampled_edge_outcomes`` where it has
one. Timed warm (the same call in a loop) and cold (a 16 MB array swept before each call, as a
model pass sweeps the caches between two of the live decoder's walks), the arms alternating call
by call; medians in microseconds, and the median of the paired ratios. Each arm draws from its own
generator with the same seed: the table says whether they sampled the same paths and tokens.

    python benchmarks/bench_sampling.py --baseline f4b53a2 [--calls 400] [--vocab 2048,151936]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from revision import module_at  # noqa: E402
from specfit.runtime import acceptance  # noqa: E402
from specfit.tree import DraftTree  # noqa: E402


def case(levels: int, vocab: int, seed: int = 0):
    """(tree, verified nodes, logits): top-4 children per node for ``levels`` levels."""
    rng = np.random.default_rng(seed)
    parents, frontier = [-1], [0]
    for _ in range(levels):
        nxt = []
        for u in frontier:
            for _ in range(4):
                parents.append(u)
                nxt.append(len(parents) - 1)
        frontier = nxt
    parents = np.array(parents)
    n = parents.size
    probs = np.ones(n)
    for v in range(1, n):
        probs[v] = probs[parents[v]] * rng.uniform(0.1, 0.9)
    tokens = rng.integers(0, vocab, n)
    logits = torch.from_numpy(rng.standard_normal((n, vocab)) * 2.0).float()
    for v in range(1, n):
        logits[parents[v], tokens[v]] += 9.0 if (v - 1) % 4 == 0 else 5.0    # the first child the likeliest
    return DraftTree(parents=parents, path_probs=probs, tokens=tokens), np.arange(n), logits


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="git revision to compare with")
    parser.add_argument("--calls", type=int, default=400, help="timed calls per arm and mode")
    parser.add_argument("--vocab", default="2048,151936", help="vocabulary sizes")
    parser.add_argument("--temperature", type=float, default=0.7)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    base = module_at(args.baseline, "specfit/runtime/acceptance.py", "acceptance_baseline", "bench_sampling")
    t = args.temperature

    def baseline_walk(tree, nodes, logits, rng):
        path, bonus = base.sample_accept(tree, nodes, logits, t, rng)[:2]
        if hasattr(base, "sampled_edge_outcomes"):
            base.sampled_edge_outcomes(tree, nodes, path, logits, t)
        return path, bonus

    def this_walk(tree, nodes, logits, rng):
        return acceptance.sample_accept(tree, nodes, logits, t, rng)[:2]

    arms = {args.baseline: baseline_walk, "this": this_walk}
    sweep = np.ones(16 * 2**20 // 8)
    table = Table(title=f"tree speculative sampling, one walk with its edges: this checkout against {args.baseline} "
                        f"(temperature {t}, one thread)")
    for name in ("tree", "vocab", "mode", f"{args.baseline} (us)", "this (us)", "this / baseline (paired)",
                 "path length", "same tokens"):
        table.add_column(name, justify="right")
    for levels in (2, 3):
        for vocab in (int(v) for v in args.vocab.split(",")):
            tree, nodes, logits = case(levels, vocab)
            for fn in arms.values():                        # compile and load before timing
                fn(tree, nodes, logits, np.random.default_rng(0))
            for mode in ("warm", "cold"):
                times = {name: [] for name in arms}
                outcomes = {name: [] for name in arms}
                rngs = {name: np.random.default_rng(7) for name in arms}
                for i in range(args.calls):
                    for name in (list(arms) if i % 2 else list(arms)[::-1]):
                        if mode == "cold":
                            sweep += 1.0
                        start = time.perf_counter()
                        path, bonus = arms[name](tree, nodes, logits, rngs[name])
                        times[name].append(time.perf_counter() - start)
                        outcomes[name].append((tuple(path.tolist()), bonus))
                b, this = (np.array(times[name]) for name in arms)
                same = outcomes[args.baseline] == outcomes["this"]
                length = np.mean([len(p) for p, _ in outcomes["this"]])
                table.add_row(f"{tree.n_nodes} nodes", str(vocab), mode, f"{1e6 * np.median(b):.1f}",
                              f"{1e6 * np.median(this):.1f}", f"{np.median(this / b):.3f}", f"{length:.2f}",
                              "yes" if same else "no")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
