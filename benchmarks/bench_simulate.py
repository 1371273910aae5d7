"""Replay throughput of the simulator: cycles per second per policy on the shipped sample trace.

    python benchmarks/bench_simulate.py [--trace traces/qwen3-30b-a3b-chat.parquet] [--repeat 3] [--profile-policy specfit]

One core (BLAS threads pinned to 1), true experts as the prediction, a 32-expert-per-layer LRU
cache, the pcie4 preset. A replay's cycles/s counts the cycles the policy actually ran (eagle3
commits ~2.5 tokens per cycle, so it runs fewer cycles per trace than ar). Preparing the trace
(cutting trees per level, done once per trace) is timed separately. ``--profile-policy`` prints
the top functions of a cProfile run, to show where the time goes.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse  # noqa: E402
import cProfile  # noqa: E402
import io  # noqa: E402
import pstats  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from specfit.calibrate.presets import SHAPES, preset_profile  # noqa: E402
from specfit.experts.cache import ExpertCache  # noqa: E402
from specfit.policies import make_policy  # noqa: E402
from specfit.simulate.replay import prepare, replay  # noqa: E402
from specfit.traces.format import read_trace  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("ar", "chain:4", "eagle3", "static:8", "specfit", "oracle")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(ROOT / "traces" / "qwen3-30b-a3b-chat.parquet"))
    ap.add_argument("--repeat", type=int, default=3, help="replays per policy; the best is reported")
    ap.add_argument("--cache-experts", type=int, default=32)
    ap.add_argument("--profile-policy", default=None, help="also print a cProfile of this policy's replay")
    args = ap.parse_args()

    trace = read_trace(args.trace)
    t0 = time.perf_counter()
    prep = prepare("bench", trace, trace.true_experts)
    prepare_s = time.perf_counter() - t0
    cost = preset_profile("pcie4", SHAPES[trace.model["name"]] if trace.model["name"] in SHAPES else None).cost
    print(f"trace {args.trace}: {trace.n_cycles} positions, {trace.tree_sizes.mean():.1f} nodes/tree, "
          f"{trace.n_layers} layers x {trace.n_experts} experts, top-{trace.top_k}; prepare {prepare_s * 1e3:.0f} ms "
          f"({trace.n_cycles / prepare_s:.0f} positions/s)")
    print("| policy | cycles | best replay (ms) | cycles/s | us/cycle |")
    print("|---|---:|---:|---:|---:|")
    for spec in POLICIES:
        best = float("inf")
        cycles = 0
        for _ in range(args.repeat):
            cache = ExpertCache(trace.n_layers, trace.n_experts, args.cache_experts)
            t = time.perf_counter()
            log = replay(prep, make_policy(spec), cache, cost)
            best = min(best, time.perf_counter() - t)
            cycles = len(log)
        print(f"| {spec} | {cycles} | {best * 1e3:.1f} | {cycles / best:,.0f} | {best / cycles * 1e6:.0f} |")
    if args.profile_policy:
        prof = cProfile.Profile()
        prof.enable()
        replay(prep, make_policy(args.profile_policy), ExpertCache(trace.n_layers, trace.n_experts, args.cache_experts), cost)
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
        print(out.getvalue())


if __name__ == "__main__":
    main()
