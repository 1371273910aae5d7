"""Benchmark: the EAGLE-3 drafter's grouped-query attention reading its KV cache in place (each KV
head's ``g`` query heads side by side, what ``Eagle3Layer.attend`` does) against repeating every
cached key and value ``g`` times per call (what it did before stop 38), side by side in one process.

One drafter call (a tree level of ``T`` nodes over ``S`` cached entries) is timed with each
attention in alternating rounds, one CPU thread; the table has the median per call and the ratio,
and the largest difference of the logits. Shapes: the bundled drafter (4 query heads, 2 KV heads)
and an EAGLE-3 head of Qwen3-30B-A3B's width (32 query heads, 4 KV heads, head_dim 128; random
weights, a 32k vocabulary).

    python benchmarks/bench_drafter_attention.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import sys
import timeit
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specfit.assets import tiny_moe_eagle3_dir  # noqa: E402
from specfit.runtime.eagle3 import Eagle3Config, Eagle3Drafter  # noqa: E402


def repeated_kv_attend(self, q, keys, values, allowed):
    """The attention before stop 38: every cached key and value repeated for each query head."""
    attn = self.self_attn
    keys = keys.repeat_interleave(attn.n_heads // attn.n_kv_heads, dim=-3)
    values = values.repeat_interleave(attn.n_heads // attn.n_kv_heads, dim=-3)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * attn.scale
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return attn.o_proj(torch.matmul(probs, values).transpose(-2, -3).flatten(-2))


def drafters() -> dict[str, Eagle3Drafter]:
    bundled = Eagle3Drafter(Eagle3Config.from_file(tiny_moe_eagle3_dir() / "config.json"))
    bundled.init_weights(0)
    qwen3 = Eagle3Drafter(Eagle3Config(hidden_size=2048, target_hidden_size=2048, vocab_size=32000,
                                       draft_vocab_size=32000, num_attention_heads=32, num_key_value_heads=4,
                                       head_dim=128, intermediate_size=6144, aux_hidden_state_layer_ids=(1, 2, 3)))
    qwen3.init_weights(0)
    return {"bundled (4 q / 2 kv heads)": bundled.eval(), "Qwen3-30B-A3B width (32 q / 4 kv)": qwen3.eval()}


def fill(drafter: Eagle3Drafter, entries: int, gen: torch.Generator) -> None:
    """``entries`` committed entries in the drafter's cache, 256 per call."""
    drafter.setup_kv_cache(entries + 64)
    width = 3 * drafter.config.target_hidden_size
    for start in range(0, entries, 256):
        n = min(256, entries - start)
        drafter(torch.randn(n, width, generator=gen), torch.randint(0, 1000, (n,), generator=gen),
                torch.arange(start, start + n))


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    table = Table(title="one drafter call, ms (median of rounds, alternating): KV read in place vs repeated per head")
    for name in ("drafter", "cached", "T", "repeated", "in place", "ratio", "max |logit diff|"):
        table.add_column(name, justify="left" if name == "drafter" else "right")
    rows = []
    for label, drafter in drafters().items():
        layer = type(drafter.midlayer)
        in_place = layer.attend
        small = drafter.config.hidden_size < 1024
        for cached in ((150, 512) if small else (512, 2048)):
            fill(drafter, cached, gen)
            for T in (1, 8):
                hidden = torch.randn(T, drafter.config.hidden_size, generator=gen)
                ids = torch.randint(0, 1000, (T,), generator=gen)
                positions, mask = torch.full((T,), cached), torch.ones(T, cached + T, dtype=torch.bool)

                def call():
                    return drafter(hidden, ids, positions, mask)

                times, logits = {"repeated": [], "in place": []}, {}
                impls = (("repeated", repeated_kv_attend), ("in place", in_place))
                try:
                    for r in range(args.rounds):
                        for impl, attend in impls if r % 2 == 0 else impls[::-1]:
                            layer.attend = attend
                            logits[impl] = call().logits
                            number = 200 if small else 10
                            times[impl].append(timeit.timeit(call, number=number) / number * 1e3)
                finally:
                    layer.attend = in_place
                old, new = np.median(times["repeated"]), np.median(times["in place"])
                diff = float((logits["repeated"] - logits["in place"]).abs().max())
                rows.append({"drafter": label, "cached": cached, "T": T, "repeated_ms": old, "in_place_ms": new,
                             "max_logit_diff": diff})
                table.add_row(label, str(cached), str(T), f"{old:.3f}", f"{new:.3f}", f"{new / old:.3f}", f"{diff:.1e}")
    Console(width=120).print(table)
    return rows


if __name__ == "__main__":
    main()
