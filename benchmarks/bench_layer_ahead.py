"""The layer-ahead prefetch's ceiling on real-routing traces (issue 12's unbuilt lever, measured
before building it).

    python benchmarks/bench_layer_ahead.py [--traces olmoe-sample,olmoe-general,olmoe-coding,qwen3-chat]
        [--profiles pcie4,pcie5,gh200] [--caches 0,0.25,0.5] [--sequences 16] [--out runs/bench_layer_ahead.json]

For every trace x profile x cache it replays `ar`, `chain:1` (with `static:auto` the best fixed
settings of `bench_policy.py`, where static:auto chose N = 2, the same tree as chain:1), `specfit`
with true experts and `specfit` with the learned predictor (both without the cache levers, so the
cache is the plain per-layer LRU the recharge rebuilds), then recharges each replay's recorded
unions with :func:`specfit.experts.layer_ahead.layer_ahead`: the transfer time that copies of the
next layer's experts, made in the idle link time while a layer computes, could hide. Two
prefetchers: the true misses (the ceiling of any next-layer predictor, e.g. the next layer's
router applied to this layer's hidden state, which live passes have and routing logs do not), and
a transition table ``P(e' at l + 1 | e at l)`` that a routing trace can replay, fitted on the other
half of the sequences (cross-fitted); its wasted copies cost time when they run past a window, and
it starts such a copy only when its probability (the mean of the candidate's conditionals over the
layer's union, for any of the cycle's verified tokens) says it pays. Decisions are the replay's: a
policy that priced the overlap might choose other trees. The bench checks that the recount equals each replay's hits, misses and
charged time before it reports anything.

    python benchmarks/bench_layer_ahead.py --pregate

measures, on the bundled model, what the logs cannot: a live predictor's precision (the next
layer's router on this layer's state after its attention) beside the transition table's.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_policy import load_traces, run, some_measured  # noqa: E402
from specfit.calibrate.presets import QWEN3_30B_A3B, resolve_profile  # noqa: E402
from specfit.calibrate.profile import ModelShape  # noqa: E402
from specfit.experts.layer_ahead import CrossFitRankers, TransitionRanker, recount  # noqa: E402
from specfit.io import write_text_atomic  # noqa: E402
from specfit.policies import make_policy  # noqa: E402
from specfit.simulate.replay import prepare_trace  # noqa: E402

# label: (prepared trace's predictor, policy spec)
POLICIES = {"ar": ("oracle", "ar"), "chain:1": ("oracle", "chain:1"), "specfit": ("oracle", "specfit"),
            "specfit learned": ("learned", "specfit")}
FIXED = ("ar", "chain:1")


def recharge(prep, log, capacity: int, cost, rankers: CrossFitRankers) -> dict:
    # the recount is the replay's own cache and cost model (recount checks), or nothing below means anything
    try:
        perfect = recount(prep.trace, log, capacity, cost)
        transition = recount(prep.trace, log, capacity, cost, "transition", rankers)
    except ValueError as exc:
        raise SystemExit(f"{prep.name}: {exc}") from None
    tokens = float(log.columns["committed_tokens"].sum())
    return {"tokens_per_s": tokens / perfect.time_s.sum(),
            "perfect": tokens / perfect.time_with_overlap_s.sum(),
            "transition": tokens / transition.time_with_overlap_s.sum(),
            "transfer_share": float((cost.miss_s - cost.hit_s) * perfect.misses.sum() / perfect.time_s.sum()),
            "transition_precision": transition.precision,
            "transition_of_ceiling": float(transition.hidden_s.sum() / perfect.hidden_s.sum())
            if perfect.hidden_s.sum() else float("nan")}


def pregate_on_bundled_model(max_new_tokens: int = 96) -> list[dict]:
    """What a live pass has and a routing log has not, on the bundled model: each layer's routing
    predicted from the layer before, by the next layer's router on this layer's state after its
    attention (a pre-gate: known when this layer's experts start) and by the transition table
    (fitted on the other half of the prompts). Slot precision per predicted layer: the share of
    the true top-k the predicted top-k names. The tokens are the demo prompts and ``ar``'s greedy
    continuations; one causal pass over each whole sequence routes every position (as decoding did,
    up to rounding)."""
    import torch

    from specfit.assets import demo_prompts_path, tiny_moe_dir
    from specfit.runtime.decode_job import DecodePlan, run_decode
    from specfit.runtime.loader import load_model, load_tokenizer
    from specfit.runtime.model import causal_mask
    from specfit.runtime.prompts import read_prompts
    from specfit.runtime.routers import route

    run = run_decode(DecodePlan(model_dir=tiny_moe_dir(), prompts_path=demo_prompts_path(), policies=["ar"],
                                profile="pcie4", cache_experts=4, max_new_tokens=max_new_tokens, ignore_eos=True,
                                device="cpu"))
    prompts = {r["index"]: r for r in run.records}
    texts = read_prompts(demo_prompts_path(), load_tokenizer(tiny_moe_dir()))
    model = load_model(tiny_moe_dir())
    config = model.config
    states: dict[int, torch.Tensor] = {}
    hooks = [layer.post_attention_layernorm.register_forward_pre_hook(
        lambda module, inputs, i=i: states.__setitem__(i, inputs[0].detach())) for i, layer in enumerate(model.layers)]
    true, pregate, owner = [], [], []
    try:
        with torch.no_grad():
            for index, prompt in enumerate(texts):
                ids = list(prompt.input_ids) + prompts[index]["output_ids"]
                model.setup_kv_cache(len(ids))
                out = model(ids, np.arange(len(ids)), causal_mask(0, len(ids)), logits_rows=[len(ids) - 1])
                moe = [i for i, layer in enumerate(model.layers) if layer.moe is not None]
                guess = [route(model.layers[b].post_attention_layernorm(states[a]), model.layers[b].moe.gate.weight,
                               config)[1].numpy() for a, b in zip(moe[:-1], moe[1:])]
                true.append(out.expert_ids)
                pregate.append(np.stack(guess, axis=1))
                owner.append(np.full(len(ids), index % 2))
    finally:
        for hook in hooks:
            hook.remove()
    true, pregate, owner = np.concatenate(true), np.concatenate(pregate), np.concatenate(owner)
    k = true.shape[2]
    named = (pregate[:, :, :, None] == true[:, 1:, None, :]).any(axis=3).sum(axis=2) / k    # [T, L - 1]
    table = np.zeros_like(named)
    for fold in (0, 1):
        ranker = TransitionRanker(true[owner != fold], config.n_experts)
        rows = np.flatnonzero(owner == fold)
        for t in rows:
            union = np.zeros((true.shape[1], config.n_experts), dtype=bool)
            np.put_along_axis(union, true[t], True, axis=1)
            ids = ranker.rank(0, union)[0][:, :k]
            table[t] = (ids[:, :, None] == true[t, 1:, None, :]).any(axis=2).sum(axis=1) / k
    rows = [{"layer": layer + 1, "pregate": float(named[:, layer].mean()), "transition": float(table[:, layer].mean())}
            for layer in range(named.shape[1])]
    print(f"\nbundled model, {true.shape[0]} positions ({len(texts)} prompts + {max_new_tokens} greedy tokens), "
          f"top-{k} of {config.n_experts}: slot precision of layer l's experts predicted at layer l - 1\n")
    print("| layer | pre-gate (next router, this layer's state) | transition table (cross-fitted) |")
    print("|---:|---:|---:|")
    for r in rows:
        print(f"| {r['layer']} | {r['pregate']:.3f} | {r['transition']:.3f} |")
    print(f"| all | {named.mean():.3f} | {table.mean():.3f} |")
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", default="olmoe-sample,olmoe-general,olmoe-coding,qwen3-chat")
    parser.add_argument("--profiles", default="pcie4,pcie5,gh200")
    parser.add_argument("--caches", default="0,0.25,0.5", help="shares of a layer's experts")
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--dense-per-layer", action="store_true",
                        help="the presets' dense time per layer (5 ms over Qwen3-30B-A3B's 48 layers) times the "
                             "trace's layers, instead of 5 ms whatever the depth: a layer's window, the overlap's "
                             "budget, is then the same on every model")
    parser.add_argument("--out", default=None)
    parser.add_argument("--pregate", action="store_true",
                        help="only: on the bundled model, a pre-gate's and the transition table's precision")
    args = parser.parse_args(argv)
    if args.pregate:
        return pregate_on_bundled_model()
    start = time.perf_counter()
    rows = []
    for name, trace in load_traces(args.traces.split(","), args.sequences, "chat"):
        preps = {key: prepare_trace(name, trace, key) for key in {p for p, _ in POLICIES.values()}}
        rankers = CrossFitRankers(preps["oracle"])
        shape = ModelShape.from_trace_meta(trace.model)
        for profile in args.profiles.split(","):
            cost = resolve_profile(profile, shape).cost
            if args.dense_per_layer:
                cost = cost.replace(base_s=cost.base_s * trace.n_layers / QWEN3_30B_A3B.n_layers)
            for share in (float(x) for x in args.caches.split(",")):
                capacity = int(round(share * trace.n_experts))
                row = {"trace": name, "profile": profile, "cache": capacity}
                for label, (key, spec) in POLICIES.items():
                    log = run(preps[key], make_policy(spec), capacity, cost, record_unions=True)
                    row[label] = recharge(preps[key], log, capacity, cost, rankers)
                rows.append(row)
                print(_line(row), flush=True)
    _summary(some_measured(rows))
    print(f"# {time.perf_counter() - start:.0f} s")
    if args.out:
        write_text_atomic(Path(args.out), json.dumps(rows, indent=1))
    return rows


def _best(row: dict, which: str) -> float:
    return max(row[k][which] for k in FIXED)


def _line(row: dict) -> str:
    s, learned = row["specfit"], row["specfit learned"]
    cells = [row["trace"], row["profile"], str(row["cache"]),
             f"{row['ar']['tokens_per_s']:.2f}", f"{row['ar']['transfer_share']:.0%}",
             f"{row['ar']['perfect'] / row['ar']['tokens_per_s']:.3f}",
             f"{row['ar']['transition'] / row['ar']['tokens_per_s']:.3f}",
             f"{s['tokens_per_s']:.2f}", f"{s['perfect'] / s['tokens_per_s']:.3f}",
             f"{s['transition'] / s['tokens_per_s']:.3f}",
             f"{s['tokens_per_s'] / _best(row, 'tokens_per_s'):.3f}", f"{s['perfect'] / _best(row, 'perfect'):.3f}",
             f"{s['transition'] / _best(row, 'transition'):.3f}",
             f"{learned['tokens_per_s'] / s['tokens_per_s']:.3f}", f"{learned['perfect'] / s['perfect']:.3f}",
             f"{learned['transition'] / s['transition']:.3f}",
             f"{s['transition_precision']:.2f}", f"{s['transition_of_ceiling']:.2f}"]
    return "| " + " | ".join(cells) + " |"


HEADER = ("| trace | profile | cache | ar tok/s | ar transfer share | ar +LA ceiling | ar +LA transition "
          "| specfit tok/s | specfit +LA ceiling | specfit +LA transition | specfit / best fixed | same, both +LA "
          "ceiling | same, both +LA transition | learned / true | same, +LA ceiling | same, +LA transition "
          "| transition precision | transition / ceiling |")


def _summary(rows: list[dict]) -> None:
    print()
    print(HEADER)
    print("|---" * HEADER.count(" | ") + "|---|")
    for row in rows:
        print(_line(row))
    print()
    stats = {
        "ar +LA ceiling": [r["ar"]["perfect"] / r["ar"]["tokens_per_s"] for r in rows],
        "ar +LA transition": [r["ar"]["transition"] / r["ar"]["tokens_per_s"] for r in rows],
        "specfit +LA ceiling": [r["specfit"]["perfect"] / r["specfit"]["tokens_per_s"] for r in rows],
        "specfit +LA transition": [r["specfit"]["transition"] / r["specfit"]["tokens_per_s"] for r in rows],
        "specfit / best fixed": [r["specfit"]["tokens_per_s"] / _best(r, "tokens_per_s") for r in rows],
        "specfit / best fixed, both +LA ceiling": [r["specfit"]["perfect"] / _best(r, "perfect") for r in rows],
        "specfit / best fixed, both +LA transition": [r["specfit"]["transition"] / _best(r, "transition")
                                                       for r in rows],
        "learned / true": [r["specfit learned"]["tokens_per_s"] / r["specfit"]["tokens_per_s"] for r in rows],
        "learned / true, both +LA ceiling": [r["specfit learned"]["perfect"] / r["specfit"]["perfect"] for r in rows],
        "learned / true, both +LA transition": [r["specfit learned"]["transition"] / r["specfit"]["transition"]
                                                for r in rows],
    }
    print(f"| over {len(rows)} settings | median | min | max |")
    print("|---|---:|---:|---:|")
    for label, values in stats.items():
        print(f"| {label} | {np.median(values):.3f} | {min(values):.3f} | {max(values):.3f} |")
    for profile in sorted({r["profile"] for r in rows}):
        sub = [r for r in rows if r["profile"] == profile]
        print(f"# {profile}: ar +LA ceiling median "
              f"{np.median([r['ar']['perfect'] / r['ar']['tokens_per_s'] for r in sub]):.3f}, specfit +LA ceiling "
              f"{np.median([r['specfit']['perfect'] / r['specfit']['tokens_per_s'] for r in sub]):.3f}, "
              f"transition {np.median([r['specfit']['transition'] / r['specfit']['tokens_per_s'] for r in sub]):.3f}")


if __name__ == "__main__":
    main()
