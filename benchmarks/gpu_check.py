"""GPU check: offloaded speculative decoding on a random-weight model with real layer shapes,
predicted vs measured cycle time for AR, EAGLE-3 and SpecFit. One command, a short table.

On CUDA (default shape ``qwen3-30b-a3b``, 4 of its 48 layers; experts in pinned host memory, an
expert cache of ``--cache-experts`` per layer on the GPU):

1. a ``specfit calibrate`` of this model on this machine (H2D sweep, expert compute, verification
   passes at several cache sizes, a draft level; ``--quick``'s grids unless ``--full-calibration``)
   gives the profile;
2. a random EAGLE-3 drafter of the target's width drafts for ``ar``, ``eagle3`` (60 nodes, 7
   levels), ``static:auto`` and ``specfit`` (``--policies``) over a few random prompts; every cycle's measured time is compared with
   the profile's prediction for exactly what was verified (the same numbers as ``specfit decode``).

A random drafter is almost never accepted, so tokens per cycle are ~1 and SpecFit verifies the
root alone; what this checks is the runtime (pinned copies on the copy stream, the cache, tree
verification of 60 nodes) and the cost model on real shapes. What a run records (printed, and
with ``--out`` written as JSON): pinned host bytes next to the experts' bytes; device memory held
by the expert cache and the peak during calibration; the profile's H2D bandwidth (pinned and
pageable), hit and miss costs and held-out error; per policy the measured and predicted cycle
time, the exposed transfer stall per cycle next to the transfer the profile predicts for those
misses, bytes moved, the rate the decode's copies ran at (bytes over the copy stream's busy spans)
against the probe's pinned bandwidth, and the hit rate; with ``--out``, every cycle's row too.
It also runs on the CPU with small shapes, so CI keeps it working:

    python benchmarks/gpu_check.py                         # CUDA: qwen3-30b-a3b, 4 layers
    python benchmarks/gpu_check.py --device cuda:1 --out gpu_check.json --profile-out profile.json
    python benchmarks/gpu_check.py --device cpu --shape tiny --layers 2 --new-tokens 8
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_first_use import drafter_first_use  # noqa: E402

from specfit.calibrate.calibrate_job import CalibrationPlan, calibrate  # noqa: E402
from specfit.errors import SpecFitError  # noqa: E402
from specfit.io import write_json_atomic  # noqa: E402
from specfit.calibrate.standin import random_drafter, random_model, shape_config  # noqa: E402
from specfit.policies import SequoiaPolicy, TunedPolicy, make_policy  # noqa: E402
from specfit.runtime.config import DTYPES  # noqa: E402
from specfit.accounting import live_row  # noqa: E402
from specfit.runtime.decode_job import summarise_policy  # noqa: E402
from specfit.runtime.decoder import Decoder  # noqa: E402
from specfit.runtime.devices import resolve_device  # noqa: E402
from specfit.runtime.drafting import Proposer  # noqa: E402
from specfit.runtime.run_dir import DecodeOutputs  # noqa: E402

POLICIES = ("ar", "eagle3", "static:auto", "specfit")
# the per-cycle columns --out keeps (the schema's per-layer lists are left out)
CYCLE_FIELDS = ("nodes_verified", "committed_tokens", "time_s", "predicted_time_s", "prior_predicted_time_s",
                "charged_time_s", "union_size", "predicted_union_size", "hits", "misses", "bytes_h2d",
                "transfer_time_s", "verify_time_s", "draft_time_s", "search_time_s")


class CopyMeter:
    """What the decode's host-to-device copies ran at, as an ``on_cycle`` callback: each cycle's
    verification pass, its copy bursts' spans on the copy stream (host dispatch gaps inside a burst
    included, so the rate is a lower bound) and the bytes it moved."""

    def __init__(self, offload):
        self.offload = offload
        self.reset()

    def __call__(self, stats, tokens: int) -> None:
        self.busy_s += self.offload.last_timing.copy_busy_s        # the pass's timing, read by the decoder
        self.bytes += int(stats.verification.offload.total_bytes_h2d)
        # a prefetching policy's copies while it drafted, and how long the pass then waited for them
        draft = stats.draft
        self.prefetched += draft.prefetched
        self.prefetch_copy_s += draft.prefetch_copy_s
        self.prefetch_wait_s += draft.prefetch_wait_s

    def reset(self) -> None:
        self.busy_s, self.bytes = 0.0, 0
        self.prefetched, self.prefetch_copy_s, self.prefetch_wait_s = 0, 0.0, 0.0

    @property
    def gbps(self) -> float:
        return self.bytes / self.busy_s / 1e9 if self.busy_s > 0 else float("nan")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument("--shape", default=None, help="qwen3-30b-a3b (CUDA default), olmoe-1b-7b, mixtral-8x7b, tiny (CPU default)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--cache-experts", type=int, default=None, help="per layer (default: a quarter of the experts)")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--tree-top-k", type=int, default=8)
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated policy specs")
    parser.add_argument("--full-calibration", action="store_true",
                        help="calibrate with specfit calibrate's full probe grids (default: --quick's)")
    parser.add_argument("--out", default=None, help="also write what was measured, every cycle too, to this JSON file")
    parser.add_argument("--profile-out", default=None, help="also save the calibrated profile to this JSON file")
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="also keep the cycles as `specfit decode --out` does (cycles.parquet, decode.jsonl, "
                             "summary.json) with profile.json, for benchmarks/bench_online.py")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        device = resolve_device(args.device)
    except SpecFitError as exc:
        parser.error(str(exc))
    shape = args.shape or ("qwen3-30b-a3b" if device.type == "cuda" else "tiny")
    dtype = DTYPES["bfloat16" if device.type == "cuda" else "float32"]
    try:
        policies = [make_policy(spec) for spec in args.policies.split(",")]
    except ValueError as exc:
        parser.error(f"--policies: {exc}")
    for policy in policies:
        # Sequoia's tree needs positional acceptance rates, which `specfit decode --acceptance` fits
        # from a recording and this check has none of (sequoia:auto would decode static:2's rerank)
        if isinstance(policy, SequoiaPolicy) or (isinstance(policy, TunedPolicy) and policy.family != "static"):
            parser.error(f"--policies: {policy.name}: needs positional acceptance rates, which only specfit decode "
                         f"--acceptance fits; this check runs ar, chain:K, eagle3[:N[:D]], static:N, static:auto and "
                         f"specfit")
    started = time.perf_counter()
    console = Console(width=120)
    seconds = {}                     # wall time of each phase

    config = shape_config(shape, args.layers)
    cache_experts = config.n_experts // 4 if args.cache_experts is None else args.cache_experts
    model = random_model(config, device, dtype, cache_experts=cache_experts, seed=args.seed)
    host = model.offload.host
    seconds["build"] = time.perf_counter() - started
    console.print(f"{shape}, {config.n_layers} layers x {config.n_experts} experts (top-{config.top_k}), "
                  f"{host.expert_bytes / 1e6:.2f} MB/expert, host experts {host.nbytes / 1e9:.2f} GB, "
                  f"{'pinned ' + format(host.pinned_bytes / 1e9, '.2f') + ' GB' if host.pinned else 'pageable'}, "
                  f"cache {cache_experts}/layer on {device} ({model.offload.device_bytes / 1e9:.2f} GB)")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    phase = time.perf_counter()
    profile = calibrate(CalibrationPlan(shape=shape, layers=args.layers, device=str(device),
                                        quick=not args.full_calibration, seed=args.seed), model=model)
    seconds["calibrate"] = time.perf_counter() - phase
    if args.profile_out:
        profile.save(args.profile_out)
    peak_bytes = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    h2d = profile.fit.get("h2d") or {}
    console.print(f"built in {seconds['build']:.0f} s, calibrated in {seconds['calibrate']:.0f} s: "
                  f"H2D {h2d.get('gbps', float('nan')):.1f} GB/s "
                  f"({'pinned' if device.type == 'cuda' else 'host copy'}), hit {profile.cost.hit_s * 1e6:.1f} us, "
                  f"miss {profile.cost.miss_s * 1e6:.1f} us, held-out cycle error {profile.fit['holdout']['mape']:.0%}"
                  + (f", peak device memory {peak_bytes / 1e9:.2f} GB" if peak_bytes is not None else ""))

    drafter = random_drafter(model, args.draft_vocab, args.seed)
    # a catch-up pass's first use against a repeated one, before any proposer warms the drafter
    # (the decoder's proposer runs each length up to drafting.WARM_LENGTHS once, off the clock)
    rounds = drafter_first_use(drafter, range(1, 25), args.seed)
    first_use = {"lengths": list(range(1, 25)), "first_s": rounds["first"], "again_s": rounds["again"]}
    first, again = sorted(rounds["first"]), sorted(rounds["again"])
    console.print(f"drafter pass over 1-24 entries: first time median {first[12] * 1e3:.2f} ms (max "
                  f"{first[-1] * 1e3:.2f}), again {again[12] * 1e3:.2f} ms (max {again[-1] * 1e3:.2f})")
    generator = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, config.vocab_size, (args.prompt_tokens,), generator=generator).tolist()
               for _ in range(args.prompts)]
    records, cycles, copies, prefetches = [], [], {}, {}
    meter = CopyMeter(model.offload)
    for policy in policies:
        phase = time.perf_counter()
        model.offload.reset()
        proposer = Proposer(drafter, args.tree_top_k) if policy.max_levels else None
        # warm-up (kernels, allocator) with a decoder of its own, so the online refit of the
        # measured decoder starts from the profile, not from the warm-up's cold cycles
        Decoder(model, proposer, policy, profile.cost, seed=args.seed).generate(prompts[0], 4, ignore_eos=True)
        model.offload.reset()
        decoder = Decoder(model, proposer, policy, profile.cost, seed=args.seed)
        meter.reset()
        for index, prompt in enumerate(prompts):
            result = decoder.generate(prompt, args.new_tokens, ignore_eos=True, on_cycle=meter)
            records.append({"policy": policy.name, "index": index, **result.to_dict()})
            cycles.extend({"policy": policy.name, "sequence": index, "position": s.position, "cycle": c,
                           **live_row(s, profile.cost, model.offload.host.expert_bytes)}
                          for c, s in enumerate(result.cycles))
        copies[policy.name] = meter.gbps
        prefetches[policy.name] = (meter.prefetched, meter.prefetch_copy_s, meter.prefetch_wait_s)
        seconds[policy.name] = time.perf_counter() - phase
    summaries = [summarise_policy(p.name, records, cycles) for p in policies]
    probe_gbps = h2d.get("gbps", float("nan"))

    table = Table(title=f"gpu_check on {profile.machine.get('device_name', device)}: measured vs predicted "
                        f"({time.perf_counter() - started:.0f} s in all)")
    for name in ("policy", "nodes", "tokens/cycle", "ms/cycle", "predicted", "time MAPE", "stall ms/cycle",
                 "predicted transfer", "MB H2D/cycle", "H2D GB/s", "of probe", "hit rate"):
        table.add_column(name, justify="left" if name == "policy" else "right")
    transfer_s = max(profile.cost.miss_s - profile.cost.hit_s, 0.0)   # what the profile charges a miss beyond a hit
    for s in summaries:
        rows = [c for c in cycles if c["policy"] == s["policy"]]
        s["stall_s_per_cycle"] = sum(c["transfer_time_s"] for c in rows) / max(len(rows), 1)
        s["predicted_transfer_s_per_cycle"] = transfer_s * sum(c["misses"] for c in rows) / max(len(rows), 1)
        s["h2d_gbps"] = copies[s["policy"]]
        s["h2d_of_probe"] = s["h2d_gbps"] / probe_gbps
        prefetched, copy_s, wait_s = prefetches[s["policy"]]
        s["prefetched_per_cycle"] = prefetched / max(len(rows), 1)
        s["prefetch_copy_s_per_cycle"], s["prefetch_wait_s_per_cycle"] = (t / max(len(rows), 1) for t in (copy_s, wait_s))
        table.add_row(s["policy"], f"{s['nodes_per_cycle']:.1f}", f"{s['tokens_per_cycle']:.2f}",
                      f"{s['time_per_cycle_s'] * 1e3:.2f}", f"{s['predicted_time_per_cycle_s'] * 1e3:.2f}",
                      f"{s['time_mape']:.0%}", f"{s['stall_s_per_cycle'] * 1e3:.2f}",
                      f"{s['predicted_transfer_s_per_cycle'] * 1e3:.2f}", f"{s['bytes_per_cycle'] / 1e6:.1f}",
                      f"{s['h2d_gbps']:.1f}", f"{s['h2d_of_probe']:.0%}", f"{s['hit_rate']:.2f}")
    console.print(table)
    prefetching = {p.name for p in policies if p.prefetcher is not None}
    for s in summaries:
        if s["policy"] in prefetching:      # a line even where it chose to prefetch nothing
            # the copy stream's spans of the prefetches against how long the pass then waited for them
            copy_s, wait_s = s["prefetch_copy_s_per_cycle"], s["prefetch_wait_s_per_cycle"]
            hidden = f" ({1 - wait_s / copy_s:.0%} hidden)" if copy_s > 0 else ""
            console.print(f"{s['policy']}: prefetched {s['prefetched_per_cycle']:.1f} experts/cycle while drafting, "
                          f"their copies {copy_s * 1e3:.2f} ms/cycle, the pass waited {wait_s * 1e3:.2f} ms/cycle for "
                          f"them{hidden}")
    console.print("seconds: " + ", ".join(f"{name} {value:.1f}" for name, value in seconds.items()))
    if args.run_dir is not None:
        outputs = DecodeOutputs(args.run_dir)
        outputs.records, outputs.cycles, outputs.summaries = records, cycles, summaries
        outputs.close()
        profile.save(args.run_dir / "profile.json")
    if args.out:
        write_json_atomic(args.out, {
            "shape": shape, "layers": config.n_layers, "device": str(device), "machine": profile.machine,
            "cache_experts_per_layer": cache_experts, "expert_bytes": host.expert_bytes,
            "host_expert_bytes": host.nbytes, "pinned_bytes": host.pinned_bytes,
            "cache_device_bytes": model.offload.device_bytes, "calibration_peak_device_bytes": peak_bytes,
            "profile": {"cost": profile.cost.to_dict(), "h2d": h2d, "h2d_pageable": profile.fit.get("h2d_pageable"),
                        "holdout": profile.fit["holdout"], "measures": profile.probes.get("measures")},
            "policies": summaries, "seconds": seconds, "drafter_first_use": first_use,
            "cycles": [{"policy": c["policy"], "sequence": c["sequence"], "cycle": c["cycle"],
                        **{name: c[name] for name in CYCLE_FIELDS}} for c in cycles],
        })
    return summaries


if __name__ == "__main__":
    main()
