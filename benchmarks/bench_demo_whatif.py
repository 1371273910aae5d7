"""Benchmark: `specfit demo`'s what-if with the experts the policies decide with: the live router's
predictions as the demo recorded them, or the experts the target really routed to.

    specfit demo --out runs/demo
    python benchmarks/bench_demo_whatif.py runs/demo/trace.parquet [--profiles gh200] [--caches 0]

The demo replays its recorded trace at Qwen3-30B-A3B expert scale (:func:`specfit.demo.whatif_scenarios`)
with the live predictions; this replays the same trace, scenarios and policies with those predictions,
with them and no uncertainty price, and with the true experts (``oracle``), and prints per setting each
policy's tokens/s over ``ar`` with its levels, nodes and committed tokens per cycle. Every policy is
charged with the true experts in every case.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specfit.demo import whatif_scenarios  # noqa: E402
from specfit.errors import SpecFitError  # noqa: E402
from specfit.policies import is_tuned, make_policy  # noqa: E402
from specfit.simulate.replay import prepare_trace  # noqa: E402
from specfit.simulate.sweep import run_sweep  # noqa: E402
from specfit.traces.format import read_trace  # noqa: E402

POLICIES = ["ar", "static:auto", "sequoia:auto", "eagle3", "specfit"]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path, help="a specfit demo run's trace.parquet")
    parser.add_argument("--profiles", default="gh200", help="of pcie4, pcie5, gh200 (or as the demo names them, "
                        "pcie4-qwen3, ...)")
    parser.add_argument("--caches", default="0", help="experts cached per layer")
    parser.add_argument("--sequoia-grid", action="store_true", help="also replay sequoia:N:D for every size of "
                        "sequoia:auto and depth 1-8, and print the fastest pair of each setting beside sequoia:auto "
                        "(Sequoia picks the depth too; sequoia:auto picks the size alone)")
    args = parser.parse_args(argv)
    try:
        trace = read_trace(args.trace)
    except SpecFitError as exc:
        parser.error(str(exc))
    if trace.predicted_experts is None:
        parser.error(f"{args.trace}: no recorded predictions (record it with specfit demo or decode --record-full)")
    presets = tuple(p.strip().removesuffix("-qwen3") for p in args.profiles.split(","))
    unknown = [p for p in presets if p not in ("pcie4", "pcie5", "gh200")]
    if unknown:
        parser.error(f"--profiles: expected of pcie4, pcie5, gh200, got {', '.join(unknown)}")
    scenarios = whatif_scenarios(trace, presets=presets)
    try:
        caches = [int(c) for c in args.caches.split(",")]
    except ValueError:
        parser.error(f"--caches: expected comma-separated integers, got {args.caches!r}")
    rows = []
    for label, predictor, price in (("recorded", "recorded", True), ("recorded, no price", "recorded", False),
                                    ("true experts", "oracle", True)):
        prepared = prepare_trace("demo trace", trace, predictor=predictor, acceptance="calibrated")
        # the fixed trees decide nothing with experts: they run once
        policies = POLICIES if label == "recorded" else ["ar", "specfit"]
        _, summary = run_sweep([prepared], policies, caches, scenarios, price_uncertainty=price)
        for r in summary.to_dict("records"):
            if r["policy"] != "ar":
                rows.append({**r, "experts": label if r["policy"] == "specfit" else "(a fixed tree)"})
    table = Table(title="the demo's what-if: tokens/s over ar, with the experts the policies decide with")
    for name in ("profile", "cache", "policy", "decides with", "over ar", "levels/cycle", "nodes/cycle",
                 "tokens/cycle"):
        table.add_column(name, justify="left" if name in ("profile", "policy", "decides with") else "right")
    for r in sorted(rows, key=lambda r: (r["profile"], r["cache_experts"])):
        n = f" (N = {r['static_n']})" if is_tuned(r["policy"]) else ""
        table.add_row(r["profile"], str(r["cache_experts"]), r["policy"] + n, r["experts"], f"{r['speedup_vs_ar']:.3f}",
                      f"{r['draft_levels_per_cycle']:.2f}", f"{r['nodes_per_cycle']:.1f}", f"{r['tokens_per_cycle']:.2f}")
    Console(width=140).print(table)
    if args.sequoia_grid:
        _sequoia_grid(trace, caches, scenarios, rows)
    return rows


def _sequoia_grid(trace, caches: list[int], scenarios, rows: list[dict]) -> None:
    """The fastest ``sequoia:N:D`` of each setting against ``sequoia:auto`` (its size alone tuned)."""
    prepared = prepare_trace("demo trace", trace, predictor="recorded", acceptance="calibrated")
    sizes = [c.total_nodes for c in make_policy("sequoia:auto").candidates(prepared.max_nodes)]
    grid = [f"sequoia:{n}:{d}" for n in sizes for d in range(1, min(n, 9))]
    _, summary = run_sweep([prepared], ["ar", *grid], caches, scenarios)
    table = Table(title="Sequoia's size and depth both tuned: tokens/s over ar")
    for name in ("profile", "cache", "sequoia:auto", "best sequoia:N:D", "over sequoia:auto"):
        table.add_column(name, justify="left" if name == "profile" else "right")
    for (profile, cache), group in summary[summary.policy != "ar"].groupby(["profile", "cache_experts"]):
        best = group.loc[group["speedup_vs_ar"].idxmax()]
        auto = next(r for r in rows if r["policy"] == "sequoia:auto" and (r["profile"], r["cache_experts"]) == (profile, cache))
        table.add_row(profile, str(cache), f"{auto['speedup_vs_ar']:.3f} (N = {auto['static_n']})",
                      f"{best['speedup_vs_ar']:.3f} ({best['policy']})", f"{best['speedup_vs_ar'] / auto['speedup_vs_ar']:.3f}")
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
