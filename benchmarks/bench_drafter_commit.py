"""Benchmark: the EAGLE-3 drafter's pass over committed entries (a cycle's accepted tokens, or the
prompt in the prefill) with the head over the draft vocabulary run for the newest entry alone,
which is the only one whose logits are used (what ``DrafterSession.commit`` asks for since stop 38),
against the head run for every entry, side by side in one process.

An EAGLE-3 head of Qwen3-30B-A3B's width (hidden 2048, 32 query / 4 KV heads, a 32k draft
vocabulary; random weights) commits ``n`` entries after ``cached`` ones; each version is timed in
alternating rounds (one CPU thread; on a GPU in bfloat16, synchronised); the table has the median
per pass, the ratio, and the largest difference of the newest entry's logits.

    python benchmarks/bench_drafter_commit.py [--rounds 5] [--device cuda]
"""

from __future__ import annotations

import argparse
import sys
import timeit
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specfit.errors import SpecFitError  # noqa: E402
from specfit.runtime.devices import resolve_device  # noqa: E402
from specfit.runtime.eagle3 import Eagle3Config, Eagle3Drafter  # noqa: E402


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    args = parser.parse_args(argv)
    try:
        device = resolve_device(args.device)
    except SpecFitError as exc:
        parser.error(str(exc))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    config = Eagle3Config(hidden_size=2048, target_hidden_size=2048, vocab_size=32000, draft_vocab_size=32000,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                          aux_hidden_state_layer_ids=(1, 2, 3))
    drafter = Eagle3Drafter(config)
    drafter.init_weights(0)
    drafter = drafter.to(device=device, dtype=dtype).eval()
    cached = 256
    drafter.setup_kv_cache(cached + 1024)
    table = Table(title=f"a drafter pass over n committed entries after {cached} on {device} "
                        f"({str(dtype).removeprefix('torch.')}), ms (median of alternating rounds)")
    for name in ("n", "every row's logits", "the newest row's", "ratio", "max |logit diff|"):
        table.add_column(name, justify="right")
    rows = []
    for n in (1, 4, 64, 512):
        features = torch.randn(n, 3 * config.target_hidden_size, generator=gen).to(device=device, dtype=dtype)
        ids = torch.randint(0, 1000, (n,), generator=gen)
        positions = torch.arange(cached, cached + n)
        versions = {"every": None, "newest": [-1]}
        times, logits = {name: [] for name in versions}, {}
        number = 3 if n >= 512 and device.type == "cpu" else 20

        def batch(rows_):
            for _ in range(number):
                drafter(features, ids, positions, logits_rows=rows_)
            sync()

        for r in range(args.rounds):
            order = list(versions.items()) if r % 2 == 0 else list(versions.items())[::-1]
            for name, rows_ in order:
                logits[name] = drafter(features, ids, positions, logits_rows=rows_).logits[-1:].float()
                sync()
                times[name].append(timeit.timeit(lambda: batch(rows_), number=1) / number * 1e3)
        every, newest = np.median(times["every"]), np.median(times["newest"])
        diff = float((logits["every"] - logits["newest"]).abs().max())
        rows.append({"n": n, "every_ms": every, "newest_ms": newest, "max_logit_diff": diff})
        table.add_row(str(n), f"{every:.2f}", f"{newest:.2f}", f"{newest / every:.3f}", f"{diff:.1e}")
    Console(width=120).print(table)
    return rows


if __name__ == "__main__":
    main()
