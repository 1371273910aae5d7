"""Benchmark: what one small call costs right after a model pass, against the same call warm.

The live decoder's bookkeeping runs between the drafter's and the target's passes, which sweep the
core's caches with weights and torch's own code. This decodes the bundled model with ``specfit``
and, right after every target pass, times one call of each kind (the order rotating per cycle, so
that no kind is always first); then the same calls in a warm loop. Prints medians in microseconds:
why the decoder's bookkeeping is counted in calls, and why torch's calls cost the most there. The
last rows are two of the decoder's own steps the old way and the way it takes them now, and the
router predictor's step for one level of 16 nodes (the bundled model's sizes) as this checkout
takes it and, with ``--baseline REV``, as that revision did.

    python benchmarks/bench_cold_calls.py [--baseline REV]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def router_calls(baseline: str | None) -> dict:
    """One level's router prediction (16 nodes with their drafter contexts and the last routing,
    the bundled model's 2048 x 128 embedding and 4 x 16 routers), by this checkout's kernel and by
    ``baseline``'s."""
    from bench_learning import host_weights
    from revision import module_at

    from specfit import kernels

    rng = np.random.default_rng(0)
    embed = rng.standard_normal((2048, 128)).astype(np.float32)
    rows = rng.standard_normal((64, 128)).astype(np.float32)
    step = (rng.integers(0, 2048, 16), rng.standard_normal((16, 128)).astype(np.float32), np.full(4, 0.5),
            rng.integers(0, 16, (16, 4, 4)), np.ones(4), 4)
    modules = {"this checkout": kernels.router}
    if baseline:
        modules = {baseline: module_at(baseline, "specfit/kernels/router.py", "router_baseline", "bench_cold_calls"),
                   **modules}
    calls = {}
    for label, module in modules.items():
        weights = host_weights(module, embed, rows)
        calls[f"router prediction, 16 nodes ({label})"] = (
            lambda module=module, weights=weights: module.predict_host(*weights, *step))
    return calls


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default=None, help="git revision whose router kernel to time beside this one")
    args = parser.parse_args(argv)
    from numba import njit

    from specfit.threads import set_cpu_threads

    set_cpu_threads(1)
    import torch

    from specfit.assets import demo_prompts_path, tiny_moe_dir, tiny_moe_eagle3_dir
    from specfit.runtime import decoder as decoder_module
    from specfit.runtime.decode_job import DecodePlan, run_decode

    @njit
    def one_array(a):
        return a[0]

    @njit
    def ten_arrays(a, b, c, d, e, f, g, h, i, j):
        return a[0]

    from specfit import kernels

    ints = np.zeros(20, dtype=np.int64)
    # a verification's logits (15 nodes x the bundled vocabulary) and the bundled model's KV cache
    # [layers, 2, kv heads, slots, head dim], whose accepted path (5 entries) moves in a compaction
    logits = torch.randn(15, 2048)
    kv = np.random.default_rng(0).random((4, 2, 2, 300, 32), dtype=np.float32)
    kv_bytes = kv.reshape(-1, 300, 32).view(np.uint8)
    keep = np.array([0, 1, 3, 6, 9])

    def compact_by_indexing():            # the decoder's compaction before stop 26
        first = int(np.count_nonzero(keep == np.arange(keep.size)))
        start, source = 100 + first, keep[first:] + 100
        kv[:, :, :, start:start + source.size] = kv[:, :, :, source]

    calls = {
        "a Python function": lambda: len(ints),
        "np.zeros(20)": lambda: np.zeros(20),
        "np.full(20, -1)": lambda: np.full(20, -1, dtype=np.int64),
        "np.concatenate of two": lambda: np.concatenate([ints, ints]),
        "numba, 1 array": lambda: one_array(ints),
        "numba, 10 arrays": lambda: ten_arrays(ints, ints, ints, ints, ints, ints, ints, ints, ints, ints),
        "torch.from_numpy": lambda: torch.from_numpy(ints),
        "torch add of 3": lambda: torch.ones(3) + 1,
        "verdicts: torch argmax of [15, 2048]": lambda: logits.argmax(dim=-1).cpu().numpy(),
        "verdicts: numpy argmax of the same": lambda: logits.numpy().argmax(axis=-1),
        "KV compaction by numpy indexing": compact_by_indexing,
        "KV compaction, compiled (kernels.kv)": lambda: kernels.kv.compact(kv_bytes, 100, keep),
        **router_calls(args.baseline),
    }
    for call in calls.values():
        call()                                    # compiled and loaded before anything is timed
    cold = {name: [] for name in calls}
    verify = decoder_module.Decoder.verify
    order = list(calls)

    def timed_verify(self, *args, **kwargs):
        out = verify(self, *args, **kwargs)
        shift = len(cold[order[0]]) % len(order)
        for name in order[shift:] + order[:shift]:
            start = time.perf_counter()
            calls[name]()
            cold[name].append(time.perf_counter() - start)
        return out

    decoder_module.Decoder.verify = timed_verify
    work = Path(tempfile.mkdtemp(prefix="bench_cold_calls."))
    run_decode(DecodePlan(model_dir=tiny_moe_dir(), prompts_path=demo_prompts_path(), cache_experts=4,
                          policies=["specfit"], drafter_dir=tiny_moe_eagle3_dir(), max_new_tokens=64, device="cpu",
                          profile="pcie4", ignore_eos=True, out_dir=work / "run"))
    decoder_module.Decoder.verify = verify
    print(f"| call | right after a target pass (us, median of {len(cold[order[0]])}) | warm (us) | ratio |")
    print("|---|---:|---:|---:|")
    for name, call in calls.items():
        start = time.perf_counter()
        for _ in range(2000):
            call()
        warm = (time.perf_counter() - start) / 2000
        after = float(np.median(cold[name]))
        print(f"| {name} | {after * 1e6:.1f} | {warm * 1e6:.2f} | {after / warm:.0f}x |")


if __name__ == "__main__":
    main()
