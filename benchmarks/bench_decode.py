"""Benchmark: speculative decoding on the CPU, several policies in one run, with the same job as
``specfit decode`` (:func:`specfit.runtime.decode_job.run_decode`).

Prints, per policy: decode tokens/s, committed tokens per cycle, cycle time measured and
predicted, bytes copied host-to-"device" per token, and where the cycle time goes: the drafter's
passes, the target's pass, the policy's search, and the bookkeeping around them (expert
prediction, tree and view building, acceptance, KV compaction, learning, the online cost model,
the previous cycle's accounting: the cycles are measured back to back), and the share of the
decode time outside the model passes (the same, wherever a cycle's boundary falls). The goal for
search + bookkeeping is <= 5% of the cycle.

By default it decodes the bundled tiny model and its EAGLE-3 drafter on the demo prompts, each
prompt with every policy in turn, each policy with its own expert cache (``specfit decode
--interleave --cache-per-policy``), after the loop a user runs once per machine and model
(``--no-warmup`` skips it):

1. a warm-up ``specfit decode --interleave`` with ``ar``, ``chain:2`` and ``eagle3:16:4`` (several
   draft depths and tree sizes, each prompt with every policy in turn), recording a full trace
   (``--record-full``);
2. its cycles refit the profile (``specfit calibrate --refit``): the quick calibration's draft
   term comes from a stand-in layer, the refit measures the real drafter and the per-level work;
3. the full trace calibrates the drafter's acceptance probabilities (``--acceptance``).

``--warmup-prompts FILE`` runs the warm-up on other prompts than the measured run's, so that the
acceptance calibration and the refit are held out from the prompts they are judged on;
``--warmup-prompts held-out`` takes 4 prompts per workload of the bundled model's held-out text
that are not among the demo prompts (:func:`held_out_prompts`): a user calibrating on their
workload and then serving new prompts of it.

Without ``--profile`` the starting profile is a quick calibration of this machine. Everything is
written to a temporary directory, nothing to the checkout.

    python benchmarks/bench_decode.py [--policies ar,eagle3,specfit] [--max-new-tokens 64] \\
        [--cache-experts 4] [--cache-policy lru] [--threads 1] [--no-warmup] [--frozen-profile] [--busy 1] [--predictor router] [--router-fixed] \\
        [--repeats 5] [--temperature 0.7]

Cycle-time errors are reported for the model each policy decided with (refitted online on its own
cycles unless ``--frozen-profile``; each prediction made before its cycle ran, so held out by
construction) and for the profile's prediction of the same selections. ``--busy N`` runs N
CPU-bound processes beside the benchmark (a machine with other work on it), killed at the end.

``--temperature T`` samples the measured runs (lossless tree speculative sampling; ``--seed``); the
warm-up stays greedy, since it records the trace the acceptance calibration is fitted on, and
``specfit`` then learns its acceptance online from the sampled outcomes (it runs as
``specfit+online``, see ``specfit decode``).

With ``--repeats N`` every policy is decoded N times, interleaved (the order rotates each round,
each run a fresh load with its own warm-up), and the table reports the median tokens/s with its
range and, per round, the ratio to the best of ``ar`` and ``eagle3`` of that round (median, range):
ratios of runs made side by side, on a machine other work may be loading.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from busy import busy_processes  # noqa: E402
from specfit.assets import demo_prompts_path, tiny_moe_dir, tiny_moe_eagle3_dir  # noqa: E402
from specfit.errors import SpecFitError  # noqa: E402
from specfit.runtime.decode_job import DecodePlan, run_decode  # noqa: E402
from specfit.threads import set_cpu_threads  # noqa: E402


def cycle_breakdown(cycles: list[dict], policy: str) -> dict:
    """Shares of the summed cycle time: drafter passes, target pass, search, the rest."""
    rows = [c for c in cycles if c["policy"] == policy]
    total = sum(c["measured_time_s"] for c in rows)
    drafter = sum(c["drafter_time_s"] for c in rows)
    target = sum(c["target_time_s"] for c in rows)
    search = sum(c["search_time_s"] for c in rows)
    predict = sum(c["predict_time_s"] for c in rows)
    learn = sum(c["learn_time_s"] for c in rows)
    update = sum(c["update_time_s"] for c in rows)
    rest = total - drafter - target - search
    return {"drafter": drafter / total, "target": target / total, "search": search / total,
            "bookkeeping": rest / total, "search_ms_per_cycle": 1e3 * search / len(rows),
            # the bookkeeping split: expert predictions per level, learning after the commit, the
            # online cost model's update at the start, the rest (trees, views, masks, acceptance,
            # KV compaction, timing)
            "predict": predict / total, "learn": learn / total, "update": update / total,
            "other": (rest - predict - learn - update) / total}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=tiny_moe_dir())
    parser.add_argument("--drafter", type=Path, default=tiny_moe_eagle3_dir())
    parser.add_argument("--prompts", type=Path, default=demo_prompts_path())
    parser.add_argument("--warmup-prompts", type=Path, default=None,
                        help="prompts of the warm-up (refit and acceptance calibration; default: --prompts), "
                             "e.g. other prompts than the measured run's, for a held-out calibration; 'held-out': "
                             "4 per workload of the bundled model's held-out text, none of them a demo prompt")
    parser.add_argument("--policies", default="ar,eagle3,specfit")
    parser.add_argument("--cache-experts", type=int, default=4)
    parser.add_argument("--cache-policy", default="lru", help="eviction: lru, lfu, fifo or moe-infinity")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--tree-top-k", type=int, default=4)
    parser.add_argument("--profile", default=None, help="preset or profile JSON (default: a quick calibration)")
    parser.add_argument("--no-warmup", action="store_true", help="no refit, no acceptance calibration")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print the summaries as JSON")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved runs of every policy (medians reported)")
    parser.add_argument("--frozen-profile", action="store_true", help="decide with the profile, no online refit")
    parser.add_argument("--predictor", default="router", help="expert predictor: router, affinity or parent")
    parser.add_argument("--router-fixed", action="store_true", help="router predictor without per-layer context weights")
    parser.add_argument("--busy", type=int, default=0, help="CPU-bound processes to run beside the benchmark")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="the measured runs sample at this temperature (lossless tree speculative sampling); "
                             "the warm-up stays greedy (it records a trace)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed of the measured runs")
    parser.add_argument("--out", type=Path, default=None, help="keep the measured run's files (cycles.parquet, ...) here")
    args = parser.parse_args(argv)
    set_cpu_threads(args.threads)
    try:
        with busy_processes(args.busy):
            run_benchmark(args)
    except SpecFitError as exc:                 # bad input: one line, as the CLI says it
        raise SystemExit(f"bench_decode: {exc}") from None


HELD_OUT = "held-out"


def held_out_prompts(path: Path, measured: Path, per_workload: int = 4, chars: int = 150) -> Path:
    """Writes ``per_workload`` prompts of each workload of the bundled model's held-out text
    (:mod:`specfit.assets.corpus`, which the model was not trained on) that share no opening with a
    prompt of ``measured``, shaped like the demo prompts: a docs text's first ``chars`` characters
    (texts of at least ``chars + 50``), a math problem's question up to its "Answer:"."""
    import random

    from specfit.assets.corpus import HELD_OUT_EVERY, docs_texts, math_problems

    seen = {json.loads(line)["prompt"][:40] for line in measured.read_text().splitlines() if line.strip()}
    texts = docs_texts()
    docs = [t[:chars] for t in texts[::HELD_OUT_EVERY] if len(t) >= chars + 50 and t[:40] not in seen]
    # a stream of its own: neither the training problems' (seed 1234) nor the evaluation's
    questions = [q.split("\nAnswer:")[0] + "\nAnswer:" for q in math_problems(random.Random(1234 + 2_000_003), 64)]
    math = list(dict.fromkeys(q for q in questions if q[:40] not in seen))
    records = [{"prompt": p, "workload": "docs"} for p in docs[:per_workload]]
    records += [{"prompt": p, "workload": "math"} for p in math[:per_workload]]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def run_as_arm(argv: list[str], patches: dict) -> bool:
    """The child side of an A/B benchmark that runs this one in fresh processes (``bench_noise.py``,
    ``bench_router.py``): ``--run-arm ARM -- ARGS`` applies ``patches[ARM]`` (when there is one)
    in this process, then runs :func:`main` with ARGS. False when ``argv`` is not a child's."""
    if argv[:1] != ["--run-arm"]:
        return False
    arm, rest = argv[1], argv[3:]
    if arm in patches:
        patches[arm]()
    main(rest)
    return True


def run_benchmark(args) -> None:
    load_before = os.getloadavg()

    # paths resolved before the chdir below
    held_out = args.warmup_prompts == Path(HELD_OUT)
    for name in ("out", "model", "drafter", "prompts", "warmup_prompts"):
        if getattr(args, name) is not None:
            setattr(args, name, getattr(args, name).resolve())
    if args.profile is not None and Path(args.profile).exists():
        args.profile = str(Path(args.profile).resolve())
    work = Path(tempfile.mkdtemp(prefix="bench_decode."))
    os.chdir(work)     # a quick calibration lands in ./calibrate/ here, not in the checkout
    if held_out:
        args.warmup_prompts = held_out_prompts(work / "warmup-prompts.jsonl", args.prompts)
        print(f"warm-up on {len(args.warmup_prompts.read_text().splitlines())} held-out prompts, none of them measured")

    def plan(policies: list[str], **changes) -> DecodePlan:
        settings = dict(model_dir=args.model, prompts_path=args.prompts, cache_experts=args.cache_experts,
                        cache_policy=args.cache_policy, policies=policies, drafter_dir=args.drafter,
                        max_new_tokens=args.max_new_tokens, device="cpu",
                        tree_top_k=args.tree_top_k, ignore_eos=True, online_refit=not args.frozen_profile,
                        predictor=args.predictor, router_adapt=not args.router_fixed, profile=args.profile)
        return DecodePlan(**{**settings, **changes})

    acceptance = profile = None
    if not args.no_warmup:
        from specfit.calibrate.presets import resolve_profile
        from specfit.calibrate.calibrate_job import refit

        acceptance = work / "full.parquet"
        warm = run_decode(plan(["ar", "chain:2", "eagle3:16:4"], out_dir=work / "warmup", record=acceptance,
                               record_full=True, max_levels=7, interleave=True,
                               prompts_path=args.warmup_prompts or args.prompts))
        start = resolve_profile(warm.profile_path or args.profile)
        refitted, comparison = refit(start, [work / "warmup"])
        profile = str(refitted.save(work / "refit.json"))
        print(f"refit on {comparison['n_cycles']} warm-up cycles: held-out cycle-time error (MAPE) "
              f"{comparison['before']['mape']:.0%} -> {comparison['after']['mape']:.0%}")
    policies = args.policies.split(",")
    if args.repeats > 1:
        repeated(policies, args.repeats, lambda specs: run_decode(plan(specs, acceptance_trace=acceptance,
                                                                        profile=profile or args.profile,
                                                                        temperature=args.temperature, seed=args.seed)),
                 sampled=args.temperature > 0)
        return
    # the prompts in turn, each policy with its own expert cache: a slow phase of the machine slows
    # every policy alike, not the one whose turn it is
    run = run_decode(plan(policies, acceptance_trace=acceptance, profile=profile or args.profile,
                          temperature=args.temperature, seed=args.seed, out_dir=args.out,
                          interleave=len(policies) > 1, cache_per_policy=len(policies) > 1))
    if args.out is not None and profile is not None:
        import shutil

        shutil.copy(profile, args.out / "profile.json")

    rows = []
    for s in run.summaries:
        share = cycle_breakdown(run.cycles, s["policy"])
        # boundary-free: every second of the decode that is not a model pass (search and
        # bookkeeping, wherever a cycle's boundary falls)
        decode_s = sum(r["decode_time_s"] for r in run.records if r["policy"] == s["policy"])
        models_s = sum(c["drafter_time_s"] + c["target_time_s"] for c in run.cycles if c["policy"] == s["policy"])
        share["outside_models"] = 1.0 - models_s / decode_s
        rows.append({**s, **{f"share_{k}": v for k, v in share.items()}, "bytes_h2d_per_token": s["bytes_per_token"]})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    table = Table(title=f"{args.model.name} + {args.drafter.name}, cache {args.cache_experts} experts/layer "
                        f"({args.cache_policy}), "
                        f"{args.max_new_tokens} tokens x {len(run.records) // len(run.summaries)} prompts, "
                        f"{torch.get_num_threads()} thread(s); profile {run.profile_label}")
    for name in ("policy", "tokens/s", "tokens/cycle (pred.)", "ms/cycle (pred.)", "KB H2D/token", "drafter",
                 "target", "search", "bookkeeping"):
        table.add_column(name, justify="left" if name == "policy" else "right")
    for r in rows:
        table.add_row(r["policy"], f"{r['tokens_per_s']:.1f}",
                      f"{r['tokens_per_cycle']:.2f} ({r['predicted_tokens_per_cycle']:.2f})",
                      f"{r['time_per_cycle_s'] * 1e3:.2f} ({r['predicted_time_per_cycle_s'] * 1e3:.2f})",
                      f"{r['bytes_h2d_per_token'] / 1e3:.0f}", f"{r['share_drafter']:.0%}", f"{r['share_target']:.0%}",
                      f"{r['share_search']:.1%}", f"{r['share_bookkeeping']:.1%}")
    console = Console(width=160)
    console.print(table)
    identical = {True: "yes", False: "NO", None: "n/a (sampled)" if args.temperature > 0 else "n/a (one policy)"}[
        run.outputs_identical]
    console.print(f"greedy outputs identical across policies: {identical}; search ms/cycle: "
                  + ", ".join(f"{r['policy']} {r['share_search_ms_per_cycle']:.3f}" for r in rows))
    console.print("bookkeeping = expert predictions + learning after the commit + the cost model's update + the rest: "
                  + ", ".join(f"{r['policy']} {r['share_predict']:.1%} + {r['share_learn']:.1%} + {r['share_update']:.1%} "
                              f"+ {r['share_other']:.1%}"
                              for r in rows))
    console.print("share of the decode time outside the model passes (1 - (drafter + target) / decode time): "
                  + ", ".join(f"{r['policy']} {r['share_outside_models']:.1%}" for r in rows))
    console.print("tokens/s without what SpecFit's machinery costs each policy (expert predictions, learning, the cost "
                  "model's update, the selection; every policy pays them here, a bare baseline would not): "
                  + ", ".join(f"{r['policy']} {bare_tokens_per_s(run.cycles, r['policy']):.1f}" for r in rows))
    model = "the profile (frozen)" if args.frozen_profile else "the online-refitted model"
    console.print(f"cycle-time MAPE (mean |predicted - measured| / measured) of {model}: "
                  + ", ".join(f"{r['policy']} {r['time_mape']:.1%} (median {r['time_median_ape']:.1%})" for r in rows))
    console.print("cycle-time MAPE of the profile's prediction of the same cycles: "
                  + ", ".join(f"{r['policy']} {r['prior_time_mape']:.1%} (median {r['prior_time_median_ape']:.1%})"
                              for r in rows))
    if any(r["waited_cycles"] == r["waited_cycles"] for r in rows):
        console.print("cycles whose thread waited for a CPU over a tenth of the cycle (another process had the core), "
                      "and the cycle-time MAPE over the others: "
                      + ", ".join(f"{r['policy']} {r['waited_cycles']:.0%} ({r['waited_share']:.1%} of the time), "
                                  f"{r['running_time_mape']:.1%}" for r in rows))
    console.print(f"union-size MAPE ({args.predictor} predictor): "
                  + ", ".join(f"{r['policy']} {r['union_mape']:.1%} (per layer {r['union_layer_mape']:.1%})"
                              for r in rows if r["union_mape"] == r["union_mape"]))
    console.print(f"load average before / after: {load_before[0]:.1f} / {os.getloadavg()[0]:.1f} on "
                  f"{os.cpu_count()} cores, {args.busy} CPU-bound process(es) beside it")


def bare_tokens_per_s(cycles: list[dict], policy: str) -> float:
    """``policy``'s committed tokens over its measured cycles' seconds less their predictions,
    learning, cost-model update and selection: an upper bound of the same policy run bare."""
    rows = [c for c in cycles if c["policy"] == policy]
    machinery = sum(c["predict_time_s"] + c["learn_time_s"] + c["update_time_s"] + c["search_time_s"] for c in rows)
    seconds = sum(c["measured_time_s"] for c in rows) - machinery
    return sum(c["committed_tokens"] for c in rows) / seconds if seconds > 0 else float("nan")


def repeated(policies: list[str], repeats: int, decode, sampled: bool = False) -> None:
    """Decode every policy ``repeats`` times, interleaved; print medians and paired ratios
    (``sampled``: the runs sample, their outputs are not compared)."""
    import numpy as np

    rates = {p: [] for p in policies}
    extra = {p: [] for p in policies}
    outputs = None
    identical = True
    for r in range(repeats):
        order = policies[r % len(policies):] + policies[: r % len(policies)]
        for spec in order:
            run = decode([spec])
            summary = run.summaries[0]
            rates[spec].append(summary["tokens_per_s"])
            extra[spec].append(_learned(run, summary))
            got = [rec["output_ids"] for rec in run.records]
            identical &= outputs is None or got == outputs
            outputs = got if outputs is None else outputs
        print(f"round {r + 1}: " + ", ".join(f"{p} {rates[p][-1]:.1f}" for p in policies), flush=True)
    base = [p for p in ("ar", "eagle3") if p in rates]
    best = np.max([rates[p] for p in base], axis=0) if base else None
    print(f"\n| policy | tokens/s median | min-max | / best of {' and '.join(base)} per round: median | min-max | "
          "ms/cycle | tokens/cycle (pred.) | learned |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for p in policies:
        v = np.array(rates[p])
        ratio = v / best if best is not None else np.full(v.size, np.nan)
        last = extra[p][-1]
        print(f"| {p} | {np.median(v):.1f} | {v.min():.1f}-{v.max():.1f} | {np.median(ratio):.3f} | "
              f"{ratio.min():.3f}-{ratio.max():.3f} | {last['ms_per_cycle']:.2f} | {last['tokens_per_cycle']:.2f} "
              f"({last['predicted_tokens_per_cycle']:.2f}) | "
              f"{last['note']} |")
    if sampled:
        print("\noutputs sampled (--temperature): not compared")
    else:
        print(f"\ngreedy outputs identical across every run: {'yes' if identical else 'no'}")


def _learned(run, summary: dict) -> dict:
    """What a run's policy learned (overhead, online acceptance, prefetch overlap), as text."""
    policy = run.policies[0]
    notes = []
    if getattr(policy, "overhead_level_s", 0):
        notes.append(f"overhead {policy.overhead_level_s * 1e3:.2f} ms/decision")
    acceptance = getattr(policy, "acceptance", None)
    if acceptance is not None:
        q = acceptance.quality()
        notes.append(f"online acceptance Brier {q['brier']:.3f} (raw {q['raw_brier']:.3f}), ECE {q['ece']:.3f} "
                     f"(raw {q['raw_ece']:.3f}), {q['n']} edges")
    prefetcher = getattr(policy, "prefetcher", None)
    if prefetcher is not None:
        notes.append(f"prefetch overlap {prefetcher.efficiency_:.2f} (copy {prefetcher.copy_s_ * 1e3:.1f} ms, "
                     f"waited {prefetcher.wait_s_ * 1e3:.1f} ms)")
    return {"ms_per_cycle": summary["time_per_cycle_s"] * 1e3, "tokens_per_cycle": summary["tokens_per_cycle"],
            "predicted_tokens_per_cycle": summary["predicted_tokens_per_cycle"],
            "note": "; ".join(notes)}


if __name__ == "__main__":
    main()
