"""Benchmark: the online cost model's held-out cycle-time error, replayed on recorded live cycles.

A live run's ``cycles.parquet`` keeps, per cycle, the counts its policy priced (predicted hits and
misses), the counts it verified and its measured time. Replaying them in order through an
:class:`~specfit.calibrate.online.OnlineCostModel` — each cycle predicted before it is observed —
gives the error a model would have had on the same cycles (the decisions are the recorded ones;
only the prediction is replayed). With the model the run used, the replay reproduces the recorded
``predicted_time_s``. Prints one row per run directory and model: MAPE per policy, and the lag-1
correlation of log(measured / predicted) (what a causal model has left to learn). Every model row
runs this checkout's :class:`OnlineCostModel` with the options it names (from stop 40 each refit
re-bases the speed tracker to the new fit); "as recorded" is what the run's own model predicted.

    python benchmarks/bench_decode.py --out runs/quiet          # writes cycles.parquet and profile.json
    python benchmarks/bench_online.py runs/quiet [runs/busy ...] [--profile PROFILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specfit.accounting import read_cycles  # noqa: E402
from specfit.calibrate.online import OnlineCostModel  # noqa: E402
from specfit.errors import SpecFitError  # noqa: E402
from specfit.calibrate.presets import resolve_profile  # noqa: E402
from specfit.runtime.run_dir import read_decode_cycles  # noqa: E402

# (label, OnlineCostModel options, whether the model sees a cycle before the next is priced, whether
# it is handed the recorded seconds of its own update in each cycle (update_time_s; runs from stop 23 on))
NO_PACE = {"pace_half_life": None}
BEFORE = {"half_life": 8.0, "refit_every": 4, "select_every": 4, "speed_half_life": None,
          "refit_interval_s": 0.0, **NO_PACE}   # the defaults before stop 22
MODELS = (
    ("refit only, seen one cycle late (before stop 22)", BEFORE, False, False),
    ("refit only, seen before the next", BEFORE, True, False),
    ("refit every 4 + speed tracker (stop 22's live runs)",
     {"refit_every": 4, "select_every": 4, "refit_interval_s": 0.0, **NO_PACE}, True, False),
    ("refit every 8 + speed tracker (stop 22's default)", {"refit_interval_s": 0.0, **NO_PACE}, True, False),
    ("... + its own update priced (stop 23's default)", {"refit_interval_s": 0.0, **NO_PACE}, True, True),
    ("... + refits at least 0.1 s apart (stop 28's default)", NO_PACE, True, True),
    ("... + the rest of a cycle at its drafter's pace (the default)", {}, True, True),
    ("... with a window of 128 cycles, half-life 64 (tried in stop 37)", {"window": 128, "half_life": 64.0}, True, True),
)


def replay(cycles, prior, options: dict, seen_first: bool, priced_update: bool = True) -> np.ndarray:
    """Predicted seconds of every cycle (in order), each made before the model saw it. With
    ``priced_update`` the model is handed each cycle's recorded update time (a model whose refit
    schedule differs from the recorded one's learns the recorded updates' seconds, not its own)."""
    online = OnlineCostModel(prior, **options)
    rows = list(cycles.itertuples())
    predicted = np.zeros(len(rows))

    def see(row):
        online.observe(row.draft_levels, row.nodes_verified, row.hits, row.misses, row.measured_time_s,
                       priced=(row.predicted_hits, row.predicted_misses),
                       overhead_s=row.update_time_s if priced_update else 0.0, drafter_s=drafter_s(row))

    for t, row in enumerate(rows):
        if seen_first and t:
            see(rows[t - 1])
        # priced as the decoder prices a cycle's selection: after its drafter passes
        cost = online.within_cycle(drafter_s(row), row.draft_levels)
        predicted[t] = cost.time_s(row.draft_levels, row.nodes_verified, row.predicted_hits, row.predicted_misses)
        if not seen_first and t:
            see(rows[t - 1])
    return predicted


def drafter_s(row) -> float:
    """The cycle's drafter seconds (0 where a run recorded none)."""
    value = float(row.drafter_time_s)
    return value if np.isfinite(value) else 0.0


def errors(measured: np.ndarray, predicted: np.ndarray) -> tuple[float, float]:
    """(MAPE, lag-1 correlation of the log ratio)."""
    ratio = np.log(measured / predicted)
    lag1 = float(np.corrcoef(ratio[:-1], ratio[1:])[0, 1]) if ratio.size > 2 else float("nan")
    return float(np.mean(np.abs(predicted - measured) / measured)), lag1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (cycles.parquet, profile.json)")
    parser.add_argument("--profile", default=None, help="the prior (default: RUN/profile.json)")
    args = parser.parse_args(argv)
    table = Table(title="online cost model on recorded cycles: MAPE (lag-1 correlation of log measured/predicted)")
    for name in ("run", "model", "policies"):
        table.add_column(name)
    for run in args.runs:
        try:
            prior = resolve_profile(args.profile or run / "profile.json").cost
            cycles = read_decode_cycles(run)
        except SpecFitError as exc:
            raise SystemExit(f"bench_online: {exc} (a `bench_decode.py --out` run directory, or pass --profile)")
        if cycles.empty:
            raise SystemExit(f"bench_online: {run}: no recorded cycles")
        cycles = read_cycles(cycles)                             # columns an older run lacks, empty
        cycles = cycles[cycles["predicted_hits"] >= 0]          # cycles a policy priced
        groups = [(p, g.sort_values(["sequence", "position"])) for p, g in cycles.groupby("policy", sort=False)]
        recorded = [f"{p} {errors(g.measured_time_s.values, g.predicted_time_s.values)[0]:.1%}" for p, g in groups]
        table.add_row(run.name, "as recorded", ", ".join(recorded))
        for label, options, seen_first, priced_update in MODELS:
            if priced_update and not np.isfinite(cycles["update_time_s"].to_numpy(dtype=float)).any():
                continue                                         # recorded before update_time_s existed
            cells = []
            for policy, g in groups:
                mape, lag1 = errors(g.measured_time_s.values, replay(g, prior, options, seen_first, priced_update))
                cells.append(f"{policy} {mape:.1%} ({lag1:+.2f})")
            table.add_row("", label, ", ".join(cells))
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
