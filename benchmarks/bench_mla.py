"""Benchmark: DeepSeek-V2 multi-head latent attention with ``kv_b_proj`` absorbed into the queries
and the output (what :class:`specfit.runtime.mla.MLAttention` runs for a pass over few queries)
against expanding every cached latent into keys and values on every pass (what it ran for every
pass before stop 39, and still runs for a prompt), side by side in one process.

One MLA layer of DeepSeek-V2-Lite's shape (16 heads, kv_lora_rank 512, 128 + 64 query dims, 128
value dims; random weights) over ``T`` new queries (a decode step, a verification pass of ``T``
nodes) after ``cached`` latents, each form in alternating rounds (one CPU thread; on a GPU in
bfloat16, synchronised around each timed batch of calls); the table has the median per call, the
ratio, the largest difference of the layer's outputs and the form the layer picks by itself (the
expanded one in bfloat16, whose rounding matches ``transformers``').

    python benchmarks/bench_mla.py [--rounds 5] [--device cuda] [--quick]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_attention import alternate, side_by_side_args  # noqa: E402
from specfit.calibrate.standin import shape_config  # noqa: E402
from specfit.runtime.mla import MLAttention  # noqa: E402


def mla_rows(rounds: int, gen: torch.Generator, device: torch.device, dtype: torch.dtype,
             quick: bool = False) -> list[dict]:
    config = shape_config("deepseek-v2-lite", 2)     # (its first layer is dense)
    torch.manual_seed(0)
    attention = MLAttention(config).to(device=device, dtype=dtype).eval()
    for p in attention.parameters():             # weights of a trained layer's scale (default init is far smaller)
        torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)
    rope = config.mla.qk_rope_head_dim
    rows = []
    for cached in ((64,) if quick else (512, 2048)):
        attention.kv_cache = attention.make_kv_cache(cached + 64, dtype, device)
        attention.kv_cache.k.copy_(torch.randn(attention.kv_cache.k.shape, generator=gen))
        attention.kv_cache.v.copy_(torch.randn(attention.kv_cache.v.shape, generator=gen))
        for T in ((1,) if quick else (1, 16, 64)):
            x = torch.randn(T, config.hidden_size, generator=gen).to(device=device, dtype=dtype)
            cos, sin = torch.ones(T, rope, device=device), torch.zeros(T, rope, device=device)
            mask = torch.zeros(T, cached + T, device=device, dtype=dtype)
            picks = "absorbed" if attention._absorbs(T, cached + T) else "expanded"

            def call():
                with torch.inference_mode():
                    return attention(x, cos, sin, cached, mask)

            def install(absorbs):
                attention._absorbs = lambda T, S, a=absorbs: a

            try:
                ms, diff = alternate(call, {"expanded": False, "absorbed": True}, install, rounds,
                                     3 if quick or device.type == "cpu" else 100, device)
            finally:
                del attention._absorbs                      # the class's rule again
            rows.append({"cached": cached, "T": T, "expanded_ms": ms["expanded"], "absorbed_ms": ms["absorbed"],
                         "max_diff": diff, "picks": picks})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    args, device, dtype = side_by_side_args(__doc__, argv)
    rows = mla_rows(args.rounds, torch.Generator().manual_seed(0), device, dtype, args.quick)
    table = Table(title=f"one DeepSeek-V2-Lite MLA layer on {device} ({str(dtype).removeprefix('torch.')}), ms "
                        "(median of alternating rounds): every cached latent expanded vs kv_b_proj absorbed")
    for name in ("cached", "T", "expanded", "absorbed", "ratio", "max |difference|", "the layer picks"):
        table.add_column(name, justify="right")
    for r in rows:
        table.add_row(str(r["cached"]), str(r["T"]), f"{r['expanded_ms']:.3f}", f"{r['absorbed_ms']:.3f}",
                      f"{r['absorbed_ms'] / r['expanded_ms']:.3f}", f"{r['max_diff']:.1e}", r["picks"])
    Console(width=140).print(table)
    return rows


if __name__ == "__main__":
    main()
