"""Benchmark: the router predictor with and without the recent-routing bonus, live.

Runs ``bench_decode.py --out`` in alternating fresh processes: ``bonus`` (the code as it is: each
layer raises the experts of the most recent known routing, by a bonus chosen online) and
``none`` (that process's router predictor with the bonus fixed at 0). Prints, per run and policy,
the predicted union size's error per cycle (MAPE and mean signed error), the slot precision of
the verified draft nodes, the predicted and measured misses per cycle, and tokens/s.

    python benchmarks/bench_router.py [--pairs 2] [--policies eagle3,specfit]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

ARMS = ("bonus", "none")


def without_bonus() -> None:
    """In this process: the router predictor never raises the recent routing's experts."""
    import specfit.experts.router as router

    router.RECENT_BONUSES = (0.0,)
    init = router.RouterPredictor.__init__

    def init_without(self, *args, **kwargs):
        kwargs["recent_bonus"] = 0.0
        init(self, *args, **kwargs)

    router.RouterPredictor.__init__ = init_without


def summary(run_dir: Path, policy: str) -> dict:
    import pandas as pd

    from specfit.runtime.run_dir import read_decode_cycles

    cycles = read_decode_cycles(run_dir)
    c = cycles[(cycles["policy"] == policy) & (cycles["predicted_union_size"] >= 0)]
    true, predicted = c["union_size"].to_numpy(float), c["predicted_union_size"].to_numpy(float)
    records = pd.read_json(run_dir / "decode.jsonl", lines=True)
    r = records[records["policy"] == policy]
    return {"union_mape": float(np.mean(np.abs(predicted - true) / true)),
            "union_bias": float(np.mean((predicted - true) / true)),
            "precision": float(np.nanmean(c["prediction_precision"])),
            "misses": float(c["misses"].mean()), "predicted_misses": float(c["predicted_misses"].mean()),
            "tokens_per_s": float(r["decode_tokens"].sum() / r["decode_time_s"].sum())}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    import bench_decode

    if bench_decode.run_as_arm(argv, {"none": without_bonus}):     # a child: undo the bonus if asked, run bench_decode
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--policies", default="eagle3,specfit")
    args = parser.parse_args(argv)
    if args.pairs < 1:
        raise SystemExit(f"bench_router: --pairs: expected >= 1, got {args.pairs}")
    work = Path(tempfile.mkdtemp(prefix="bench_router."))
    policies = args.policies.split(",")
    print("| pair | arm | policy | union MAPE | union mean error | slot precision | misses / cycle (predicted) | tokens/s |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for pair in range(args.pairs):
        for arm in (ARMS if pair % 2 == 0 else ARMS[::-1]):
            out = work / f"{arm}-{pair}"
            run = subprocess.run([sys.executable, __file__, "--run-arm", arm, "--", "--policies", args.policies,
                                  "--out", str(out)], capture_output=True, text=True)
            if run.returncode != 0:
                raise SystemExit(f"bench_router: the {arm} run failed:\n{run.stderr[-2000:]}")
            for policy in policies:
                s = summary(out, policy)
                print(f"| {pair + 1} | {arm} | {policy} | {s['union_mape']:.1%} | {s['union_bias']:+.1%} | "
                      f"{s['precision']:.3f} | {s['misses']:.1f} ({s['predicted_misses']:.1f}) | {s['tokens_per_s']:.1f} |",
                      flush=True)


if __name__ == "__main__":
    main()
