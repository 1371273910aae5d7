"""Benchmark: the EAGLE-3 drafter's pass over committed entries (a cycle's accepted tokens, or the
prompt in the prefill) with the head over the draft vocabulary run for the newest entry alone,
which is the only one whose logits are used (what ``DrafterSession.commit`` asks for since stop 38),
against the head run for every entry, side by side in one process.

An EAGLE-3 head of Qwen3-30B-A3B's width (hidden 2048, 32 query / 4 KV heads, a 32k draft
vocabulary; random weights) commits ``n`` entries after ``cached`` ones; each version is timed in
alternating rounds (one CPU thread; on a GPU in bfloat16, synchronised); the table has the median
per pass, the ratio, and the largest difference of the newest entry's logits.

    python benchmarks/bench_drafter_commit.py [--rounds 5] [--device cuda] [--quick]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_attention import alternate, bundled_drafter, qwen3_width_drafter, side_by_side_args  # noqa: E402


def main(argv: list[str] | None = None) -> list[dict]:
    args, device, dtype = side_by_side_args(__doc__, argv)
    gen = torch.Generator().manual_seed(0)
    drafter = (bundled_drafter if args.quick else qwen3_width_drafter)(device, dtype)
    cached = 32 if args.quick else 256
    drafter.setup_kv_cache(cached + 1024)
    table = Table(title=f"a drafter pass over n committed entries after {cached} on {device} "
                        f"({str(dtype).removeprefix('torch.')}), ms (median of alternating rounds)")
    for name in ("n", "every row's logits", "the newest row's", "ratio", "max |logit diff|"):
        table.add_column(name, justify="right")
    rows = []
    for n in ((1, 4) if args.quick else (1, 4, 64, 512)):
        features = torch.randn(n, 3 * drafter.config.target_hidden_size, generator=gen).to(device=device, dtype=dtype)
        ids = torch.randint(0, 1000, (n,), generator=gen)
        positions = torch.arange(cached, cached + n)
        logits_rows = [None]

        def call():
            return drafter(features, ids, positions, logits_rows=logits_rows[0]).logits[-1:]

        ms, diff = alternate(call, {"every": None, "newest": [-1]}, lambda rows_: logits_rows.__setitem__(0, rows_),
                             args.rounds, 3 if args.quick or n >= 512 and device.type == "cpu" else 20, device)
        rows.append({"n": n, "every_ms": ms["every"], "newest_ms": ms["newest"], "max_logit_diff": diff})
        table.add_row(str(n), f"{ms['every']:.2f}", f"{ms['newest']:.2f}", f"{ms['newest'] / ms['every']:.3f}",
                      f"{diff:.1e}")
    Console(width=120).print(table)
    return rows


if __name__ == "__main__":
    main()
