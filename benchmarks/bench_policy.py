"""Where SpecFit's gap to the oracle goes: an ablation of its levers on real-routing traces.

    python benchmarks/bench_policy.py [--sequences 16] [--traces olmoe-sample,olmoe-general,olmoe-coding,qwen3-chat]
        [--profiles pcie4,pcie5,gh200] [--caches 0,0.25,0.5] [--variants all] [--noisy 0.6,0.8,0.9]
        [--out runs/bench_policy.json]

For every trace x profile x cache size (a share of a layer's experts, LRU per layer) it replays, on
the same trace, cache and cost model: the fixed settings (``ar``, ``chain:1..4``, ``static:auto``),
Sequoia's static tree at its best size (``sequoia:auto``, its acceptance rates fitted on the trace),
``eagle3``, ``oracle`` and SpecFit variants, each a lever on or off or another predictor. It prints
one table per trace and profile (tokens/s and ratios to the best fixed setting), then the median
and minimum over settings of every variant's ratio to the best fixed setting, and SpecFit's to the
best of the fixed settings and ``sequoia:auto``.

Traces: the shipped OLMoE sample (real routing), the shared 25.6k-token OLMoE routing log
(``/work/shared/data/...npz``, skipped when absent) imported per domain (``general``, ``coding``;
the first ``--sequences`` sequences of each, the default ``chat`` drafter preset; imports are cached
under ``benchmarks/.cache/``), the shipped Qwen3-shaped synthetic trace, and any position-indexed
trace given by its ``.parquet`` path (e.g. ``specfit demo``'s ``trace.parquet``, whose every node's
routing is the bundled model's own; ``--profiles pcie4-qwen3,...`` replays it at Qwen3-30B-A3B
expert scale, as the demo's what-if does). Presets are published
link bandwidths, not measurements. Policies decide with the variant's predicted experts and are
charged with the true ones; fitted predictors and the acceptance calibration are cross-fitted (a
fold never sees its own cycles). ``--noisy P,...`` adds SpecFit with the true experts made wrong in
a share ``1 - P`` of the slots (``--predictor noisy:P``): the slot precision a predictor needs for
SpecFit to keep what it gains with true experts.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specfit.calibrate.presets import resolve_profile  # noqa: E402
from specfit.calibrate.profile import ModelShape  # noqa: E402
from specfit.experts.belady import belady_of_log  # noqa: E402
from specfit.experts.cache import ExpertCache  # noqa: E402
from specfit.policies import Observation, SpecFitPolicy, TunedPolicy, make_policy  # noqa: E402
from specfit.experts.calibration import cross_calibrate  # noqa: E402
from specfit.simulate.replay import PreparedTrace, prepare, prepare_trace, replay  # noqa: E402
from specfit.traces.format import read_trace, write_trace  # noqa: E402

SHARED_LOG = Path("/work/shared/data/olmoe-1b-7b-routing-general-coding.npz")
CACHE_DIR = ROOT / "benchmarks" / ".cache"
FIXED = ("ar", "chain:1", "chain:2", "chain:3", "chain:4", "static:auto")
# Sequoia's tree at its best size: reported beside the fixed settings the issue names
SEQUOIA = "sequoia:auto"
BASELINES = FIXED + (SEQUOIA, "eagle3", "oracle")
# the fixed settings with the runtime levers any of them can use (the draft's look-ahead and
# prefetch need a draft: ar gets the recent-use eviction alone)
FIXED_LEVERS = ("ar+usage", "chain:1+cache+prefetch", "chain:2+cache+prefetch", "chain:3+cache+prefetch",
                "chain:4+cache+prefetch", "static:auto+cache+prefetch")
# with a realistic predictor (the best fixed+levers settings above were ar+usage or chain:1-2)
REALISTIC_LEVERS = ("chain:1+cache+prefetch", "chain:2+cache+prefetch")


# --------------------------------------------------------------------------- traces
def load_traces(names: list[str], sequences: int, workload: str) -> list[tuple[str, object]]:
    out = []
    for name in names:
        if name == "olmoe-sample":
            out.append((name, read_trace(ROOT / "traces" / "olmoe-1b-7b-real-routing.parquet")))
        elif name == "qwen3-chat":
            out.append((name, read_trace(ROOT / "traces" / "qwen3-30b-a3b-chat.parquet")))
        elif name in ("olmoe-general", "olmoe-coding"):
            if not SHARED_LOG.is_file():
                print(f"# {name}: {SHARED_LOG} absent, skipped")
                continue
            out.append((name, _imported(name.split("-")[1], sequences, workload)))
        elif name.endswith(".parquet"):
            path = Path(name)
            if not path.is_file():
                raise SystemExit(f"--traces: {path}: no such trace file")
            out.append((path.stem, read_trace(path)))
        else:
            raise SystemExit(f"--traces: unknown trace {name!r}; expected olmoe-sample, olmoe-general, "
                             f"olmoe-coding, qwen3-chat or a trace's .parquet path")
    return out


def some_measured(rows: list) -> list:
    """``rows``, or a one-line exit when there are none: every trace of --traces was skipped."""
    if not rows:
        raise SystemExit(f"nothing measured: every trace of --traces was skipped ({SHARED_LOG} is absent; the "
                         f"lines above name them)")
    return rows


def _imported(domain: str, sequences: int, workload: str):
    """The shared log's first ``sequences`` sequences of ``domain``, imported (cached on disk)."""
    from specfit.traces.importers import import_routing, model_for_log

    path = CACHE_DIR / f"olmoe-{domain}-{sequences}-{workload}.parquet"
    if path.is_file():
        return read_trace(path)
    sub = domain_log(domain, sequences)
    trace = import_routing(sub, model_for_log(sub, None), workload=workload, seed=0)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    write_trace(trace, path)
    return trace


def domain_log(domain: str, sequences: int):
    """The shared log's first ``sequences`` sequences of ``domain`` (a :class:`RoutingLog`)."""
    from specfit.traces.importers import read_routing_log

    log = read_routing_log(SHARED_LOG)
    raw = np.load(SHARED_LOG, allow_pickle=False)
    # read_routing_log orders rows by sequence (first seen) then token index; the domain column
    # must follow the same order
    order = np.lexsort((raw["generated_token_index"], _first_seen(raw["sequence_id"])))
    rows = np.flatnonzero(raw["domain_id"][order] == {"general": 0, "coding": 1}[domain])
    seqs = log.sequence[rows]
    first = seqs[np.sort(np.unique(seqs, return_index=True)[1])][:sequences]
    return log.select(rows[np.isin(seqs, first)])


def _first_seen(seq: np.ndarray) -> np.ndarray:
    _, first, inverse = np.unique(seq, return_index=True, return_inverse=True)
    return np.argsort(np.argsort(first))[inverse]


def profile_cost(profile: str, trace, shape) -> object:
    """The cost model of ``--profiles``' entry: one of the demo's what-if scenarios by its name
    (``PRESET-qwen3``: a small model's trace at Qwen3-30B-A3B expert scale), or a preset or
    profile file at the trace's shape."""
    from specfit.demo import whatif_scenarios

    scenarios = {s.label: s.cost for s in whatif_scenarios(trace)}
    return scenarios[profile] if profile in scenarios else resolve_profile(profile, shape).cost


# --------------------------------------------------------------------------- variants
@dataclass
class Variant:
    """One SpecFit row: the prepared trace it decides with (predictor[/acceptance]) and its spec
    (``make_policy`` grammar, levers included, or a builder for ablation switches), and what the
    bench does around the replay."""

    label: str
    prep: str = "oracle"
    spec: str = "specfit+cache+prefetch+online"
    build: Callable[[], object] | None = None
    belady: bool = False          # recharge its unions with Belady's offline optimum
    decisions: bool = False       # charge SpecFit's own time per decision (--decision-ms)
    note: str = ""

    def policy(self, decision_s: float):
        policy = self.build(decision_s) if self.build is not None else make_policy(self.spec)
        return policy


ALL = "specfit+cache+prefetch"
REALISTIC = ("affinity", "learned", "parent")      # the predictors a live decoder could run


def _paper(decision_s: float = 0.0):
    """SpecFit as before this issue: the optimistic look-ahead, the precision price."""
    return SpecFitPolicy(8, lookahead="optimistic", price_uncertainty="precision")


def _levers(policy, levers=("cache", "prefetch")):
    from specfit.policies import apply_levers

    return apply_levers(policy, list(levers))


def variants() -> dict[str, Variant]:
    v = [
        Variant("paper", build=_paper, note="SpecFit before this issue (optimistic look-ahead, isotonic acceptance)"),
        Variant("paper raw-acceptance", prep="oracle/raw", build=_paper, note="the drafter's own probabilities"),
        Variant("paper known-verdicts", prep="oracle/verdicts", build=_paper,
                note="path probabilities 1 on the accepted path, ~0 elsewhere: the acceptance ceiling"),
        Variant("+expected-stop", spec="specfit", note="the stopping rule weighs the expected next level"),
        Variant("+online", prep="oracle/raw", spec="specfit+online",
                note="the drafter's raw probabilities, calibrated online (no trace to fit on beforehand)"),
        Variant("+cache", spec="specfit+cache", note="evictions by the draft's look-ahead and recent use"),
        Variant("specfit", spec=ALL, note="+cache and copies in the drafted levels' link time: every replay lever"),
        Variant("specfit belady", spec="specfit", belady=True,
                note="+expected-stop's unions under Belady's offline optimum: the eviction ceiling"),
        Variant("specfit decisions charged", spec=ALL, decisions=True,
                note="SpecFit's own time per decision (--decision-ms) charged, not priced"),
        Variant("specfit decisions priced", decisions=True,
                build=lambda d: _levers(SpecFitPolicy(8, overhead_level_s=d)), note="... and priced into its decisions"),
        Variant("specfit observed-price", build=lambda d: _levers(SpecFitPolicy(8, price_uncertainty="observed")),
                note="the uncertainty price from the misses verified draft nodes had beyond their predictions"),
        Variant("paper affinity", prep="affinity", build=_paper),
        Variant("specfit affinity", prep="affinity", spec=ALL),
        Variant("specfit learned", prep="learned", spec=ALL),
        Variant("+expected-stop learned", prep="learned", spec="specfit",
                note="no cache lever, the learned predictor: what prediction costs the selection alone "
                     "(against +expected-stop)"),
        Variant("+cache learned", prep="learned", spec="specfit+cache", note="the look-ahead eviction alone, learned"),
        Variant("+prefetch", spec="specfit+prefetch", note="copies in the drafted levels' link time alone"),
        Variant("+prefetch learned", prep="learned", spec="specfit+prefetch", note="the same, learned"),
        Variant("specfit parent", prep="parent", spec=ALL),
        Variant("specfit learned no-price", prep="learned",
                build=lambda d: _levers(SpecFitPolicy(8, price_uncertainty="none")),
                note="every lever, the learned predictor, no uncertainty price"),
    ]
    return {x.label: x for x in v}


def prepare_all(name: str, trace, keys: set[str]) -> dict[str, PreparedTrace]:
    out = {}
    for key in sorted(keys):
        predictor, _, acceptance = key.partition("/")
        if acceptance == "verdicts":
            base = out.get("oracle") or prepare_trace(name, trace, "oracle")
            out[key] = prepare(name, trace, trace.true_experts, _verdict_probs(trace, base), predictor="oracle")
        else:
            same = next((p for k, p in out.items() if k.partition("/")[0] == predictor), None)
            if same is not None and acceptance != "verdicts":   # the same experts, other path probabilities
                probs = None if acceptance == "raw" else cross_calibrate(trace)
                experts = same.trace.true_experts if predictor == "oracle" else _experts(same, trace)
                out[key] = prepare(name, trace, experts, probs, predictor=predictor, info=dict(same.info))
            else:
                out[key] = prepare_trace(name, trace, predictor, acceptance or "calibrated")
    return out


def _experts(prep: PreparedTrace, trace) -> np.ndarray:
    return prep.predicted_experts.astype(trace.true_experts.dtype)


def _verdict_probs(trace, prep: PreparedTrace) -> np.ndarray:
    """Path probabilities that know the verdicts: 1 on each tree's accepted path, a hair above 0
    elsewhere (the tree needs positive, non-increasing probabilities)."""
    probs = np.full(trace.n_nodes, 1e-9)
    for c in range(prep.n_cycles):
        probs[trace.offsets[c] + prep.accepted_path(c)] = 1.0
    probs[trace.offsets[:-1]] = 1.0
    return probs


# --------------------------------------------------------------------------- runs
def run(prep: PreparedTrace, policy, capacity: int, cost, record_unions: bool = False, mode: str = "per_layer",
        eviction: str = "lru"):
    cache = ExpertCache(prep.trace.n_layers, prep.trace.n_experts, capacity, mode=mode, policy=eviction,
                        expert_bytes=prep.trace.expert_bytes)
    policy.observe(Observation(predicted_slots=prep.info["predicted_slots"],
                               predicted_slots_right=prep.info["predicted_slots_right"],
                               resident_share=cache.capacity_share))
    return replay(prep, policy, cache, cost, record_unions=record_unions)


def rate(log, cost=None, capacity=None, prep=None, decision_s: float = 0.0, mode: str = "per_layer") -> float:
    """Committed tokens per charged second; with ``cost``, the log's unions recharged under
    Belady's offline optimum of a ``mode`` cache of ``capacity``."""
    c = log.columns
    time_s = c["charged_time_s"] + decision_s * (c["draft_levels"] + 1)
    if cost is not None:
        hits, misses = belady_of_log(log, prep.trace.n_layers, prep.trace.n_experts, capacity, mode)
        time_s = cost.predict_counts(c["draft_levels"], c["nodes_verified"], hits, misses)
    return float(c["committed_tokens"].sum() / time_s.sum())


def best_of(prep: PreparedTrace, spec: str, capacity: int, cost, max_nodes: int, mode: str = "per_layer",
            eviction: str = "lru") -> tuple[float, int | None]:
    """(tokens/s, N for static:auto) of a fixed policy; static:auto keeps its best candidate."""
    policy = make_policy(spec)

    def tokens_per_s(candidate) -> float:
        return rate(run(prep, candidate, capacity, cost, mode=mode, eviction=eviction))

    if isinstance(policy, TunedPolicy):
        return max((tokens_per_s(cand), cand.total_nodes) for cand in policy.candidates(max_nodes))
    return tokens_per_s(policy), None


def run_setting(preps: dict[str, PreparedTrace], chosen: list[Variant], capacity: int, cost,
                decision_s: float, static_max_nodes: int = 8) -> dict:
    base = preps["oracle"]
    row: dict = {}
    # static:auto never chose N > 2 on the real-routing traces; candidates up to 8 keep the bench's
    # time there (a trace of long accepted chains, like the demo's, needs more: --static-max-nodes)
    max_nodes = min(static_max_nodes, max(int(t[-1].n_nodes) for t in base.level_trees))
    for spec in BASELINES + FIXED_LEVERS:
        row[spec], n = best_of(base, spec, capacity, cost, max_nodes)
        if n is not None:
            row[f"{spec} N"] = n
    row["ar belady"] = rate(run(base, make_policy("ar"), capacity, cost, record_unions=True), cost, capacity, base)
    for v in chosen:
        policy = v.policy(decision_s)
        log = run(preps[v.prep], policy, capacity, cost, record_unions=v.belady)
        row[v.label] = rate(log, cost, capacity, base) if v.belady else rate(log, decision_s=decision_s * v.decisions)
        c = log.columns
        row[f"{v.label} nodes"] = float(c["nodes_verified"].mean())
        union, predicted, overlap = (float(c[k].sum()) for k in ("union_size", "predicted_union_size", "union_overlap"))
        row[f"{v.label} union P/R"] = (overlap / predicted if predicted else 1.0, overlap / union if union else 1.0)
        acceptance = getattr(policy, "acceptance", None)
        if acceptance is not None and v.label == "+online":
            row["online reliability"] = acceptance.quality()
    for name, names in (("best fixed", FIXED), ("best fixed+levers", FIXED_LEVERS)):
        best = max(names, key=lambda k: row[k])
        row[name], row[f"{name} name"] = row[best], best + (f" (N={row[best + ' N']})" if best + " N" in row else "")
    # the levers that read predicted experts (the draft's look-ahead, prefetch) with each realistic
    # predictor: the fixed settings a realistic SpecFit row is compared with
    for key in sorted({v.prep.partition("/")[0] for v in chosen} - {"oracle"}):
        if key not in preps:
            continue
        realistic = {spec: best_of(preps[key], spec, capacity, cost, max_nodes)[0] for spec in REALISTIC_LEVERS}
        realistic["ar+usage"] = row["ar+usage"]          # reads no prediction
        best = max(realistic, key=realistic.get)
        row[f"best fixed+levers {key}"], row[f"best fixed+levers {key} name"] = realistic[best], best
    return row


def offline_reliability(trace) -> dict:
    """Brier / ECE of the raw drafter probability and of the calibration (cross-fitted; its path
    probability over the parent's), on every edge whose parent is accepted."""
    from specfit.experts.acceptance_online import reliability
    from specfit.experts.calibration import edge_mask, edge_outcomes

    q, accepted = edge_outcomes(trace)
    cal = cross_calibrate(trace)
    mask = edge_mask(trace)                      # the edges of edge_outcomes, in the same order
    edge_cal = cal[mask] / cal[trace.parent_rows[mask]]
    return {"raw": reliability(q, accepted), "isotonic": reliability(edge_cal, accepted)}


def on_path_nodes(prep: PreparedTrace) -> np.ndarray:
    """bool [nodes]: the nodes of each full tree's accepted path, roots included (in an imported
    log the tokens whose routing was recorded; the importer synthesises the rest)."""
    cycles = np.repeat(np.arange(prep.n_cycles), np.diff(prep.path_offsets))
    on = np.zeros(prep.trace.n_nodes, dtype=bool)
    on[prep.offsets[cycles] + prep.paths] = True
    return on


def predictor_quality(preps: dict[str, PreparedTrace], trace) -> dict:
    """Slot precision of every predictor (over the draft nodes, as the replay's ``slot_precision``
    counts it, and apart on the accepted paths' nodes, roots included, and the others), and the precision / recall of the predicted union of each tree's root and
    first level (the same nodes for every predictor)."""
    from specfit.experts.predictors import slots_right, union_quality

    on = on_path_nodes(preps["oracle"]) & trace.true_known
    off = ~on & trace.true_known
    slots = trace.n_layers * trace.top_k
    out = {}
    for key, prep in preps.items():
        predictor = key.partition("/")[0]
        if predictor in out:
            continue
        totals = np.zeros(3)
        for c in range(0, prep.n_cycles, 4):
            lo = int(prep.offsets[c])
            first = lo + int(prep.level_sizes[prep.level_offsets[c] + min(1, prep.depth(c))])
            totals += union_quality(prep.predicted_experts[lo:first], prep.true_experts[lo:first], trace.n_experts)
        on_off = [slots_right(prep.predicted_experts[m], prep.true_experts[m]) / max(int(m.sum()) * slots, 1)
                  for m in (on, off)]
        out[predictor] = {"slot_precision": prep.info["slot_precision"], "on_path_precision": on_off[0],
                          "off_path_precision": on_off[1],
                          "union_precision": totals[2] / totals[0], "union_recall": totals[2] / totals[1]}
    return out


# --------------------------------------------------------------------------- tables
def print_setting_table(trace: str, profile: str, rows: list[dict], labels: list[str], preds=REALISTIC) -> None:
    print(f"\n#### {trace} - {profile}\n")
    head = ["cache", "ar", "chain:1", "static:auto", SEQUOIA, "eagle3", "oracle", "best fixed", "best fixed+levers", "specfit",
            "specfit / best", "specfit / best+levers", "specfit / oracle", "Belady: specfit / best"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---:|" * len(head))
    for r in rows:
        cells = [str(r["cache"])] + [f"{r[k]:.2f}" for k in ("ar", "chain:1")]
        cells += [f"{r[k]:.2f} (N={r[k + ' N']})" for k in ("static:auto", SEQUOIA)]
        cells += [f"{r['eagle3']:.2f}", f"{r['oracle']:.2f}",
                  f"{r['best fixed name']} {r['best fixed']:.2f}", f"{r['best fixed+levers name']} {r['best fixed+levers']:.2f}",
                  f"{r['specfit']:.2f}", f"{r['specfit'] / r['best fixed']:.3f}",
                  f"{r['specfit'] / r['best fixed+levers']:.3f}", f"{r['specfit'] / r['oracle']:.3f}",
                  f"{r['specfit belady'] / r['best fixed']:.3f}"]
        print("| " + " | ".join(cells) + " |")
    print("\nVariants / best fixed setting (nodes verified per cycle):\n")
    print("| variant | " + " | ".join(f"cache {r['cache']}" for r in rows) + " |")
    print("|---|" + "---:|" * len(rows))
    for label in labels + list(FIXED_LEVERS):
        cells = [f"{r[label] / r['best fixed']:.3f}" + (f" ({r[label + ' nodes']:.2f})" if label + " nodes" in r else "")
                 for r in rows]
        print(f"| {label} | " + " | ".join(cells) + " |")
    for pred in preds:
        if f"best fixed+levers {pred}" in rows[0]:
            cells = [f"{r[f'best fixed+levers {pred}'] / r['best fixed']:.3f} ({r[f'best fixed+levers {pred} name']})"
                     for r in rows]
            print(f"| best fixed+levers, {pred} experts | " + " | ".join(cells) + " |")


def print_overall(all_rows: list[dict], labels: list[str], preds=REALISTIC) -> None:
    print("\n### Over all settings (trace x profile x cache)\n")
    print("| variant | / best fixed: median | min | max | below 0.98 | / best fixed+levers: median | min |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label in labels + ["oracle", "eagle3", SEQUOIA, "ar belady"] + list(FIXED_LEVERS):
        ratios = np.array([r[label] / r["best fixed"] for r in all_rows])
        lev = np.array([r[label] / r["best fixed+levers"] for r in all_rows])
        print(f"| {label} | {np.median(ratios):.3f} | {ratios.min():.3f} | {ratios.max():.3f} | "
              f"{int((ratios < 0.98).sum())} of {ratios.size} | {np.median(lev):.3f} | {lev.min():.3f} |")
    for name in ("best fixed", "best fixed+levers"):
        names = [r[f"{name} name"].split(" ")[0] for r in all_rows]
        print(f"\n{name}: " + ", ".join(f"{n} in {names.count(n)}" for n in sorted(set(names))))
    sf = np.array([r["specfit"] / r["oracle"] for r in all_rows])
    print(f"specfit / oracle: median {np.median(sf):.3f}, range {sf.min():.3f}-{sf.max():.3f}")
    # Sequoia's tree among the fixed settings: what SpecFit keeps against that stronger bar
    with_sequoia = np.array([r["specfit"] / max(r["best fixed"], r[SEQUOIA]) for r in all_rows])
    ahead = sum(r[SEQUOIA] > r["best fixed"] for r in all_rows)
    print(f"specfit / best of the fixed settings and {SEQUOIA}: median {np.median(with_sequoia):.3f}, min "
          f"{with_sequoia.min():.3f}, below 0.98 in {int((with_sequoia < 0.98).sum())} of {with_sequoia.size} "
          f"({SEQUOIA} above the best fixed setting in {ahead})")
    for pred in preds:
        label = f"specfit {pred}"
        if label in all_rows[0]:
            own = np.array([r[label] / r["specfit"] for r in all_rows])
            fair = np.array([r[label] / r[f"best fixed+levers {pred}"] for r in all_rows])
            names = [r[f"best fixed+levers {pred} name"] for r in all_rows]
            print(f"{label} / specfit (true experts): median {np.median(own):.3f}, min {own.min():.3f}; / best fixed "
                  f"with the same levers and predictor: median {np.median(fair):.3f}, min {fair.min():.3f} ("
                  + ", ".join(f"{n} in {names.count(n)}" for n in sorted(set(names))) + ")")


def print_attribution(all_rows: list[dict]) -> None:
    """Where the learned predictor's loss goes: the selection alone (no cache lever) and the cache
    levers' gain over it, with true and with learned experts, in the settings with a cache."""
    need = ("+expected-stop", "+expected-stop learned", "specfit", "specfit learned")
    if not all(k in all_rows[0] for k in need):
        return
    med = lambda a, b, rows: float(np.median([r[a] / r[b] for r in rows]))     # noqa: E731
    cached = [r for r in all_rows if r["cache"] > 0]
    print(f"\nThe learned predictor's loss: selection alone (+expected-stop learned / +expected-stop) median "
          f"{med('+expected-stop learned', '+expected-stop', all_rows):.3f}; every lever (specfit learned / "
          f"specfit) {med('specfit learned', 'specfit', all_rows):.3f}")
    if not cached:
        return
    print(f"With a cache ({len(cached)} settings): the cache levers gain {med('specfit', '+expected-stop', cached):.3f}x "
          f"with true experts and {med('specfit learned', '+expected-stop learned', cached):.3f}x with learned ones "
          f"(medians)")
    for lever, label in (("the look-ahead eviction", "+cache"), ("prefetch", "+prefetch")):
        if label in cached[0] and f"{label} learned" in cached[0]:
            print(f"  {lever} ({label} / +expected-stop): {med(label, '+expected-stop', cached):.3f}x with true experts, "
                  f"{med(f'{label} learned', '+expected-stop learned', cached):.3f}x with learned ones")


def cache_settings(trace, shares: list[float], modes: list[str]):
    """Yield ``(slots per layer, mode, capacity)`` for each cache size (a share of a layer's
    experts) and mode (``per_layer``; ``global``: the same slots shared by every layer); a size of
    no slots once, in the first mode (every mode is the same without slots)."""
    for share in shares:
        per_layer = int(round(share * trace.n_experts))
        for mode in modes if per_layer else modes[:1]:
            yield per_layer, mode, per_layer if mode == "per_layer" else per_layer * trace.n_layers


def trace_heading(name: str, trace) -> str:
    return (f"\n### {name}: {trace.n_cycles} positions, {len(np.unique(trace.sequence))} sequences, "
            f"{trace.n_layers} layers x {trace.n_experts} experts")


def trace_arguments(doc: str) -> argparse.ArgumentParser:
    """A parser with the traces and profiles options this bench and those built on it share."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", default="olmoe-sample,olmoe-general,olmoe-coding,qwen3-chat")
    ap.add_argument("--sequences", type=int, default=16, help="sequences per domain of the shared log")
    ap.add_argument("--workload", default="chat", help="drafter preset for the imported trees")
    ap.add_argument("--profiles", default="pcie4,pcie5,gh200")
    return ap


def main() -> None:
    ap = trace_arguments(__doc__)
    ap.add_argument("--caches", default="0,0.25,0.5", help="cache sizes as shares of a layer's experts")
    ap.add_argument("--variants", default="all", help="comma-separated variant labels, or all")
    ap.add_argument("--decision-ms", type=float, default=0.45,
                    help="SpecFit's own time per decision for the 'decisions' rows (measured live: RESULTS.md)")
    ap.add_argument("--static-max-nodes", type=int, default=8,
                    help="the largest tree static:auto tries (its best over the sizes up to this)")
    ap.add_argument("--noisy", default="", help="slot precisions P for 'specfit noisy:P' rows (every lever, the "
                    "true experts with each slot wrong with probability 1-P), e.g. 0.6,0.8,0.9,0.95")
    ap.add_argument("--out", default=None, help="write every row as JSON here")
    args = ap.parse_args()

    table = variants()
    asked = [v.strip() for v in args.variants.split(",") if v.strip()] if args.variants != "all" else list(table)
    unknown = [v for v in asked if v not in table]
    if unknown:
        raise SystemExit(f"--variants: unknown {', '.join(map(repr, unknown))}; expected labels among "
                         f"{', '.join(table)} (or all)")
    chosen = [table[v] for v in asked]
    noisy = [f"noisy:{float(p):g}" for p in args.noisy.split(",") if p.strip()]
    chosen += [Variant(f"specfit {key}", prep=key, spec=ALL) for key in noisy]
    preds = list(REALISTIC) + noisy
    for must in ("specfit", "specfit belady"):
        if not any(v.label == must for v in chosen):
            chosen.insert(0, table[must])
    labels = [v.label for v in chosen]
    print("Variants: " + "; ".join(f"`{v.label}`" + (f": {v.note}" if v.note else "") for v in chosen))
    all_rows = []
    start = time.perf_counter()
    for name, trace in load_traces(args.traces.split(","), args.sequences, args.workload):
        shape = ModelShape.from_trace_meta(trace.model)
        print(f"\n### {name}: {trace.n_cycles} positions, {trace.tree_sizes.mean():.0f} nodes/tree, "
              f"{trace.n_layers} layers x {trace.n_experts} experts, top-{trace.top_k}")
        preps = prepare_all(name, trace, {"oracle"} | {v.prep for v in chosen})
        quality = predictor_quality(preps, trace)
        print("\n| predictor | slot precision | on the accepted paths | off them | union precision (root + level 1) "
              "| union recall |")
        print("|---|---:|---:|---:|---:|---:|")
        for pred, q in quality.items():
            print(f"| {pred} | {q['slot_precision']:.3f} | {q['on_path_precision']:.3f} | {q['off_path_precision']:.3f} "
                  f"| {q['union_precision']:.3f} | {q['union_recall']:.3f} |")
        rel = offline_reliability(trace)
        print(f"\nAcceptance, edges of accepted parents: raw Brier {rel['raw']['brier']:.4f} ECE {rel['raw']['ece']:.4f}; "
              f"calibrated (cross-fitted) Brier {rel['isotonic']['brier']:.4f} ECE {rel['isotonic']['ece']:.4f}")
        for profile in args.profiles.split(","):
            cost = profile_cost(profile, trace, shape)
            rows = []
            for share in (float(s) for s in args.caches.split(",")):
                capacity = int(round(share * trace.n_experts))
                row = {"trace": name, "profile": profile, "cache": capacity,
                       **run_setting(preps, chosen, capacity, cost, args.decision_ms / 1e3, args.static_max_nodes)}
                rows.append(row)
            print_setting_table(name, profile, rows, labels, preds)
            online = [r["online reliability"] for r in rows if "online reliability" in r]
            if online:
                print("\nOnline acceptance (+online, prequential, edges revealed in the run): " + "; ".join(
                    f"cache {r['cache']}: Brier {q['brier']:.4f} vs raw {q['raw_brier']:.4f}, ECE {q['ece']:.4f} vs "
                    f"{q['raw_ece']:.4f} ({q['n']} edges)" for r, q in zip(rows, online)))
            all_rows.extend(rows)
            if args.out:            # after every profile: an interrupted run keeps what it measured
                _write(args.out, all_rows)
    print_overall(some_measured(all_rows), labels, preds)
    print_attribution(all_rows)
    print(f"\n({time.perf_counter() - start:.0f} s)")
    if args.out:
        _write(args.out, all_rows)
        print(f"rows written to {args.out}")


def _write(path: str, rows: list[dict]) -> None:
    from specfit.io import write_json_atomic

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(Path(path), rows)


if __name__ == "__main__":
    main()
