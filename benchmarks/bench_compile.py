"""What compiling costs the user: the first call of each kernel family with a cold numba cache
(compiling) and with a warm one (loading from disk), in fresh processes; and the CLI's start-up.

    python benchmarks/bench_compile.py [--runs 5] [--families "warm-up (one process),warm-up (side by side)"]

Each family runs in its own fresh process with ``NUMBA_CACHE_DIR`` pointing at a new, empty
folder (cold), then again at the same folder (warm): the search (DraftTree, best_subtree,
greedy_subtree, evaluate, and SpecFit's per-level decision as the live decoder calls it), the expert cache (admit, admit_layer), the decoder's warm-up
(``kernel_warmup.warm_up``) in one process and side by side with a child process, and the replay (prepare and one
replay per policy, the lever policy ``specfit+cache+prefetch`` last, on the OLMoE sample trace). ``specfit --help`` is timed ``--runs`` times with the
cache warm (it imports no numba) and so is a small ``specfit simulate`` run (the CLI end to end,
after one run that warms the checkout's own cache).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "traces" / "olmoe-1b-7b-real-routing.parquet"

FAMILIES = {
    "search": """
import numpy as np
from specfit import CostModel, DraftTree, best_subtree, greedy_subtree
from specfit.search import evaluate
rng = np.random.default_rng(0)
tree = DraftTree(parents=np.array([-1, 0, 0, 1, 1, 2]), path_probs=np.array([1.0, 0.8, 0.5, 0.6, 0.3, 0.2]))
experts = rng.integers(0, 128, size=(6, 48, 8))
cached = rng.random((48, 128)) < 0.25
cost = CostModel(base_s=3e-3, per_node_s=4e-5, hit_s=1.5e-5, miss_s=2e-5, draft_level_s=8e-4)
mark("import")
best_subtree(tree, experts, cached, cost, 2)
mark("best_subtree")
best_subtree(tree, experts, cached, cost, 2, start=np.array([0, 1]))
greedy_subtree(tree, experts, cached, cost, 2)
mark("greedy_subtree")
evaluate(tree, [0, 1], experts, cached, cost, 1)
mark("evaluate")
from specfit.policies import CycleView, SpecFitPolicy, choose
choose(SpecFitPolicy(), CycleView(tree, experts, cached, cost, 2))
mark("specfit per level")
""",
    "cache": """
import numpy as np
from specfit import ExpertCache
cache = ExpertCache(16, 64, 8)
mark("import")
cache.admit(np.random.default_rng(0).random((16, 64)) < 0.2)
mark("admit")
cache.admit_layer(3, np.array([1, 5, 9]))
mark("admit_layer")
ExpertCache(16, 64, 40, mode="global", policy="lfu").admit(np.ones((16, 64), dtype=bool))
mark("admit global")
""",
    # what `specfit decode` / `demo` compile before the first timed cycle (kernel_warmup), in one
    # process and with the runtime's kernels compiled in a child process beside it
    "warm-up (one process)": """
from specfit.kernel_warmup import warm_up
mark("import")
warm_up(parallel=False)
mark("warm_up")
""",
    "warm-up (side by side)": """
from specfit.kernel_warmup import warm_up
mark("import")
warm_up()          # the default: side by side when the cache is cold, in-process when it is warm
mark("warm_up")
""",
    "replay": f"""
from specfit.calibrate.presets import SHAPES, preset_profile
from specfit.experts.cache import ExpertCache
from specfit.policies import make_policy
from specfit.simulate.replay import prepare, replay
from specfit.traces.format import read_trace
trace = read_trace({str(SAMPLE)!r})
cost = preset_profile("pcie4", SHAPES["olmoe-1b-7b"]).cost
mark("import")
prep = prepare("s", trace, trace.true_experts)
mark("prepare")
for spec in ("ar", "eagle3", "specfit", "oracle", "specfit+cache+prefetch"):
    replay(prep, make_policy(spec), ExpertCache(16, 64, 8), cost)
    mark(spec)
""",
}

HARNESS = """
import json, sys, time
t0 = time.perf_counter(); last = [t0]; out = {}
def mark(name):
    now = time.perf_counter(); out[name] = now - last[0]; last[0] = now
"""


def run_family(name: str, cache_dir: str) -> dict:
    code = HARNESS + FAMILIES[name] + "\nprint(json.dumps(out))\n"
    env = {**os.environ, "NUMBA_CACHE_DIR": cache_dir, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cpu = os.times()
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd=ROOT)
    after = os.times()
    steps = json.loads(result.stdout.strip().splitlines()[-1])
    steps["process cpu"] = after.children_user + after.children_system - cpu.children_user - cpu.children_system
    return steps


def timed_command(args: list[str], runs: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "specfit", *args], env=env, capture_output=True, check=True, cwd=ROOT)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated, of: {', '.join(FAMILIES)}")
    args = ap.parse_args()
    families = [f.strip() for f in args.families.split(",")]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        ap.error(f"--families: unknown {unknown}; expected some of {list(FAMILIES)}")
    load_before = os.getloadavg()[0]
    print("| family | step | cold cache (compile) s | warm cache (load) s |\n|---|---|---:|---:|")
    for name in families:
        with tempfile.TemporaryDirectory() as cache_dir:
            cold = run_family(name, cache_dir)
            warm = run_family(name, cache_dir)
        for step in cold:
            print(f"| {name} | {step} | {cold[step]:.2f} | {warm[step]:.2f} |")
    help_s = timed_command(["--help"], args.runs)
    simulate = ["simulate", "--trace", str(SAMPLE), "--policies", "ar,eagle3,specfit", "--cache-experts", "8", "--json"]
    timed_command(simulate, 1)   # the checkout's own numba cache (no NUMBA_CACHE_DIR here): warm it first
    sim_s = timed_command(simulate, max(1, args.runs // 2))
    print(f"\n`python -m specfit --help`: {help_s:.2f} s (median of {args.runs}); `python -m specfit simulate` on the "
          f"OLMoE sample (3 policies, warm kernels): {sim_s:.2f} s; load average {load_before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after")


if __name__ == "__main__":
    main()
