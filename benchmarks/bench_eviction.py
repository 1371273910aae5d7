"""SpecFit against the fixed settings when every policy's cache evicts by MoE-Infinity's rule.

    python benchmarks/bench_eviction.py [--traces olmoe-sample,olmoe-general,olmoe-coding,qwen3-chat]
        [--profiles pcie4,pcie5,gh200] [--caches 0.25,0.5] [--modes per_layer,global]
        [--evictions lru,lfu,moe-infinity] [--out runs/bench_eviction.json]

``bench_policy.py`` compares the policies with an LRU cache per layer. A reader who runs
MoE-Infinity evicts otherwise: its dispatcher keeps the experts fetched from the host most often
in the current request (``--cache-policy moe-infinity``: counts of fetches since the request's
decoding began, a hit not counted, kept across evictions, shared over every layer's experts). This replays, on the traces and cost models of
``bench_policy.py`` (true experts, acceptance calibrated cross-fitted), each cache size as a share
of a layer's experts per layer (``per_layer``) and the same number of slots shared by all layers
(``global``, MoE-Infinity's own mode), under every eviction rule: the fixed settings (``ar``,
``chain:1..4``, ``static:auto``), ``eagle3``, SpecFit without levers (``specfit``) and with them
(``specfit+cache+prefetch``, whose look-ahead orders the victims first and the eviction rule breaks
its ties), and Belady's offline optimum on ``ar``'s requests (the ceiling of any eviction rule for
AR). It prints one table per trace and profile and then, over all settings, the median and range of:
each policy under each rule against itself under LRU; SpecFit against the best fixed setting under
the same rule (and the best of them given SpecFit's levers, ``bench_policy.py``'s "fixed+levers");
and SpecFit under LRU against the best fixed setting under MoE-Infinity's rule (what a user of
SpecFit's default gets against a fixed setting tuned with MoE-Infinity's cache).
Cache size 0 is left out: without slots every rule is the same.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_policy as bp  # noqa: E402
from specfit.calibrate.profile import ModelShape  # noqa: E402
from specfit.experts.cache import EVICTION_POLICIES  # noqa: E402
from specfit.policies import make_policy  # noqa: E402
from specfit.simulate.replay import prepare_trace  # noqa: E402

SPECFIT = ("specfit", "specfit+cache+prefetch")
POLICIES = bp.FIXED + ("eagle3",) + SPECFIT
# the fixed settings given SpecFit's runtime levers (ar: the recent-use eviction alone)
BESTS = (("best fixed", bp.FIXED), ("best fixed+levers", bp.FIXED_LEVERS))


def belady_ar(prep, capacity: int, mode: str, cost) -> float:
    """``ar``'s requests under Belady's offline optimum (no eviction rule does better for AR)."""
    log = bp.run(prep, make_policy("ar"), capacity, cost, record_unions=True, mode=mode)
    return bp.rate(log, cost, capacity, prep, mode=mode)


def run_setting(prep, capacity: int, mode: str, evictions: list[str], cost, max_nodes: int) -> dict:
    row: dict = {"ar belady": belady_ar(prep, capacity, mode, cost)}
    for eviction in evictions:
        for spec in POLICIES + bp.FIXED_LEVERS:
            row[spec, eviction] = bp.best_of(prep, spec, capacity, cost, max_nodes, mode, eviction)[0]
        for label, specs in BESTS:
            best = max(specs, key=lambda k: row[k, eviction])
            row[label, eviction], row[f"{label} name", eviction] = row[best, eviction], best
    return row


def _ratio_line(label: str, values: list[float]) -> str:
    v = np.asarray(values)
    return (f"| {label} | {np.median(v):.3f} | {v.min():.3f}-{v.max():.3f} | {int((v < 0.98).sum())} | "
            f"{int((v > 1.0).sum())} of {v.size} |")


def print_setting(name: str, profile: str, rows: list[dict], evictions: list[str]) -> None:
    print(f"\n#### {name}, {profile}: tokens/s (per_layer: slots per layer; global: the same slots shared)\n")
    heads = ["cache", "mode", "eviction", *POLICIES, "best fixed", "best fixed+levers", "specfit+levers / best fixed",
             "ar belady"]
    print("| " + " | ".join(heads) + " |")
    print("|" + "---|" * len(heads))
    for r in rows:
        for e in evictions:
            cells = [str(r["cache"]), r["mode"], e, *(f"{r[p, e]:.2f}" for p in POLICIES),
                     f"{r['best fixed', e]:.2f} ({r['best fixed name', e]})",
                     f"{r['best fixed+levers', e]:.2f} ({r['best fixed+levers name', e]})",
                     f"{r['specfit+cache+prefetch', e] / r['best fixed', e]:.3f}", f"{r['ar belady']:.2f}"]
            print("| " + " | ".join(cells) + " |")


def print_overall(rows: list[dict], evictions: list[str]) -> None:
    print(f"\n### Over all {len(rows)} settings\n")
    print("| ratio | median | range | below 0.98 | above 1 |")
    print("|---|---:|---|---:|---:|")
    for e in evictions:
        if e == "lru":
            continue
        for spec in ("ar", "best fixed", "best fixed+levers", "eagle3", *SPECFIT):
            print(_ratio_line(f"`{spec}` under {e} / under lru", [r[spec, e] / r[spec, "lru"] for r in rows]))
    for e in evictions:
        for spec in SPECFIT:
            print(_ratio_line(f"`{spec}` / best fixed, both under {e}",
                              [r[spec, e] / r["best fixed", e] for r in rows]))
        print(_ratio_line(f"`specfit+cache+prefetch` / best fixed+levers, both under {e}",
                          [r["specfit+cache+prefetch", e] / r["best fixed+levers", e] for r in rows]))
    if "moe-infinity" in evictions:
        for spec in SPECFIT:
            print(_ratio_line(f"`{spec}` under lru / best fixed under moe-infinity",
                              [r[spec, "lru"] / r["best fixed", "moe-infinity"] for r in rows]))
    best_rule = [max(evictions, key=lambda e: r["ar", e]) for r in rows]
    print(_ratio_line("`ar` under its best rule / Belady's optimum",
                      [r["ar", e] / r["ar belady"] for r, e in zip(rows, best_rule)]))
    for label, _ in BESTS:
        for e in evictions:
            names = [r[f"{label} name", e] for r in rows]
            print(f"\n{label} under {e}: " + ", ".join(f"{n} in {names.count(n)}" for n in sorted(set(names))))


def main() -> None:
    ap = bp.trace_arguments(__doc__)
    ap.add_argument("--caches", default="0.25,0.5", help="cache sizes as shares of a layer's experts (> 0)")
    ap.add_argument("--modes", default="per_layer,global")
    ap.add_argument("--evictions", default="lru,lfu,moe-infinity")
    ap.add_argument("--static-max-nodes", type=int, default=8)
    ap.add_argument("--out", default=None, help="write every row as JSON here")
    args = ap.parse_args()
    evictions = [e.strip() for e in args.evictions.split(",") if e.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    shares = [float(s) for s in args.caches.split(",") if s.strip()]
    bad = [e for e in evictions if e not in EVICTION_POLICIES] + [m for m in modes if m not in ("per_layer", "global")]
    if bad or not evictions or "lru" not in evictions or any(s <= 0 for s in shares):
        raise SystemExit(f"--evictions: among {', '.join(EVICTION_POLICIES)}, lru included; --modes: per_layer, "
                         f"global; --caches: shares > 0 (got {args.evictions!r}, {args.modes!r}, {args.caches!r})")
    all_rows = []
    start = time.perf_counter()
    for name, trace in bp.load_traces(args.traces.split(","), args.sequences, args.workload):
        shape = ModelShape.from_trace_meta(trace.model)
        prep = prepare_trace(name, trace, "oracle", "calibrated")
        max_nodes = min(args.static_max_nodes, max(int(t[-1].n_nodes) for t in prep.level_trees))
        print(bp.trace_heading(name, trace))
        for profile in args.profiles.split(","):
            cost = bp.profile_cost(profile, trace, shape)
            rows = [{"trace": name, "profile": profile, "cache": per_layer, "mode": mode,
                     **run_setting(prep, capacity, mode, evictions, cost, max_nodes)}
                    for per_layer, mode, capacity in bp.cache_settings(trace, shares, modes)]
            print_setting(name, profile, rows, evictions)
            all_rows.extend(rows)
            if args.out:
                _write(args.out, all_rows)
    print_overall(bp.some_measured(all_rows), evictions)
    print(f"\n({time.perf_counter() - start:.0f} s)")
    if args.out:
        _write(args.out, all_rows)
        print(f"rows written to {args.out}")


def _write(path: str, rows: list[dict]) -> None:
    """``bench_policy.py``'s writer, a (policy, eviction) key as ``"policy / eviction"``."""
    bp._write(path, [{(" / ".join(k) if isinstance(k, tuple) else k): v for k, v in r.items()} for r in rows])


if __name__ == "__main__":
    main()
