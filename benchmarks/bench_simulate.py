"""Replay throughput of the simulator: cycles per second per policy on the shipped sample trace.

    taskset -c 1 python benchmarks/bench_simulate.py [--trace traces/qwen3-30b-a3b-chat.parquet] [--repeat 3] [--profile-policy specfit]
        [--cache-mode global] [--cache-policy moe-infinity]

One core (BLAS threads pinned to 1), true experts as the prediction, a 32-expert-per-layer LRU
cache, the pcie4 preset. A replay's cycles/s counts the cycles the policy actually ran (eagle3
commits ~2.5 tokens per cycle, so it runs fewer cycles per trace than ar). Each policy replays
once untimed (numba loads or compiles its kernels, and the Python policies' trees are built and
kept on the prepared trace), then ``--repeat`` times; the best is reported, as wall clock and as
the thread's CPU time (which a loaded machine inflates less). Preparing the trace (once per trace)
is timed separately. Then the goals next to the figures of the code before the compiled replay.
Every policy replays entirely in compiled code, the lever policies too (``specfit+cache+prefetch``:
the look-ahead eviction and the prefetch between levels; ``chain:1+cache+prefetch`` and
``ar+usage``, the fixed settings with levers that ``bench_policy.py`` compares SpecFit with), whose
"before" figures are those of the Python loop that ran them until stop 27.
``--profile-policy`` prints the top functions of a cProfile run, to show where the time goes.
``--cache-mode global`` shares ``--cache-experts`` x layers slots among all layers (victims are
then looked for among every layer's slots), ``--cache-policy`` sets the eviction rule.
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
POLICIES = ("ar", "chain:4", "eagle3", "static:8", "specfit", "oracle", "specfit+cache+prefetch",
            "chain:1+cache+prefetch", "ar+usage")
# cycles/s of the replay before the compiled kernels (benchmarks/RESULTS.md, same command, best
# of 5, one quiet core), and the goals (first bar)
BEFORE = {"ar": 3442, "chain:4": 2388, "eagle3": 2386, "static:8": 2652, "specfit": 621, "oracle": 2297}
# the lever policies in the Python loop around compiled rules, before the levers were compiled into
# the replay kernels (commit 898f015, best of 3 on one core, the better of two runs side by side with
# this code: benchmarks/RESULTS.md "Stop 27")
BEFORE_LEVERS = {"specfit+cache+prefetch": 730, "chain:1+cache+prefetch": 987, "ar+usage": 3445}
GOALS = {"eagle3": (20_000, 10_000), "specfit": (5_000, 2_500)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(ROOT / "traces" / "qwen3-30b-a3b-chat.parquet"))
    ap.add_argument("--repeat", type=int, default=3, help="timed replays per policy; the best is reported")
    ap.add_argument("--cache-experts", type=int, default=32, help="slots per layer (global: times the layers, shared)")
    ap.add_argument("--cache-mode", default="per_layer", choices=("per_layer", "global"))
    ap.add_argument("--cache-policy", default="lru", help="eviction: lru, lfu, fifo or moe-infinity")
    ap.add_argument("--profile-policy", default=None, help="also print a cProfile of this policy's replay")
    args = ap.parse_args()
    load_before = os.getloadavg()[0]

    trace = read_trace(args.trace)
    t0 = time.perf_counter()
    prep = prepare("bench", trace, trace.true_experts)
    prepare_s = time.perf_counter() - t0
    cost = preset_profile("pcie4", SHAPES[trace.model["name"]] if trace.model["name"] in SHAPES else None).cost
    print(f"trace {args.trace}: {trace.n_cycles} positions, {trace.tree_sizes.mean():.1f} nodes/tree, "
          f"{trace.n_layers} layers x {trace.n_experts} experts, top-{trace.top_k}; prepare {prepare_s * 1e3:.0f} ms "
          f"({trace.n_cycles / prepare_s:.0f} positions/s)")
    print("| policy | cycles | first replay (ms) | best replay (ms) | cycles/s | cycles/s (cpu) | us/cycle |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    rates = {}
    slots = args.cache_experts * (trace.n_layers if args.cache_mode == "global" else 1)

    def new_cache() -> ExpertCache:
        return ExpertCache(trace.n_layers, trace.n_experts, slots, mode=args.cache_mode, policy=args.cache_policy)

    for spec in POLICIES:
        t = time.perf_counter()
        replay(prep, make_policy(spec), new_cache(), cost)
        first = time.perf_counter() - t
        best = best_cpu = float("inf")
        cycles = 0
        for _ in range(args.repeat):
            cache = new_cache()
            policy = make_policy(spec)
            cpu, t = time.thread_time(), time.perf_counter()
            log = replay(prep, policy, cache, cost)
            best = min(best, time.perf_counter() - t)
            best_cpu = min(best_cpu, time.thread_time() - cpu)
            cycles = len(log)
        rates[spec] = (cycles / best, cycles / best_cpu)
        print(f"| {spec} | {cycles} | {first * 1e3:.1f} | {best * 1e3:.2f} | {cycles / best:,.0f} | "
              f"{cycles / best_cpu:,.0f} | {best / cycles * 1e6:.1f} |")
    print()
    default = (args.cache_experts, args.cache_mode, args.cache_policy) == (32, "per_layer", "lru")
    if Path(args.trace).resolve() != (ROOT / "traces" / "qwen3-30b-a3b-chat.parquet").resolve() or not default:
        print("(the figures before the compiled replay and the goals are for the default trace and cache: no "
              "comparison here)")
        print(f"\nload average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
        return
    print("| policy | before (cycles/s) | goal (first bar) | now | now (cpu) | speed-up | met |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for spec in POLICIES:
        goal, bar = GOALS.get(spec, (None, None))
        wall, cpu = rates[spec]
        met = "-" if goal is None else ("yes" if wall >= goal else "first bar" if wall >= bar else "no")
        target = "-" if goal is None else f">= {goal:,} ({bar:,})"
        before = BEFORE.get(spec, BEFORE_LEVERS.get(spec))
        print(f"| {spec} | {before:,} | {target} | {wall:,.0f} | {cpu:,.0f} | {wall / before:.1f}x | {met} |")
    print(f"\nload average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    if args.profile_policy:
        prof = cProfile.Profile()
        prof.enable()
        replay(prep, make_policy(args.profile_policy), new_cache(), cost)
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
        print(out.getvalue())


if __name__ == "__main__":
    main()
