"""Benchmark: how close any expert predictor could bring SpecFit to itself with true experts on the
imported real-routing traces, whose off-path nodes' experts the importer draws.

An imported trace (``specfit traces import-routing``) keeps the log's real routing on the
accepted paths and draws every other node's experts from a routing model calibrated to the log
(:class:`specfit.traces.routing.RoutingModel`: each token's preference list, slot shares, layer
popularity, an anchor set). A predictor that knew that model but none of its draws would name
:meth:`~specfit.traces.routing.RoutingModel.likely_experts`. No realistic predictor knows more;
the learned one has to learn the preference lists from the trace. This bench replays
``specfit+cache+prefetch`` on the shared OLMoE log's two domains (``bench_policy.py``'s
``olmoe-general`` and ``olmoe-coding``: 16 sequences, the ``chat`` drafter preset, seed 0, so the
same traces) at ``pcie4`` / ``pcie5`` / ``gh200`` and caches of 0 / 25 / 50 % of a layer, with:

- true experts (``specfit``, the denominator of issue 12's goal);
- the learned predictor, cross-fitted as ``bench_policy.py`` does;
- the routing model's likely experts on every node (``model``);
- the model's on the drawn (off-path) nodes and the learned predictor's on the recorded ones
  (``model off-path``: the best of both, which needs to know which nodes lie on the path).

It prints each predictor's slot precision on and off the accepted paths, tokens/s per setting and
the median over settings of each against true experts. Skipped without the shared log.

    python benchmarks/bench_routing_bound.py [--sequences 16]
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
from specfit.experts.predictors import slots_right  # noqa: E402
from specfit.traces.importers import import_routing_and_model, model_for_log  # noqa: E402

ROWS = (("learned", "learned"), ("model", "model"), ("model off-path", "model off-path"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=16, help="sequences per domain of the shared log")
    ap.add_argument("--profiles", default="pcie4,pcie5,gh200")
    ap.add_argument("--caches", default="0,0.25,0.5", help="cache sizes as shares of a layer's experts")
    args = ap.parse_args(argv)
    if not bp.SHARED_LOG.is_file():
        print(f"{bp.SHARED_LOG} absent: nothing to measure")
        return
    start = time.perf_counter()
    overall = {label: [] for label, _ in ROWS}
    for domain in ("general", "coding"):
        name = f"olmoe-{domain}"
        log = bp.domain_log(domain, args.sequences)
        trace, router = import_routing_and_model(log, model_for_log(log, None), workload="chat", seed=0)
        preps = bp.prepare_all(name, trace, {"oracle", "learned"})
        on = bp.on_path_nodes(preps["oracle"])
        learned = bp._experts(preps["learned"], trace)
        model = router.likely_experts(trace.token).astype(trace.true_experts.dtype)
        experts = {"learned": learned, "model": model, "model off-path": np.where(on[:, None, None], learned, model)}
        probs = cross_calibrate(trace)
        slots = trace.n_layers * trace.top_k
        print(f"\n### {name}: {trace.n_cycles} positions, {trace.n_nodes} nodes ({int(on.sum())} on the accepted "
              f"paths, real routing; the others drawn by the importer)\n")
        print("| predictor | slot precision | on the accepted paths | off them |")
        print("|---|---:|---:|---:|")
        for label, key in ROWS:
            ex = experts[key]
            right = slots_right(ex, trace.true_experts)
            print(f"| {label} | {right / (trace.n_nodes * slots):.3f} "
                  f"| {slots_right(ex[on], trace.true_experts[on]) / (on.sum() * slots):.3f} "
                  f"| {slots_right(ex[~on], trace.true_experts[~on]) / ((~on).sum() * slots):.3f} |")
            if key != "learned":
                preps[key] = bp.prepare(name, trace, ex, probs, predictor=key,
                                        info={"predicted_slots": int(trace.n_nodes * slots),
                                              "predicted_slots_right": int(right),
                                              "slot_precision": right / (trace.n_nodes * slots)})
        shape = ModelShape.from_trace_meta(trace.model)
        print("\n| profile | cache | specfit (true experts) | " + " | ".join(label for label, _ in ROWS)
              + " | " + " | ".join(f"{label} / true" for label, _ in ROWS) + " |")
        print("|---|---:|---:|" + "---:|" * (2 * len(ROWS)))
        for profile in args.profiles.split(","):
            cost = bp.profile_cost(profile, trace, shape)
            for share in (float(s) for s in args.caches.split(",")):
                capacity = int(round(share * trace.n_experts))
                true = bp.rate(bp.run(preps["oracle"], bp.make_policy(bp.ALL), capacity, cost))
                rates = [bp.rate(bp.run(preps[key], bp.make_policy(bp.ALL), capacity, cost)) for _, key in ROWS]
                for (label, _), r in zip(ROWS, rates):
                    overall[label].append(r / true)
                print(f"| {profile} | {capacity} | {true:.2f} | " + " | ".join(f"{r:.2f}" for r in rates) + " | "
                      + " | ".join(f"{r / true:.3f}" for r in rates) + " |")
    print("\nOver both traces' settings, / true experts: " + "; ".join(
        f"{label} median {np.median(v):.3f} ({min(v):.3f}-{max(v):.3f})" for label, v in overall.items()))
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
