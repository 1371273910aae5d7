"""Benchmark: how close any expert predictor could bring SpecFit to itself with true experts on
issue 12's traces, whose experts off the recorded paths a routing model drew.

Three of the traces are imported (``specfit traces import-routing``): they keep the shared OLMoE
log's real routing on the accepted paths and draw every other node's experts from a routing
model calibrated to the log (:class:`specfit.traces.routing.RoutingModel`: each token's preference
list, slot shares, layer popularity, an anchor set). The fourth, ``qwen3-chat``, is synthetic:
the model drew every node's experts. A predictor that knew the model but none of its draws would
name :meth:`~specfit.traces.routing.RoutingModel.likely_experts`. No realistic predictor knows
more; the learned one has to learn the preference lists from the trace. The traces are rebuilt
with their model (and checked equal to those ``bench_policy.py`` reads: the shipped two, and the
shared log's ``general`` and ``coding`` domains, 16 sequences each, ``chat`` drafter, seed 0).

``specfit+cache+prefetch`` is replayed at ``pcie4`` / ``pcie5`` / ``gh200`` and caches of 0 / 25
/ 50 % of a layer (``bench_policy.py``'s 36 settings) with:

- true experts (``specfit``, the denominator of issue 12's goal);
- the learned predictor, cross-fitted as ``bench_policy.py`` does;
- the routing model's likely experts on every node (``model``);
- the model's off the accepted paths and the learned predictor's on them (``model off-path``:
  the better of both on the imported traces, which needs to know which nodes lie on the path).

It prints each predictor's slot precision on and off the accepted paths, tokens/s per setting and
the median over settings of each against true experts. The imported traces need the shared log.

    python benchmarks/bench_routing_bound.py [--traces olmoe-sample,olmoe-general,olmoe-coding,qwen3-chat]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_policy as bp  # noqa: E402
from specfit.calibrate.profile import ModelShape  # noqa: E402
from specfit.experts.calibration import cross_calibrate  # noqa: E402
from specfit.traces.format import read_trace  # noqa: E402
from specfit.traces.importers import import_routing_and_model, model_for_log, read_routing_log  # noqa: E402
from specfit.traces.synth import synthesize_and_model, with_drafter_overrides  # noqa: E402

PREDICTORS = ("learned", "model", "model off-path")


def with_model(name: str, sequences: int):
    """(trace, the routing model that drew its experts) of one of issue 12's traces, or None
    without the shared log."""
    width3 = with_drafter_overrides("chat", width=3, depth=None)
    if name == "qwen3-chat":
        # traces/README.md: specfit traces synth --shape qwen3-30b-a3b --workload chat --tokens 160
        #   --sequence-tokens 80 --tree-width 3 --seed 0
        trace, model = synthesize_and_model("qwen3-30b-a3b", "chat", 160, seed=0, sequence_tokens=80, drafter=width3)
        shipped = bp.ROOT / "traces" / "qwen3-30b-a3b-chat.parquet"
        same = read_trace(shipped)
    elif not bp.SHARED_LOG.is_file():
        return None
    elif name == "olmoe-sample":
        # traces/README.md: specfit traces import-routing LOG --sequences 2 --tree-width 3
        log = read_routing_log(bp.SHARED_LOG)
        first = log.sequence[np.sort(np.unique(log.sequence, return_index=True)[1])][:2]
        log = log.select(np.flatnonzero(np.isin(log.sequence, first)))
        trace, model = import_routing_and_model(log, model_for_log(log, None), workload="chat", drafter=width3, seed=0)
        shipped = bp.ROOT / "traces" / "olmoe-1b-7b-real-routing.parquet"
        same = read_trace(shipped)
    else:
        domain = name.split("-")[1]
        log = bp.domain_log(domain, sequences)
        trace, model = import_routing_and_model(log, model_for_log(log, None), workload="chat", seed=0)
        same = bp._imported(domain, sequences, "chat")       # the trace bench_policy.py replays (its cache)
        shipped = bp.CACHE_DIR / f"olmoe-{domain}-{sequences}-chat.parquet"
    if not (np.array_equal(same.true_experts, trace.true_experts) and np.array_equal(same.token, trace.token)):
        raise SystemExit(f"{name}: the rebuilt trace differs from {shipped}; its routing model is not this one")
    return trace, model


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", default="olmoe-sample,olmoe-general,olmoe-coding,qwen3-chat")
    ap.add_argument("--sequences", type=int, default=16, help="sequences per domain of the shared log")
    ap.add_argument("--profiles", default="pcie4,pcie5,gh200")
    ap.add_argument("--caches", default="0,0.25,0.5", help="cache sizes as shares of a layer's experts")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    overall = {key: [] for key in PREDICTORS}
    for name in args.traces.split(","):
        built = with_model(name, args.sequences)
        if built is None:
            print(f"\n# {name}: {bp.SHARED_LOG} absent, skipped")
            continue
        trace, router = built
        preps = bp.prepare_all(name, trace, {"oracle", "learned"})
        on = bp.on_path_nodes(preps["oracle"])
        learned = bp._experts(preps["learned"], trace)
        model = router.likely_experts(trace.token).astype(trace.true_experts.dtype)
        experts = {"learned": learned, "model": model, "model off-path": np.where(on[:, None, None], learned, model)}
        probs = cross_calibrate(trace)
        for key in ("model", "model off-path"):
            preps[key] = bp.prepare(name, trace, experts[key], probs, predictor=key)
        quality = bp.predictor_quality({key: preps[key] for key in ("oracle", *experts)}, trace)
        drawn = "every node drawn" if trace.meta["recording"]["kind"] == "synthetic" else \
            "real routing on the accepted paths, the other nodes drawn"
        print(f"\n### {name}: {trace.n_cycles} positions, {trace.n_nodes} nodes, {int(on.sum())} on the accepted paths "
              f"({drawn})\n")
        print("| predictor | slot precision | on the accepted paths | off them |")
        print("|---|---:|---:|---:|")
        for key in PREDICTORS:
            q = quality[key]
            print(f"| {key} | {q['slot_precision']:.3f} | {q['on_path_precision']:.3f} | {q['off_path_precision']:.3f} |")
        shape = ModelShape.from_trace_meta(trace.model)
        mine = {key: [] for key in PREDICTORS}
        print("\n| profile | cache | specfit (true experts) | " + " | ".join(PREDICTORS)
              + " | " + " | ".join(f"{key} / true" for key in PREDICTORS) + " |")
        print("|---|---:|---:|" + "---:|" * (2 * len(PREDICTORS)))
        for profile in args.profiles.split(","):
            cost = bp.profile_cost(profile, trace, shape)
            for share in (float(s) for s in args.caches.split(",")):
                capacity = int(round(share * trace.n_experts))
                true = bp.rate(bp.run(preps["oracle"], bp.make_policy(bp.ALL), capacity, cost))
                rates = [bp.rate(bp.run(preps[key], bp.make_policy(bp.ALL), capacity, cost)) for key in PREDICTORS]
                for key, r in zip(PREDICTORS, rates):
                    overall[key].append(r / true)
                    mine[key].append(r / true)
                print(f"| {profile} | {capacity} | {true:.2f} | " + " | ".join(f"{r:.2f}" for r in rates) + " | "
                      + " | ".join(f"{r / true:.3f}" for r in rates) + " |")
        print(f"\n{name}, / true experts: " + "; ".join(f"{label} median {np.median(v):.3f}" for label, v in mine.items()))
    bp.some_measured(overall["learned"])
    print(f"\nOver the {len(overall['learned'])} settings, / true experts: " + "; ".join(
        f"{label} median {np.median(v):.3f} ({min(v):.3f}-{max(v):.3f})" for label, v in overall.items()))
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
