"""SpecFit against MoE-Infinity as a whole: its cache's eviction rule and its activation-aware
prefetcher together, on AR decoding.

    python benchmarks/bench_moe_infinity.py [--traces olmoe-sample,olmoe-general,olmoe-coding,qwen3-chat]
        [--profiles pcie4,pcie5,gh200] [--caches 0,0.25,0.5] [--modes per_layer,global] [--out runs/x.json]

MoE-Infinity decodes autoregressively; what it brings to offloading is its cache
(``--cache-policy moe-infinity``: ``bench_eviction.py``) and its prefetcher: as each layer routes,
it matches the request's expert activation matrix against a collection of past requests' and
copies the best match's experts ahead (:mod:`specfit.experts.eam`). Here the prefetch runs in the
layer-ahead windows of :func:`specfit.experts.layer_ahead.layer_ahead`: layer ``l + 1``'s copies
while layer ``l`` computes, in the link time a pass leaves idle, a wasted copy's overrun charged
(the collection: the other fold's requests, :func:`~specfit.experts.predictors.cycle_folds`).

Per trace, profile, cache size (a share of a layer's experts per layer, ``per_layer``; the same
slots shared by every layer, ``global``, MoE-Infinity's own mode; size 0 once) it replays ``ar``
under LRU and under MoE-Infinity's rule, recharges the latter with three prefetchers (the true
next-layer misses, the ceiling of any; MoE-Infinity's matching; ``bench_layer_ahead.py``'s
transition table, cross-fitted alike), does the same for ``specfit`` without levers, and replays
``specfit+cache+prefetch`` (true experts, acceptance calibrated cross-fitted, as
``bench_policy.py``) under both rules. The recount must give each replay's hits, misses and time
before anything is reported. Two SpecFit configurations face MoE-Infinity, each in every setting:
``specfit+cache+prefetch`` with no layer-ahead windows (its look-ahead eviction and draft-time
prefetch are not recounted: the windows would need its cache's evictions), and ``specfit`` given
MoE-Infinity's cache and the same prefetcher in the same windows.

What is MoE-Infinity here: the design of its paper and the matching of its repository's
``expert_tracer.py`` / ``expert_predictor.py`` (:mod:`specfit.experts.eam` lists what differs: the
queue's order across layers, which this favours it in, the cache's protection of predicted experts,
prompt tokens in a request's matrix, the collection's growth). Its repository's HEAD calls the
prefetcher in two model families only, and the collection of recorded matrices it is given as a
path is not loaded there: this is the prefetcher as designed, not that code's behaviour. On the
two-sequence traces (``olmoe-sample``, ``qwen3-chat``) each fold's collection is one request, so the
matching there is the other request's expert popularity.
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
from specfit.experts.layer_ahead import PREFETCHERS, CrossFitRankers, recount  # noqa: E402
from specfit.policies import make_policy  # noqa: E402
from specfit.simulate.replay import prepare_trace  # noqa: E402

SPECFIT = "specfit+cache+prefetch"


def recharge(rankers: CrossFitRankers, log, capacity: int, mode: str, cost, label: str) -> dict:
    """``log``'s unions recounted under MoE-Infinity's rule with each prefetcher (keys ``LABEL+NAME``;
    the recount checks itself against the replay's hits, misses and time)."""
    try:
        out = {name: recount(rankers.trace, log, capacity, cost, name, rankers, mode, "moe-infinity")
               for name in PREFETCHERS}
    except ValueError as exc:
        raise SystemExit(f"{rankers.prep.name}: {exc}") from None
    tokens = float(log.columns["committed_tokens"].sum())
    base = out["ceiling"]
    row = {label: tokens / base.time_s.sum()}
    row.update({f"{label}+{name}": tokens / la.time_with_overlap_s.sum() for name, la in out.items()})
    hidden = base.hidden_s.sum()
    for name in ("eam", "transition"):
        row[f"{label} {name} precision"] = out[name].precision
        row[f"{label} {name} of ceiling"] = float(out[name].hidden_s.sum() / hidden) if hidden else float("nan")
    return row


def run_setting(rankers: CrossFitRankers, capacity: int, mode: str, cost) -> dict:
    prep = rankers.prep
    row = {"ar lru": bp.rate(bp.run(prep, make_policy("ar"), capacity, cost, mode=mode))}
    # ar and specfit without levers under MoE-Infinity's rule, each recounted with the prefetchers
    for spec in ("ar", "specfit"):
        log = bp.run(prep, make_policy(spec), capacity, cost, record_unions=True, mode=mode, eviction="moe-infinity")
        row.update(recharge(rankers, log, capacity, mode, cost, spec))
    row["moe-infinity"] = row["ar+eam"]
    for eviction in ("lru", "moe-infinity"):
        row[f"{SPECFIT} {eviction}"] = bp.rate(bp.run(prep, make_policy(SPECFIT), capacity, cost, mode=mode,
                                                      eviction=eviction))
    return row


COLUMNS = (("ar lru", "ar (LRU)"), ("ar", "ar, MoE-Inf. cache"),
           ("moe-infinity", "MoE-Infinity (its cache + EAM prefetch)"), ("ar+ceiling", "same, true next-layer misses"),
           ("ar+transition", "same, transition table"), ("specfit", "specfit, MoE-Inf. cache"),
           ("specfit+eam", "same + EAM prefetch"), (f"{SPECFIT} lru", f"{SPECFIT} (LRU)"),
           (f"{SPECFIT} moe-infinity", f"{SPECFIT}, MoE-Inf. cache"))


def print_setting(name: str, profile: str, rows: list[dict]) -> None:
    print(f"\n#### {name}, {profile}: tokens/s\n")
    heads = ["cache", "mode", *(h for _, h in COLUMNS), "EAM precision (ar)", "EAM / ceiling (ar)",
             f"{SPECFIT} / MoE-Infinity", "specfit + EAM / MoE-Infinity"]
    print("| " + " | ".join(heads) + " |")
    print("|" + "---|" * len(heads))
    for r in rows:
        cells = [str(r["cache"]), r["mode"], *(f"{r[k]:.2f}" for k, _ in COLUMNS), f"{r['ar eam precision']:.2f}",
                 f"{r['ar eam of ceiling']:.2f}", f"{r[f'{SPECFIT} lru'] / r['moe-infinity']:.3f}",
                 f"{r['specfit+eam'] / r['moe-infinity']:.3f}"]
        print("| " + " | ".join(cells) + " |")


def _line(label: str, values) -> str:
    v = np.asarray([x for x in values if np.isfinite(x)])
    below = "" if label.startswith("share:") else f"{int((v < 1.0).sum())} of {v.size}"
    return f"| {label} | {np.median(v):.3f} | {v.min():.3f}-{v.max():.3f} | {below} |"


def print_overall(rows: list[dict]) -> None:
    print(f"\n### Over all {len(rows)} settings\n")
    print("| ratio or share | median | range | ratio below 1 |")
    print("|---|---:|---|---:|")
    ratios = {
        "MoE-Infinity (its cache + EAM prefetch) / `ar` (LRU)": [r["moe-infinity"] / r["ar lru"] for r in rows],
        "EAM prefetch alone (`ar`, MoE-Infinity's cache: with / without)": [r["ar+eam"] / r["ar"] for r in rows],
        "true next-layer misses (the ceiling), same": [r["ar+ceiling"] / r["ar"] for r in rows],
        "transition table, same": [r["ar+transition"] / r["ar"] for r in rows],
        "share: the ceiling's hidden time the EAM prefetch hides (`ar`)": [r["ar eam of ceiling"] for r in rows],
        "share: EAM copies of an expert the next layer missed (`ar`)": [r["ar eam precision"] for r in rows],
        "EAM prefetch for `specfit` (its cache: with / without)": [r["specfit+eam"] / r["specfit"] for r in rows],
        f"`{SPECFIT}` (LRU) / MoE-Infinity": [r[f"{SPECFIT} lru"] / r["moe-infinity"] for r in rows],
        f"`{SPECFIT}` (MoE-Infinity's cache) / MoE-Infinity": [r[f"{SPECFIT} moe-infinity"] / r["moe-infinity"]
                                                             for r in rows],
        "`specfit` + EAM prefetch (MoE-Infinity's cache) / MoE-Infinity": [r["specfit+eam"] / r["moe-infinity"]
                                                                          for r in rows],
        "both given the true next-layer misses instead: `specfit` / MoE-Infinity":
            [r["specfit+ceiling"] / r["ar+ceiling"] for r in rows],
        f"`{SPECFIT}` (LRU, no windows) / MoE-Infinity with the true next-layer misses":
            [r[f"{SPECFIT} lru"] / r["ar+ceiling"] for r in rows],
    }
    for label, values in ratios.items():
        print(_line(label, values))


def main(argv: list[str] | None = None) -> list[dict]:
    ap = bp.trace_arguments(__doc__)
    ap.add_argument("--caches", default="0,0.25,0.5", help="cache sizes as shares of a layer's experts")
    ap.add_argument("--modes", default="per_layer,global")
    ap.add_argument("--out", default=None, help="write every row as JSON here")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    try:
        shares = [float(s) for s in args.caches.split(",") if s.strip()]
    except ValueError:
        shares = [-1.0]
    if not modes or any(m not in ("per_layer", "global") for m in modes) or not shares \
            or any(not 0 <= s <= 1 for s in shares):
        raise SystemExit(f"--modes: per_layer and/or global; --caches: shares in [0, 1] (got {args.modes!r}, "
                         f"{args.caches!r})")
    all_rows, start = [], time.perf_counter()
    for name, trace in bp.load_traces(args.traces.split(","), args.sequences, args.workload):
        shape = ModelShape.from_trace_meta(trace.model)
        rankers = CrossFitRankers(prepare_trace(name, trace, "oracle", "calibrated"))
        print(bp.trace_heading(name, trace))
        for profile in args.profiles.split(","):
            cost = bp.profile_cost(profile, trace, shape)
            rows = [{"trace": name, "profile": profile, "cache": per_layer, "mode": mode,
                     **run_setting(rankers, capacity, mode, cost)}
                    for per_layer, mode, capacity in bp.cache_settings(trace, shares, modes)]
            print_setting(name, profile, rows)
            all_rows.extend(rows)
            if args.out:
                bp._write(args.out, all_rows)
    print_overall(bp.some_measured(all_rows))
    print(f"\n({time.perf_counter() - start:.0f} s)")
    return all_rows


if __name__ == "__main__":
    main()
