"""Benchmark: the online model's per-cycle error with the decoder's own noise taken out or left in.

Two things the decoder does add time to some cycles and not others: Python's cyclic garbage
collector (paused while a generation's cycles run, :func:`specfit.runtime.decoder.gc_paused`) and
the online cost model's refits (priced in the cycle that runs them, ``OnlineCostModel.observe(...,
overhead_s=)``). This script runs ``bench_decode.py`` in alternating fresh processes, ``new`` (the
code as it is) and ``old`` (both undone in that process: the collector as Python runs it, the
online model handed no update time), and prints every run's held-out cycle-time MAPE per policy
with the means per arm. Measure on a machine you are not using for anything else.

    python benchmarks/bench_noise.py [--pairs 4] [--busy 1] [--policies ar,eagle3,specfit]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

ARMS = ("new", "old")


def undo_noise_fixes() -> None:
    """In this process: the collector as Python runs it, and no update time handed to the model."""
    import specfit.runtime.decoder as decoder
    from specfit.calibrate.online import OnlineCostModel

    decoder.gc_paused = lambda pause=True: contextlib.nullcontext()
    observe = OnlineCostModel.observe

    def observe_without_overhead(self, *args, overhead_s=0.0, **kwargs):
        return observe(self, *args, overhead_s=0.0, **kwargs)

    OnlineCostModel.observe = observe_without_overhead


def one_run(arm: str, bench_args: list[str]) -> list[dict]:
    """One fresh process of ``bench_decode.py --json`` in ``arm``; its per-policy summaries."""
    out = subprocess.run([sys.executable, __file__, "--run-arm", arm, "--", *bench_args, "--json"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"bench_noise: the {arm} run failed:\n{out.stderr[-2000:]}")
    start = out.stdout.rfind("\n[")
    return json.loads(out.stdout[start + 1:] if start >= 0 else out.stdout)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    import bench_decode

    if bench_decode.run_as_arm(argv, {"old": undo_noise_fixes}):     # a child: undo the fixes if asked, run bench_decode
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=4, help="new/old pairs, alternating")
    parser.add_argument("--busy", type=int, default=0, help="CPU-bound processes beside every run")
    parser.add_argument("--policies", default="ar,eagle3,specfit")
    args = parser.parse_args(argv)
    if args.pairs < 1:
        raise SystemExit(f"bench_noise: --pairs: expected >= 1, got {args.pairs}")
    bench_args = ["--policies", args.policies, "--busy", str(args.busy)]
    policies = args.policies.split(",")
    mape = {arm: [] for arm in ARMS}
    table = Table(title=f"held-out cycle-time MAPE per run ({args.busy} CPU-bound process(es) beside)")
    for name in ("pair", "arm", *policies, "every policy <= 10 %"):
        table.add_column(name, justify="left" if name in ("pair", "arm") else "right")
    for pair in range(args.pairs):
        for arm in ARMS:
            rows = {r["policy"]: r for r in one_run(arm, bench_args)}
            values = [rows[p]["time_mape"] for p in policies]
            mape[arm].append(values)
            table.add_row(str(pair + 1), arm, *(f"{v:.1%}" for v in values), "yes" if max(values) <= 0.10 else "no")
    for arm in ARMS:
        a = np.array(mape[arm])
        table.add_row("mean", arm, *(f"{v:.1%}" for v in a.mean(axis=0)),
                      f"{int((a.max(axis=1) <= 0.10).sum())} of {len(a)}")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
