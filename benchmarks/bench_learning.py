"""Benchmark: what a live decode spends learning after its cycles, this checkout against another
revision, side by side in one process.

Two steps run between a cycle's commit and the next cycle's drafting, every so many cycles:

- the online cost model's refit (:class:`specfit.calibrate.online.OnlineCostModel`): a robust
  fit of the recent cycles, every other one with the forward selection of the terms the data
  identify. Fed the ``specfit`` cycles of a ``bench_decode.py --out`` run (or a synthetic set),
  each revision's ``CycleTimeFitter`` in turn;
- the router predictor's online count (:func:`specfit.kernels.router.count_host`): for a batch of
  64 verified nodes, what each candidate context weight and recency bonus would have predicted.

The baseline's ``specfit/calibrate/fit.py`` and ``specfit/kernels/router.py`` are read with
``git show`` and imported under other names; the arms alternate, one thread. Prints medians in
microseconds, the median of the paired ratios, and whether both revisions computed the same
(the fitted models, the counts).

    python benchmarks/bench_learning.py --baseline 162605b [--cycles DIR/cycles.parquet] [--rounds 6] [--busy 1]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from busy import busy_processes
from revision import module_at

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def cycle_rows(path: Path | None) -> list[tuple]:
    """(draft levels, nodes, hits, misses, seconds, priced hits, priced misses, drafter seconds) per
    ``specfit`` cycle of a run's ``cycles.parquet``; without one, a synthetic run of 150 cycles."""
    if path is not None:
        import pandas as pd

        c = pd.read_parquet(path)
        c = c[c["policy"] == "specfit"]
        return list(zip(c.draft_levels, c.nodes_verified, c.hits, c.misses, c.measured_time_s, c.predicted_hits,
                        c.predicted_misses, c.drafter_time_s))
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(150):
        levels, nodes = int(rng.integers(0, 7)), int(rng.integers(1, 20))
        hits, misses = int(rng.integers(4, 40)), int(rng.integers(0, 30))
        time_s = (1.5e-3 * levels + 3.7e-3 + 7e-5 * nodes + 1e-4 * hits + 1.1e-4 * misses) * (1 + 0.05 * rng.standard_normal())
        rows.append((levels, nodes, hits, misses, time_s, hits, misses, 1.5e-3 * levels))
    return rows


def time_refits(fitter_class, prior, rows) -> tuple[list, list, object]:
    """(selecting refits' seconds, reusing refits' seconds, the final fitted model) of one online run."""
    from specfit.calibrate import online

    kept = online.CycleTimeFitter
    online.CycleTimeFitter = fitter_class
    try:
        model = online.OnlineCostModel(prior)
    finally:
        online.CycleTimeFitter = kept
    refit = model._refit
    selecting, reusing = [], []

    def timed():
        start = time.perf_counter()
        selected = refit()
        (selecting if selected else reusing).append(time.perf_counter() - start)
        return selected

    model._refit = timed
    for r in rows * 2:
        model.observe(int(r[0]), int(r[1]), int(r[2]), int(r[3]), float(r[4]), priced=(int(r[5]), int(r[6])),
                      overhead_s=1e-4, drafter_s=float(r[7]))
    return selecting, reusing, model.fitted


def count_inputs(rng):
    """A batch of 64 verified nodes of the bundled model's shape (hidden 128, 4 layers x 16
    experts, top-4) and the predictor's candidates."""
    embed = rng.standard_normal((2048, 128)).astype(np.float32)
    rows = rng.standard_normal((64, 128)).astype(np.float32)
    n = 64
    tokens = rng.integers(0, 2048, n).astype(np.int64)
    context = rng.standard_normal((n, 128)).astype(np.float32)
    last = rng.integers(-1, 16, (n, 4, 4)).astype(np.int64)
    true = rng.integers(0, 16, (n, 4, 4)).astype(np.int64)
    return (embed, rows, tokens, context, np.full(4, 0.5), last, np.full(4, 0.5),
            np.array([0.0, 0.25, 0.5, 1.0, 2.0, 4.0]), np.array([0.0, 0.5, 1.0, 1.5, 2.0]), true)


def host_weights(module, embed: np.ndarray, rows: np.ndarray) -> tuple:
    """The leading arguments of ``module``'s ``predict_host`` / ``count_host`` (a
    ``specfit.kernels.router`` of any revision) for these weights: before stop 44 the embedding
    and the routers as columns ``[H, L * E]``; since, the routers as rows and the token table."""
    if not hasattr(module, "token_table"):
        return embed, np.ascontiguousarray(rows.T)
    return (embed, rows, *module.token_table(embed, rows))


def time_count(module, weights: tuple, inputs) -> tuple[float, tuple]:
    """Seconds of one ``count_host`` of ``module`` (``weights``: its :func:`host_weights`), and
    the counts."""
    right = (np.zeros((6, 4), dtype=np.int64), np.zeros((5, 4), dtype=np.int64))
    start = time.perf_counter()
    module.count_host(*weights, *inputs[2:], *right)
    return time.perf_counter() - start, right


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="git revision to compare with")
    parser.add_argument("--cycles", type=Path, default=None, help="cycles.parquet of a bench_decode.py --out run")
    parser.add_argument("--rounds", type=int, default=6, help="alternating rounds per arm")
    parser.add_argument("--busy", type=int, default=0, help="CPU-bound processes beside the benchmark")
    args = parser.parse_args(argv)

    from specfit.threads import set_cpu_threads

    set_cpu_threads(1)
    from specfit import kernels
    from specfit.calibrate.fit import CycleTimeFitter
    from specfit.costmodel import CostModel

    fit_baseline = module_at(args.baseline, "specfit/calibrate/fit.py", "fit_baseline", "bench_learning")
    router_baseline = module_at(args.baseline, "specfit/kernels/router.py", "router_baseline", "bench_learning")
    arms = {"baseline": (fit_baseline.CycleTimeFitter, router_baseline), "this": (CycleTimeFitter, kernels.router)}
    prior = CostModel(base_s=3.7e-3, per_node_s=7e-5, hit_s=1e-4, miss_s=1.1e-4, draft_level_s=1.5e-3)
    rows = cycle_rows(args.cycles)
    if len(rows) < 40:      # the warm-up below takes 40; a selecting and a reusing refit need 24 or more
        raise SystemExit(f"--cycles {args.cycles}: {len(rows)} specfit cycles; expected at least 40 (bench_decode.py's "
                         f"default run has about 150)")
    inputs = count_inputs(np.random.default_rng(0))
    weights = {arm: host_weights(router, *inputs[:2]) for arm, (_, router) in arms.items()}
    for arm, (fitter, router) in arms.items():           # compiled and loaded before anything is timed
        time_refits(fitter, prior, rows[:40])
        time_count(router, weights[arm], inputs)
    selecting = {a: [] for a in arms}
    reusing = {a: [] for a in arms}
    counts = {a: [] for a in arms}
    fitted, counted = {}, {}
    with busy_processes(args.busy):
        for r in range(args.rounds):
            for arm in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
                fitter, router = arms[arm]
                sel, reuse, fitted[arm] = time_refits(fitter, prior, rows)
                selecting[arm].append(np.median(sel))
                reusing[arm].append(np.median(reuse))
                for _ in range(20):
                    seconds, counted[arm] = time_count(router, weights[arm], inputs)
                    counts[arm].append(seconds)

    table = Table(title=f"learning after the cycles: this checkout against {args.baseline} "
                        f"({len(rows)} cycles x 2 per online run, {args.rounds} rounds, {args.busy} busy)")
    for name in ("step", "baseline (us)", "this (us)", "this / baseline (paired)", "same result"):
        table.add_column(name, justify="left" if name == "step" else "right")
    same_fit = fitted["baseline"] == fitted["this"]
    same_count = all((a == b).all() for a, b in zip(counted["baseline"], counted["this"]))
    for step, values, same in (("online refit, selecting the terms", selecting, same_fit),
                               ("online refit, reusing the choice", reusing, same_fit),
                               ("router count, 64 nodes x 11 candidates", counts, same_count)):
        base, this = np.array(values["baseline"]), np.array(values["this"])
        table.add_row(step, f"{np.median(base) * 1e6:.0f}", f"{np.median(this) * 1e6:.0f}",
                      f"{np.median(this / base):.3f}", "yes" if same else "NO")
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
