"""GPU check: offloaded speculative decoding on a random-weight model with real layer shapes,
predicted vs measured cycle time for AR, EAGLE-3 and SpecFit. One command, a short table.

On CUDA (default shape ``qwen3-30b-a3b``, 4 of its 48 layers; experts in pinned host memory, an
expert cache of ``--cache-experts`` per layer on the GPU):

1. a quick ``specfit calibrate`` of this model on this machine (H2D sweep, expert compute,
   verification passes at several cache sizes, a draft level) gives the profile;
2. a random EAGLE-3 drafter of the target's width drafts for ``ar``, ``eagle3`` (60 nodes, 7
   levels) and ``specfit`` over a few random prompts; every cycle's measured time is compared with
   the profile's prediction for exactly what was verified (the same numbers as ``specfit decode``).

A random drafter is almost never accepted, so tokens per cycle are ~1 and SpecFit verifies the
root alone; what this checks is the runtime (pinned copies on the copy stream, the cache, tree
verification of 60 nodes) and the cost model on real shapes. What a run records (printed, and
with ``--out`` written as JSON): pinned host bytes next to the experts' bytes; device memory held
by the expert cache and the peak during calibration; the profile's H2D bandwidth (pinned and
pageable), hit and miss costs and held-out error; per policy the measured and predicted cycle
time, the exposed transfer stall per cycle next to the transfer the profile predicts for those
misses, bytes moved and the hit rate. It also runs on the CPU with small shapes, so CI keeps it
working:

    python benchmarks/gpu_check.py                         # CUDA: qwen3-30b-a3b, 4 layers, < 8 min
    python benchmarks/gpu_check.py --device cuda:1 --out gpu_check.json
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

from specfit.calibrate.calibrate_job import CalibrationPlan, calibrate  # noqa: E402
from specfit.errors import SpecFitError  # noqa: E402
from specfit.io import write_json_atomic  # noqa: E402
from specfit.calibrate.standin import random_model, shape_config  # noqa: E402
from specfit.policies import make_policy  # noqa: E402
from specfit.runtime.config import DTYPES  # noqa: E402
from specfit.runtime.eagle3 import Eagle3Config, Eagle3Drafter  # noqa: E402
from specfit.accounting import live_row  # noqa: E402
from specfit.runtime.decode_job import summarise_policy  # noqa: E402
from specfit.runtime.decoder import Decoder  # noqa: E402
from specfit.runtime.devices import resolve_device  # noqa: E402
from specfit.runtime.drafting import Proposer  # noqa: E402

POLICIES = ("ar", "eagle3", "specfit")


def random_drafter(model, draft_vocab_size: int, seed: int) -> Eagle3Drafter:
    """An EAGLE-3 head shaped like the published ones for this target (its width, heads and
    head_dim, a 32k draft vocabulary), random weights, sharing the target's embedding."""
    c = model.config
    config = Eagle3Config(hidden_size=c.hidden_size, target_hidden_size=c.hidden_size, vocab_size=c.vocab_size,
                          draft_vocab_size=min(draft_vocab_size, c.vocab_size), num_attention_heads=c.n_heads,
                          num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim, intermediate_size=3 * c.hidden_size,
                          aux_hidden_state_layer_ids=tuple(model.capture_layers), dtype=str(model.dtype).removeprefix("torch."))
    drafter = Eagle3Drafter(config, target_embed=model.embed_tokens.weight)
    drafter.init_weights(seed)
    return drafter.to(device=model.device, dtype=model.dtype).eval()


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    parser.add_argument("--out", default=None, help="also write what was measured to this JSON file")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        device = resolve_device(args.device)
    except SpecFitError as exc:
        parser.error(str(exc))
    shape = args.shape or ("qwen3-30b-a3b" if device.type == "cuda" else "tiny")
    dtype = DTYPES["bfloat16" if device.type == "cuda" else "float32"]
    started = time.perf_counter()
    console = Console(width=120)

    config = shape_config(shape, args.layers)
    cache_experts = config.n_experts // 4 if args.cache_experts is None else args.cache_experts
    model = random_model(config, device, dtype, cache_experts=cache_experts, seed=args.seed)
    host = model.offload.host
    console.print(f"{shape}, {config.n_layers} layers x {config.n_experts} experts (top-{config.top_k}), "
                  f"{host.expert_bytes / 1e6:.2f} MB/expert, host experts {host.nbytes / 1e9:.2f} GB, "
                  f"{'pinned ' + format(host.pinned_bytes / 1e9, '.2f') + ' GB' if host.pinned else 'pageable'}, "
                  f"cache {cache_experts}/layer on {device} ({model.offload.device_bytes / 1e9:.2f} GB)")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    profile = calibrate(CalibrationPlan(shape=shape, layers=args.layers, device=str(device), quick=True, seed=args.seed),
                        model=model)
    peak_bytes = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    h2d = profile.fit.get("h2d") or {}
    console.print(f"calibrated in {time.perf_counter() - started:.0f} s: H2D {h2d.get('gbps', float('nan')):.1f} GB/s "
                  f"({'pinned' if device.type == 'cuda' else 'host copy'}), hit {profile.cost.hit_s * 1e6:.1f} us, "
                  f"miss {profile.cost.miss_s * 1e6:.1f} us, held-out cycle error {profile.fit['holdout']['mape']:.0%}"
                  + (f", peak device memory {peak_bytes / 1e9:.2f} GB" if peak_bytes is not None else ""))

    drafter = random_drafter(model, args.draft_vocab, args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, config.vocab_size, (args.prompt_tokens,), generator=generator).tolist()
               for _ in range(args.prompts)]
    records, cycles = [], []
    for spec in POLICIES:
        model.offload.reset()
        policy = make_policy(spec)
        proposer = Proposer(drafter, args.tree_top_k) if policy.max_levels else None
        decoder = Decoder(model, proposer, policy, profile.cost, seed=args.seed)
        decoder.generate(prompts[0], 4, ignore_eos=True)          # warm-up: kernels, allocator
        for index, prompt in enumerate(prompts):
            result = decoder.generate(prompt, args.new_tokens, ignore_eos=True)
            records.append({"policy": policy.name, "index": index, **result.to_dict()})
            cycles.extend({"policy": policy.name, "sequence": index, "cycle": c,
                           **live_row(s, profile.cost, model.offload.host.expert_bytes)}
                          for c, s in enumerate(result.cycles))
    summaries = [summarise_policy(p, records, cycles) for p in POLICIES]

    table = Table(title=f"gpu_check on {profile.machine.get('device_name', device)}: measured vs predicted "
                        f"({time.perf_counter() - started:.0f} s in all)")
    for name in ("policy", "nodes", "tokens/cycle", "ms/cycle", "predicted", "time MAPE", "stall ms/cycle",
                 "predicted transfer", "MB H2D/cycle", "hit rate"):
        table.add_column(name, justify="left" if name == "policy" else "right")
    transfer_s = max(profile.cost.miss_s - profile.cost.hit_s, 0.0)   # what the profile charges a miss beyond a hit
    for s in summaries:
        rows = [c for c in cycles if c["policy"] == s["policy"]]
        s["stall_s_per_cycle"] = sum(c["transfer_time_s"] for c in rows) / max(len(rows), 1)
        s["predicted_transfer_s_per_cycle"] = transfer_s * sum(c["misses"] for c in rows) / max(len(rows), 1)
        table.add_row(s["policy"], f"{s['nodes_per_cycle']:.1f}", f"{s['tokens_per_cycle']:.2f}",
                      f"{s['time_per_cycle_s'] * 1e3:.2f}", f"{s['predicted_time_per_cycle_s'] * 1e3:.2f}",
                      f"{s['time_mape']:.0%}", f"{s['stall_s_per_cycle'] * 1e3:.2f}",
                      f"{s['predicted_transfer_s_per_cycle'] * 1e3:.2f}", f"{s['bytes_per_cycle'] / 1e6:.1f}",
                      f"{s['hit_rate']:.2f}")
    console.print(table)
    if args.out:
        write_json_atomic(args.out, {
            "shape": shape, "layers": config.n_layers, "device": str(device), "machine": profile.machine,
            "cache_experts_per_layer": cache_experts, "expert_bytes": host.expert_bytes,
            "host_expert_bytes": host.nbytes, "pinned_bytes": host.pinned_bytes,
            "cache_device_bytes": model.offload.device_bytes, "calibration_peak_device_bytes": peak_bytes,
            "profile": {"cost": profile.cost.to_dict(), "h2d": h2d, "h2d_pageable": profile.fit.get("h2d_pageable"),
                        "holdout": profile.fit["holdout"], "measures": profile.probes.get("measures")},
            "policies": summaries,
        })
    return summaries


if __name__ == "__main__":
    main()
