"""Benchmark: how well the acceptance calibration predicts accepted tokens, per depth, on a
full-tree recording (every drafted node verified, so every node's outcome is known).

SpecFit's expected tokens of a subtree are 1 + the sum of its nodes' path probabilities. The
toolkit's :class:`~specfit.experts.calibration.AcceptanceCalibrator` maps each edge's draft
probability to an acceptance probability (isotonic) and multiplies the edges along a path. This
script cross-fits it (even cycles fit, odd cycles scored, and the other way round) and prints, per
depth, the summed predicted path probabilities against the nodes that were on the accepted path,
with the Brier score of the path probabilities. Next to it, a candidate that is *not* used by the
toolkit: the same product, then an isotonic map per depth (depths >= ``--pool-depth`` pooled) from
that product to "the node was on the accepted path", kept non-increasing along paths.

    specfit demo                                  # records reports/demo/warmup/trace.parquet
    python benchmarks/bench_acceptance.py reports/demo/warmup/trace.parquet [more traces]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table
from sklearn.isotonic import IsotonicRegression

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specfit import kernels  # noqa: E402
from specfit.errors import SpecFitError  # noqa: E402
from specfit.experts.calibration import AcceptanceCalibrator  # noqa: E402
from specfit.traces.format import read_trace  # noqa: E402


def outcomes(trace) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(parent row, depth, known, accepted) per node: ``known`` where the parent has a verdict
    (then every ancestor has one: verified sets are ancestor-closed), ``accepted`` where the node is
    on the cycle's accepted path (the replay's own kernel; the root always)."""
    root = trace.parent < 0
    parent_row = np.where(root, np.arange(trace.n_nodes), trace.parent_rows)
    known = root | (trace.verdict[parent_row] >= 0)
    offsets = np.ascontiguousarray(trace.offsets, dtype=np.int64)
    path_offsets, paths = kernels.replay.accepted_paths(
        offsets, np.ascontiguousarray(trace.parent, dtype=np.int16), np.ascontiguousarray(trace.depth, dtype=np.int16),
        np.ascontiguousarray(trace.token, dtype=np.int32), np.ascontiguousarray(trace.verdict, dtype=np.int32))
    accepted = np.zeros(trace.n_nodes, dtype=bool)
    accepted[paths + np.repeat(offsets[:-1], np.diff(path_offsets))] = True
    return parent_row, trace.depth.astype(np.int64), known, accepted


def along_paths_min(values: np.ndarray, parent_row: np.ndarray, root: np.ndarray, levels: int) -> np.ndarray:
    out = values.copy()
    for _ in range(levels):
        out = np.where(root, out, np.minimum(out, out[parent_row]))
    return out


def depth_calibrated(trace, train_cycles, product: np.ndarray, pool_depth: int) -> np.ndarray:
    """The candidate: ``product`` mapped per depth bucket by an isotonic fit on ``train_cycles``."""
    parent_row, depth, known, accepted = outcomes(trace)
    root = trace.parent < 0
    bucket = np.minimum(depth, pool_depth)
    train = np.isin(trace.cycle_of_node, train_cycles) & known & ~root
    out = np.ones(trace.n_nodes)
    for b in np.unique(bucket[~root]):
        fit_on = train & (bucket == b)
        if fit_on.sum() < 30:                     # too few outcomes at this depth: all depths together
            fit_on = train
        iso = IsotonicRegression(y_min=1e-4, y_max=1.0, increasing=True, out_of_bounds="clip")
        iso.fit(np.r_[0.0, product[fit_on]], np.r_[0.0, accepted[fit_on].astype(np.float64)])
        rows = ~root & (bucket == b)
        out[rows] = iso.predict(product[rows])
    return along_paths_min(out, parent_row, root, int(trace.depth.max(initial=0)))


def cross_fitted(trace, pool_depth: int) -> dict[str, np.ndarray]:
    """Path probabilities of every node, each half of the cycles predicted by a fit on the other."""
    halves = [np.flatnonzero(np.arange(trace.n_cycles) % 2 == h) for h in (0, 1)]
    out = {"edge isotonic x path (the toolkit's)": np.ones(trace.n_nodes),
           f"+ isotonic per depth (candidate, depths >= {pool_depth} pooled)": np.ones(trace.n_nodes)}
    for h in (0, 1):
        train, scored = halves[1 - h], np.isin(trace.cycle_of_node, halves[h])
        product = AcceptanceCalibrator().fit(trace, train).path_probs(trace)
        candidate = depth_calibrated(trace, train, product, pool_depth)
        for key, probs in zip(out, (product, candidate)):
            out[key][scored] = probs[scored]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", type=Path, help="full-tree trace files (.parquet)")
    parser.add_argument("--pool-depth", type=int, default=4, help="the candidate pools this depth and deeper")
    parser.add_argument("--max-depth", type=int, default=8, help="deepest depth printed")
    args = parser.parse_args(argv)
    console = Console(width=200)
    for path in args.traces:
        try:
            trace = read_trace(path)
        except SpecFitError as exc:
            raise SystemExit(f"bench_acceptance: {exc}")
        _, depth, known, accepted = outcomes(trace)
        scored = known & (trace.parent >= 0)
        if not scored.any():
            raise SystemExit(f"bench_acceptance: {path}: no node whose parent was verified")
        depths = range(1, min(int(depth.max()), args.max_depth) + 1)
        table = Table(title=f"{path}: {trace.n_cycles} cycles, {int(scored.sum())} nodes with a known outcome; "
                            "predicted (sum of path probabilities) / accepted, per depth")
        for name in ("calibration", "all", *(f"depth {d}" for d in depths), "Brier"):
            table.add_column(name, justify="left" if name == "calibration" else "right")
        for label, probs in cross_fitted(trace, args.pool_depth).items():
            cells = [f"{probs[scored].sum():.1f} / {int(accepted[scored].sum())}"]
            cells += [f"{probs[scored & (depth == d)].sum():.1f} / {int(accepted[scored & (depth == d)].sum())}" for d in depths]
            brier = float(np.mean((probs[scored] - accepted[scored]) ** 2))
            table.add_row(label, *cells, f"{brier:.4f}")
        console.print(table)


if __name__ == "__main__":
    main()
