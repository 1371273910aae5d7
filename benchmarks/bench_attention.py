"""Benchmark: grouped-query attention reading the KV cache in place (each KV head's ``g`` query
heads side by side against its keys and values, what the target's ``Attention`` and the EAGLE-3
drafter's ``Eagle3Layer.attend`` do) against repeating every cached key and value ``g`` times per
pass (what both did before stop 38), side by side in one process.

- the drafter: one call (a tree level of ``T`` nodes over ``cached`` entries), the whole drafter,
  with the largest difference of its logits; shapes: the bundled drafter (4 query heads, 2 KV
  heads) and an EAGLE-3 head of Qwen3-30B-A3B's width (32 query heads, 4 KV heads, head_dim 128;
  random weights, a 32k vocabulary);
- the target: one attention layer of Qwen3-30B-A3B's shape (the same heads) over ``T`` new tokens
  (a verification pass of ``T`` nodes) after ``cached`` slots, with the largest difference of its
  output.

Each is timed with each attention in alternating rounds (one CPU thread; on a GPU in bfloat16,
synchronised around each timed batch of calls); the table has the median per call and the ratio.

    python benchmarks/bench_attention.py [--rounds 5] [--device cuda] [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specfit.assets import tiny_moe_eagle3_dir  # noqa: E402
from specfit.calibrate.standin import shape_config  # noqa: E402
from specfit.errors import SpecFitError  # noqa: E402
from specfit.runtime.decoder import device_clock  # noqa: E402
from specfit.runtime.devices import resolve_device  # noqa: E402
from specfit.runtime.eagle3 import Eagle3Config, Eagle3Drafter  # noqa: E402
from specfit.runtime.layers import apply_rope  # noqa: E402
from specfit.runtime.model import Attention  # noqa: E402


def repeated_kv_attend(self, q, keys, values, allowed):
    """The attention before stop 38: every cached key and value repeated for each query head."""
    attn = self.self_attn
    keys = keys.repeat_interleave(attn.n_heads // attn.n_kv_heads, dim=-3)
    values = values.repeat_interleave(attn.n_heads // attn.n_kv_heads, dim=-3)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * attn.scale
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return attn.o_proj(torch.matmul(probs, values).transpose(-2, -3).flatten(-2))


def repeated_kv_forward(self, x, cos, sin, cache_len, additive_mask):
    """The target's attention before stop 38 (Qwen3's per-head norms; no clipping): every cached
    key and value repeated for each query head."""
    T = x.shape[0]
    q = self.q_proj(x).view(T, self.n_heads, self.head_dim)
    k = self.k_proj(x).view(T, self.n_kv_heads, self.head_dim)
    v = self.v_proj(x).view(T, self.n_kv_heads, self.head_dim)
    q, k = self.q_norm(q), self.k_norm(k)
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    keys, values = self.kv_cache.write(cache_len, k, v)
    groups = self.n_heads // self.n_kv_heads
    keys = keys[:, None].expand(-1, groups, -1, -1).reshape(self.n_heads, -1, self.head_dim)
    values = values[:, None].expand(-1, groups, -1, -1).reshape(self.n_heads, -1, self.head_dim)
    scores = torch.matmul(q, keys.transpose(1, 2)) * self.scale + additive_mask
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return self.o_proj(torch.matmul(probs, values).transpose(0, 1).reshape(T, self.n_heads * self.head_dim))


def alternate(call, impls, install, rounds: int, number: int, device: torch.device) -> tuple[dict[str, float], float]:
    """Median ms per ``call()`` with each of ``impls`` ({name: implementation}) installed by
    ``install`` in alternating rounds, and the largest difference between their outputs."""
    now = device_clock(device)             # the decoder's clock: after the device's queued work
    times, outputs = {name: [] for name in impls}, {}
    order = list(impls.items())
    for r in range(rounds):
        for name, impl in order if r % 2 == 0 else order[::-1]:
            install(impl)
            outputs[name] = call().float()
            start = now()
            for _ in range(number):
                call()
            times[name].append((now() - start) / number * 1e3)
    first, second = outputs.values()
    return {name: float(np.median(t)) for name, t in times.items()}, float((first - second).abs().max())


def target_rows(rounds: int, gen: torch.Generator, device: torch.device, dtype: torch.dtype,
                quick: bool = False) -> list[dict]:
    """One Qwen3-30B-A3B attention layer (``quick``: the tiny shape's), random weights, over T new
    tokens after ``cached`` slots."""
    config = shape_config("tiny" if quick else "qwen3-30b-a3b", 1)
    attention = Attention(config).to(device=device, dtype=dtype).eval()
    label = "tiny" if quick else "Qwen3-30B-A3B"
    rows = []
    for cached in ((64,) if quick else (512, 2048)):
        attention.kv_cache = attention.make_kv_cache(cached + 64, dtype, device)
        attention.kv_cache.k.copy_(torch.randn(attention.kv_cache.k.shape, generator=gen))
        attention.kv_cache.v.copy_(torch.randn(attention.kv_cache.v.shape, generator=gen))
        for T in (1, 16):
            x = torch.randn(T, config.hidden_size, generator=gen).to(device=device, dtype=dtype)
            cos = torch.ones(T, config.head_dim, device=device, dtype=dtype)
            sin = torch.zeros(T, config.head_dim, device=device, dtype=dtype)
            mask = torch.zeros(T, cached + T, device=device, dtype=dtype)

            def call():
                with torch.inference_mode():
                    return attention(x, cos, sin, cached, mask)

            def install(forward):
                attention.forward = forward.__get__(attention)

            try:
                ms, diff = alternate(call, {"repeated": repeated_kv_forward, "in place": Attention.forward}, install,
                                     rounds, 5 if quick else 50, device)
            finally:
                del attention.forward                       # the class's own again
            rows.append({"model": f"target: {label} attention layer ({config.n_heads} q / {config.n_kv_heads} kv)",
                         "cached": cached, "T": T,
                         "repeated_ms": ms["repeated"], "in_place_ms": ms["in place"], "max_diff": diff})
    return rows


# an EAGLE-3 head of Qwen3-30B-A3B's width (random weights, a 32k draft vocabulary)
QWEN3_WIDTH = dict(hidden_size=2048, target_hidden_size=2048, vocab_size=32000, draft_vocab_size=32000,
                   num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                   aux_hidden_state_layer_ids=(1, 2, 3))


def qwen3_width_drafter(device: torch.device, dtype: torch.dtype) -> Eagle3Drafter:
    drafter = Eagle3Drafter(Eagle3Config(**QWEN3_WIDTH))
    drafter.init_weights(0)
    return drafter.to(device=device, dtype=dtype).eval()


def bundled_drafter(device: torch.device, dtype: torch.dtype) -> Eagle3Drafter:
    """The bundled drafter's shape (4 query / 2 KV heads), random weights."""
    drafter = Eagle3Drafter(Eagle3Config.from_file(tiny_moe_eagle3_dir() / "config.json"))
    drafter.init_weights(0)
    return drafter.to(device=device, dtype=dtype).eval()


def drafters(device: torch.device, dtype: torch.dtype, quick: bool = False) -> dict[str, Eagle3Drafter]:
    out = {"bundled (4 q / 2 kv heads)": bundled_drafter(device, dtype)}
    if not quick:
        out["Qwen3-30B-A3B width (32 q / 4 kv)"] = qwen3_width_drafter(device, dtype)
    return out


def side_by_side_args(description: str, argv: list[str] | None) -> tuple[argparse.Namespace, torch.device, torch.dtype]:
    """``--rounds`` and ``--device`` (float32 on the CPU, one thread; bfloat16 on a GPU)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    parser.add_argument("--quick", action="store_true", help="small shapes and one round: a smoke run (the tests')")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds = 1
    try:
        device = resolve_device(args.device)
    except SpecFitError as exc:
        parser.error(str(exc))
    torch.set_num_threads(1)
    return args, device, torch.bfloat16 if device.type == "cuda" else torch.float32


def fill(drafter: Eagle3Drafter, entries: int, gen: torch.Generator) -> None:
    """``entries`` committed entries in the drafter's cache, 256 per call."""
    drafter.setup_kv_cache(entries + 64)
    width = 3 * drafter.config.target_hidden_size
    for start in range(0, entries, 256):
        n = min(256, entries - start)
        drafter(torch.randn(n, width, generator=gen).to(drafter.device), torch.randint(0, 1000, (n,), generator=gen),
                torch.arange(start, start + n))


def drafter_rows(rounds: int, gen: torch.Generator, device: torch.device, dtype: torch.dtype,
                 quick: bool = False) -> list[dict]:
    rows = []
    for label, drafter in drafters(device, dtype, quick).items():
        layer = type(drafter.midlayer)
        in_place = layer.attend
        small = drafter.config.hidden_size < 1024
        for cached in ((150,) if quick else (150, 512) if small else (512, 2048)):
            fill(drafter, cached, gen)
            for T in (1, 8):
                hidden = torch.randn(T, drafter.config.hidden_size, generator=gen).to(device=device, dtype=dtype)
                ids = torch.randint(0, 1000, (T,), generator=gen)
                positions, mask = torch.full((T,), cached), torch.ones(T, cached + T, dtype=torch.bool)

                def call():
                    return drafter(hidden, ids, positions, mask).logits

                def install(attend):
                    layer.attend = attend

                try:
                    ms, diff = alternate(call, {"repeated": repeated_kv_attend, "in place": in_place}, install,
                                         rounds, 5 if quick else 200 if small or device.type == "cuda" else 10, device)
                finally:
                    layer.attend = in_place
                rows.append({"model": f"drafter: {label}", "cached": cached, "T": T, "repeated_ms": ms["repeated"],
                             "in_place_ms": ms["in place"], "max_diff": diff})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    args, device, dtype = side_by_side_args(__doc__, argv)
    gen = torch.Generator().manual_seed(0)
    rows = (drafter_rows(args.rounds, gen, device, dtype, args.quick)
            + target_rows(args.rounds, gen, device, dtype, args.quick))
    table = Table(title=f"one pass on {device} ({str(dtype).removeprefix('torch.')}), ms (median of alternating "
                        "rounds): the KV cache read in place vs repeated per head")
    for name in ("model", "cached", "T", "repeated", "in place", "ratio", "max |difference|"):
        table.add_column(name, justify="left" if name == "model" else "right")
    for r in rows:
        table.add_row(r["model"], str(r["cached"]), str(r["T"]), f"{r['repeated_ms']:.3f}", f"{r['in_place_ms']:.3f}",
                      f"{r['in_place_ms'] / r['repeated_ms']:.3f}", f"{r['max_diff']:.1e}")
    Console(width=140).print(table)
    return rows


if __name__ == "__main__":
    main()
