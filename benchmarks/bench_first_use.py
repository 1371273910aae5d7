"""Benchmark: what a model pass over ``n`` new entries costs the first time a process runs that
``n``, and once more, for the target (a verification pass of ``n`` nodes) and the EAGLE-3 drafter
(a catch-up pass over ``n`` committed entries). On a GPU a shape's first pass can be slower
(kernels picked and loaded for it on first use); SpecFit verifies and catches up a different number
of entries from cycle to cycle, so a cycle that meets a new ``n`` would pay it where the fixed
policies hardly ever do. Prints one row per ``n`` and the medians.

The target is a random-weight stand-in of ``--shape`` with every expert cached on the device
(filled by a long prefill first, so that no pass copies experts); each pass runs ``n`` random
tokens after that prefill, in the same KV slots, with a causal mask; both rounds run the same
tokens (and the drafter the same features), so the same experts run and only the first use differs. With ``--warm N`` a decoder's first
generation runs first with the proposer's warm-up over 1..N entries
(:data:`specfit.runtime.drafting.WARM_LENGTHS` on a GPU by default): the drafter's "first"
round should then cost what "again" does. Results: ``benchmarks/RESULTS.md``, "The GPU run again".

    python benchmarks/bench_first_use.py                          # CUDA: qwen3-30b-a3b, 4 layers
    python benchmarks/bench_first_use.py --warm 40                # the same after the proposer's warm-up
    python benchmarks/bench_first_use.py --device cpu --shape tiny --max-n 8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specfit.calibrate.standin import random_drafter, random_model, shape_config  # noqa: E402
from specfit.errors import SpecFitError  # noqa: E402
from specfit.runtime.config import DTYPES  # noqa: E402
from specfit.runtime.decoder import Decoder, device_clock  # noqa: E402
from specfit.runtime.devices import resolve_device  # noqa: E402
from specfit.runtime.drafting import DrafterSession, Proposer  # noqa: E402
from specfit.runtime.model import causal_mask  # noqa: E402

PREFILL = 256      # tokens: with top-8 of 128 experts every expert of every layer is routed to


def _rounds(run, lengths: range, device: torch.device) -> dict[str, list[float]]:
    """Seconds of ``run(n)`` for every ``n`` of ``lengths``, a round ("first") and once more ("again")."""
    now = device_clock(device)             # the decoder's clock: after the device's queued work

    def timed(n: int) -> float:
        start = now()
        run(n)
        return now() - start

    return {round_: [timed(n) for n in lengths] for round_ in ("first", "again")}


def drafter_first_use(drafter, lengths: range, seed: int = 0) -> dict[str, list[float]]:
    """The drafter's catch-up pass over ``n`` committed entries, per round ("first", "again"): one
    session whose cache grows pass by pass; the same features in both rounds."""
    gen = torch.Generator().manual_seed(seed)
    session = DrafterSession(drafter, 2 * sum(lengths) + 1)
    width = 3 * drafter.config.target_hidden_size
    features = {n: torch.randn(n, width, generator=gen).to(device=drafter.device, dtype=drafter.dtype) for n in lengths}
    return _rounds(lambda n: session.commit(features[n], torch.zeros(n, dtype=torch.long)), lengths, drafter.device)


def target_first_use(model, lengths: range, seed: int = 0) -> dict[str, list[float]]:
    """The target's pass over ``n`` new tokens per round ("first", "again"), after a
    :data:`PREFILL`-token prefill, in the slots after it; the same tokens in both rounds (the same
    routing, so the same experts run)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    model.setup_kv_cache(PREFILL + max(lengths))
    prompt = torch.randint(0, vocab, (PREFILL,), generator=gen)
    model(prompt, torch.arange(PREFILL), causal_mask(0, PREFILL), logits_rows=[-1])
    tokens = {n: torch.randint(0, vocab, (n,), generator=gen) for n in lengths}
    return _rounds(lambda n: model(tokens[n], torch.arange(PREFILL, PREFILL + n), causal_mask(PREFILL, n)),
                   lengths, model.device)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument("--shape", default=None, help="qwen3-30b-a3b (CUDA default), tiny (CPU default), ...")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--max-n", type=int, default=32, help="entries per pass: 1..max-n")
    parser.add_argument("--warm", type=int, default=0, help="run the proposer's warm-up over 1..N entries first")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        device = resolve_device(args.device)
    except SpecFitError as exc:
        parser.error(str(exc))
    if args.max_n < 1:
        parser.error(f"--max-n: expected >= 1, got {args.max_n}")
    shape = args.shape or ("qwen3-30b-a3b" if device.type == "cuda" else "tiny")
    dtype = DTYPES["bfloat16" if device.type == "cuda" else "float32"]
    config = shape_config(shape, args.layers)
    model = random_model(config, device, dtype, cache_experts=config.n_experts, seed=args.seed)
    drafter = random_drafter(model, 32000, args.seed)
    if args.warm:
        from specfit.costmodel import CostModel
        from specfit.policies import make_policy

        # the warm-up a decoder's first generation runs in its prefill
        warm = Decoder(model, Proposer(drafter, 8, warm_lengths=args.warm), make_policy("eagle3"),
                       cost=CostModel(base_s=1e-3, per_node_s=1e-5, hit_s=1e-5, miss_s=1e-4))
        warm.generate([1, 2], 1, ignore_eos=True)
    lengths = range(1, args.max_n + 1)
    times = {"target": target_first_use(model, lengths, args.seed), "drafter": drafter_first_use(drafter, lengths, args.seed)}

    console = Console(width=120)
    table = Table(title=f"first pass over n entries vs again, {shape} ({config.n_layers} layers) on {device}, "
                        f"ms{' after a warm-up over 1..' + str(args.warm) if args.warm else ''}")
    for name in ("n", "target first", "target again", "drafter first", "drafter again"):
        table.add_column(name, justify="right")
    for i, n in enumerate(lengths):
        table.add_row(str(n), *(f"{times[m][r][i] * 1e3:.2f}" for m in ("target", "drafter") for r in ("first", "again")))
    table.add_row("median", *(f"{np.median(times[m][r]) * 1e3:.2f}" for m in ("target", "drafter")
                              for r in ("first", "again")))
    console.print(table)
    return times


if __name__ == "__main__":
    main()
