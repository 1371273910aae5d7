"""Benchmark: how well the acceptance calibration predicts accepted tokens, per depth, on a
full-tree recording (every drafted node verified, so every node's outcome is known).

SpecFit's expected tokens of a subtree are 1 + the sum of its nodes' path probabilities. This
script cross-fits :class:`~specfit.experts.calibration.AcceptanceCalibrator` (even cycles fit, odd
cycles scored, and the other way round) and prints, per depth, the summed predicted path
probabilities against the nodes that were on the accepted path, with the Brier score of the path
probabilities, for four settings:

- the edge map fitted on every edge whose parent was verified, multiplied along paths (the
  toolkit before stop 24);
- the edge map fitted on edges whose parent is accepted (the chain rule), multiplied;
- + the refinement by the drafter's confidence at the parent (the top sibling's probability);
- + the depth correction (the toolkit's default).

A second table scores what a selection takes: per cycle the ``N`` nodes with the highest
probabilities under each setting (its own ranking), summed predicted against accepted.

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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specfit.errors import SpecFitError  # noqa: E402
from specfit.experts.calibration import AcceptanceCalibrator, accepted_nodes, edge_mask  # noqa: E402
from specfit.traces.format import read_trace  # noqa: E402

SETTINGS = {
    "edges of verified parents x path (before)": {"given_parent_accepted": False, "confidence": False,
                                                  "depth_correction": False},
    "edges of accepted parents x path": {"confidence": False, "depth_correction": False},
    "+ confidence at the parent": {"depth_correction": False},
    "+ depth correction (the toolkit's)": {},
}
TOP_N = (4, 8, 16, 32)


def cross_fitted(trace) -> dict[str, np.ndarray]:
    """Path probabilities of every node per setting, each half of the cycles predicted by a fit on
    the other."""
    halves = [np.flatnonzero(np.arange(trace.n_cycles) % 2 == h) for h in (0, 1)]
    out = {label: np.ones(trace.n_nodes) for label in SETTINGS}
    for h in (0, 1):
        scored = np.isin(trace.cycle_of_node, halves[h])
        for label, params in SETTINGS.items():
            probs = AcceptanceCalibrator(**params).fit(trace, halves[1 - h]).path_probs(trace)
            out[label][scored] = probs[scored]
    return out


def top_nodes(trace, probs: np.ndarray, n: int) -> np.ndarray:
    """Rows of each cycle's ``n`` highest ``probs`` among its rows with a probability >= 0 (ties:
    the earlier node)."""
    out = []
    for c in range(trace.n_cycles):
        lo, hi = int(trace.offsets[c]), int(trace.offsets[c + 1])
        order = lo + np.argsort(-probs[lo:hi], kind="stable")[:n]
        out.append(order[probs[order] >= 0])
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", type=Path, help="full-tree trace files (.parquet)")
    parser.add_argument("--max-depth", type=int, default=8, help="deepest depth printed")
    args = parser.parse_args(argv)
    console = Console(width=200)
    for path in args.traces:
        try:
            trace = read_trace(path)
        except SpecFitError as exc:
            raise SystemExit(f"bench_acceptance: {exc}")
        depth, accepted = trace.depth.astype(np.int64), accepted_nodes(trace)
        scored = edge_mask(trace, given_parent_accepted=False)     # every node whose outcome is known
        if not scored.any():
            raise SystemExit(f"bench_acceptance: {path}: no node whose parent was verified")
        depths = range(1, min(int(depth.max()), args.max_depth) + 1)
        table = Table(title=f"{path}: {trace.n_cycles} cycles, {int(scored.sum())} nodes with a known outcome; "
                            "predicted (sum of path probabilities) / accepted, per depth")
        for name in ("calibration", "all", *(f"depth {d}" for d in depths), "Brier"):
            table.add_column(name, justify="left" if name == "calibration" else "right")
        fitted = cross_fitted(trace)
        for label, probs in fitted.items():
            cells = [f"{probs[scored].sum():.1f} / {int(accepted[scored].sum())}"]
            cells += [f"{probs[scored & (depth == d)].sum():.1f} / {int(accepted[scored & (depth == d)].sum())}" for d in depths]
            brier = float(np.mean((probs[scored] - accepted[scored]) ** 2))
            table.add_row(label, *cells, f"{brier:.4f}")
        console.print(table)
        top = Table(title=f"{path}: per cycle the N most probable draft nodes under each setting; predicted / accepted")
        for name in ("calibration", *(f"N = {n}" for n in TOP_N)):
            top.add_column(name, justify="left" if name == "calibration" else "right")
        for label, probs in fitted.items():
            cells = []
            for n in TOP_N:
                rows = top_nodes(trace, np.where(scored, probs, -1.0), n)
                predicted, got = probs[rows].sum(), accepted[rows].sum()
                cells.append(f"{predicted:.1f} / {int(got)} ({predicted / max(got, 1) - 1:+.1%})")
            top.add_row(label, *cells)
        console.print(top)


if __name__ == "__main__":
    main()
