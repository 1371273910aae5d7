"""Benchmark: a full replay of a 25k-token real-routing trace through the default policies at three
cache sizes, on one core.

The routing is ``olmoe-1b-7b-routing-general-coding.npz`` (OLMoE-1B-7B decode routing, 16 layers x
64 experts, top-8, about 25k tokens), imported once with ``specfit traces import-routing`` (EAGLE-
style trees synthesised around the real routing) and kept at ``--trace``. The trace is prepared as
``specfit simulate`` does by default (oracle predictor, calibrated acceptance), then
:func:`specfit.simulate.sweep.run_sweep` replays the seven default policies (``static:auto`` tries
its eleven sizes) at 8, 16 and 32 experts per layer under the pcie4 preset. Prints the time of each
step and of each cell, and the summary; the goal is the sweep in under a minute.

    taskset -c 1 python benchmarks/bench_sweep_real.py [--routing PATH] [--trace PATH] [--predictor oracle]

Skips with a message (exit 0) when the routing file is absent (an explicit ``--routing`` must exist).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ROUTING = "olmoe-1b-7b-routing-general-coding.npz"
GOAL_S = 60.0


def find_routing(given: str | None) -> Path | None:
    candidates = [Path(given)] if given else [ROOT.parent / "shared" / "data" / ROUTING, ROOT / "shared" / "data" / ROUTING,
                                              Path("/work/shared/data") / ROUTING]
    return next((p for p in candidates if p.is_file()), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--routing", default=None, help=f"the routing file (default: {ROUTING} in ../shared/data)")
    ap.add_argument("--trace", default=str(Path(tempfile.gettempdir()) / "specfit-bench" / "olmoe-routing.parquet"),
                    help="where the imported trace is kept (imported when missing)")
    ap.add_argument("--predictor", default="oracle", help="expert predictor, as specfit simulate --predictor")
    ap.add_argument("--cache-experts", default="8,16,32")
    ap.add_argument("--profile", default="pcie4")
    args = ap.parse_args()
    routing = find_routing(args.routing)
    if routing is None and args.routing:
        raise SystemExit(f"--routing {args.routing}: no such file")
    if routing is None:
        print(f"skipped: {ROUTING} not found (pass --routing PATH); this benchmark needs the real routing")
        return
    trace_path = Path(args.trace)
    if not trace_path.is_file():
        trace_path.parent.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "specfit", "traces", "import-routing", str(routing), "--out",
                        str(trace_path), "--json"], check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
        print(f"imported {routing.name} -> {trace_path} in {time.perf_counter() - t:.1f} s")

    from specfit.calibrate.presets import SHAPES, preset_profile
    from specfit.simulate.replay import prepare_trace
    from specfit.simulate.sweep import DEFAULT_POLICIES, Scenario, run_sweep
    from specfit.traces.format import read_trace

    load_before = os.getloadavg()[0]
    t = time.perf_counter()
    trace = read_trace(trace_path, weights=False)      # as specfit simulate and sweep read it
    read_s = time.perf_counter() - t
    t = time.perf_counter()
    prep = prepare_trace("olmoe-routing", trace, predictor=args.predictor, acceptance="calibrated")
    prepare_s = time.perf_counter() - t
    shape = SHAPES.get(trace.model["name"])
    scenarios = [Scenario(args.profile, preset_profile(args.profile, shape).cost)]
    sizes = [int(v) for v in args.cache_experts.split(",")]
    cells: list[tuple[str, float]] = []
    last = [time.perf_counter()]

    def progress(label: str) -> None:
        now = time.perf_counter()
        cells.append((label, now - last[0]))
        last[0] = now

    t = time.perf_counter()
    cpu = time.process_time()
    cycles, summary = run_sweep([prep], list(DEFAULT_POLICIES), sizes, scenarios, progress=progress)
    sweep_s, sweep_cpu = time.perf_counter() - t, time.process_time() - cpu

    print(f"trace: {trace.n_cycles} positions in {len(prep.first_cycles)} sequences, {trace.tree_sizes.mean():.1f} "
          f"nodes/tree, {trace.n_layers} layers x {trace.n_experts} experts, top-{trace.top_k}")
    print(f"read {read_s:.1f} s, prepare ({args.predictor} predictor, calibrated acceptance) {prepare_s:.1f} s")
    print("\n| cell | seconds |\n|---|---:|")
    for label, seconds in cells:
        print(f"| {label.split(' ', 2)[-1]} | {seconds:.2f} |")
    print("\n| cache experts | policy | cycles | tokens/cycle | tokens/s | vs ar | hit rate |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for row in summary.itertuples():
        print(f"| {row.cache_experts} | {row.policy} | {row.cycles} | {row.tokens_per_cycle:.2f} | {row.tokens_per_s:.1f} "
              f"| {row.speedup_vs_ar:.3f} | {row.hit_rate:.3f} |")
    met = "met" if sweep_s <= GOAL_S else f"missed by {sweep_s - GOAL_S:.0f} s"
    print(f"\nsweep: {len(cycles):,} replayed cycles in {sweep_s:.1f} s ({sweep_cpu:.1f} s CPU), goal < {GOAL_S:.0f} s: "
          f"{met}; with read and prepare {read_s + prepare_s + sweep_s:.1f} s; load average {load_before:.1f} "
          f"before, {os.getloadavg()[0]:.1f} after")


if __name__ == "__main__":
    main()
