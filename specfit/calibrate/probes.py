"""Microbenchmarks of the machine at hand.

Each probe returns plain rows (lists of dicts) that go into the profile's ``probes`` section and
the calibration report. Timings are medians over repeats after warm-up; on CUDA they use device
events (and pinned vs pageable host memory for transfers), on CPU ``perf_counter`` around work that
is synchronous anyway.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from ..runtime.devices import upload
from ..runtime.model import expert_output
from ..runtime.pinned import CudaHostRegistrar, PinnedHostMemory

__all__ = ["median_time_s", "probe_h2d", "fit_h2d", "probe_expert_compute", "MEASURES"]

# what each probe's figures are, kept in the profile next to them
MEASURES = {
    "h2d": "seconds: one host-to-device copy of n experts' bytes (pinned: host pages registered with "
           "cudaHostRegister, as the offload's experts are; pageable for comparison), device events, median",
    "expert_compute": "seconds: one resident expert's whole per-expert body as the MoE block runs it on a hit "
                      "(gather of its tokens, SwiGLU, scaling by the routing weights, index_add_ into the layer "
                      "output), device events, median",
    "cycles": "seconds: one verification pass, wall clock between device synchronisations; transfer_stall_s: how "
              "long the compute stream waited for expert copies in it (CUDA: event pairs around each wait; CPU: "
              "the synchronous copy time), the transfer the cost model charges; copy_busy_s: summed spans of its "
              "copy bursts on the copy stream, host dispatch gaps inside a burst included",
    "draft": "seconds: one draft level (the drafter's tree level, or a stand-in layer of its shape), median",
}


def median_time_s(fn: Callable[[], object], device: torch.device, repeats: int = 7, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` in seconds (device events on CUDA, on ``device``'s current
    stream: the one ``fn``'s kernels run on)."""
    for _ in range(warmup):
        fn()
    samples = []
    if device.type == "cuda":
        stream = torch.cuda.current_stream(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(repeats):
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return float(np.median(samples))


def probe_h2d(expert_bytes: int, device: torch.device, batch_sizes=(1, 2, 4, 8), size_factors=(0.25, 0.5, 1.0, 2.0),
              repeats: int = 7, progress: Callable[[], None] | None = None) -> list[dict]:
    """Host-to-device copies of ``n`` experts at once over sizes around one expert's bytes.

    Rows: ``bytes``, ``n_experts``, ``pinned``, ``seconds``, ``gbps``. Pinned sources are
    registered exactly as the offload's experts are (:class:`~specfit.runtime.pinned.PinnedHostMemory`)
    and unregistered after their row. On CPU the "device" is a second host buffer (what the CPU
    offload path does); pageable memory is probed only on CUDA.
    """
    rows = []
    pinned_modes = (True, False) if device.type == "cuda" else (False,)
    for pinned in pinned_modes:
        for factor in size_factors:
            one = max(int(expert_bytes * factor) // 2 * 2, 2)
            for n in batch_sizes:
                numel = one * n // 2  # bf16 elements
                memory = PinnedHostMemory(CudaHostRegistrar() if pinned else None)
                try:
                    src = memory.empty((numel,), torch.bfloat16)
                    src.fill_(1)
                    dst = torch.empty(numel, dtype=torch.bfloat16, device=device)
                    seconds = median_time_s(lambda: dst.copy_(src, non_blocking=pinned), device, repeats=repeats)
                finally:
                    memory.release()
                rows.append({"bytes": one * n, "n_experts": n, "expert_bytes": one, "pinned": pinned,
                             "seconds": seconds, "gbps": one * n / seconds / 1e9})
                if progress:
                    progress()
    return rows


def fit_h2d(rows: list[dict], pinned: bool | None = None) -> dict:
    """Fit ``seconds = overhead_s + bytes / bandwidth`` (ordinary least squares) to the rows of
    one memory kind; returns ``gbps``, ``overhead_s`` and the fit's r²."""
    sel = [r for r in rows if pinned is None or r["pinned"] == pinned]
    x = np.array([r["bytes"] for r in sel], dtype=np.float64)
    y = np.array([r["seconds"] for r in sel], dtype=np.float64)
    if x.size < 2 or np.ptp(x) == 0:
        return {"gbps": float(np.median(x / y) / 1e9) if x.size else float("nan"), "overhead_s": 0.0, "r2": float("nan")}
    from scipy import stats      # here: scipy.stats costs 0.3 s of every decode's start-up

    fit = stats.linregress(x, y)
    slope = max(fit.slope, 1e-15)
    return {"gbps": float(1.0 / slope / 1e9), "overhead_s": float(max(fit.intercept, 0.0)), "r2": float(fit.rvalue**2)}


def probe_expert_compute(hidden_size: int, intermediate_size: int, dtype: torch.dtype, device: torch.device,
                         token_counts=(1, 2, 4, 8, 16, 32), repeats: int = 9, top_k: int = 8,
                         weights_float32: bool = False, progress: Callable[[], None] | None = None) -> list[dict]:
    """Time to run one resident expert on ``n`` tokens (the cost of a cache hit): the MoE block's
    whole per-expert body, :func:`~specfit.runtime.model.expert_output` (gather of its tokens,
    SwiGLU, scaling by the routing weights: float32 ones with ``weights_float32``, as Mixtral's,
    else in ``dtype``) and the ``index_add_`` into the layer's output.

    Rows: ``tokens``, ``seconds``.
    """
    gen = torch.Generator(device="cpu").manual_seed(0)
    gate_up = (torch.randn(2 * intermediate_size, hidden_size, generator=gen) * 0.02).to(device=device, dtype=dtype)
    down = (torch.randn(hidden_size, intermediate_size, generator=gen) * 0.02).to(device=device, dtype=dtype)
    rows = []
    for n in token_counts:
        x = torch.randn(n, hidden_size, generator=gen).to(device=device, dtype=dtype)
        weights = torch.rand(n * top_k, generator=gen).to(device=device,
                                                          dtype=torch.float32 if weights_float32 else dtype)
        # the expert is each token's first choice, as routing_plan lays assignments out
        index = upload(np.stack([np.arange(n), np.arange(n) * top_k]), device)
        out = torch.zeros_like(x)

        def run():
            token, y = expert_output(x, weights, index[:, 0:n], gate_up, down)
            out.index_add_(0, token, y.to(out.dtype))

        rows.append({"tokens": int(n), "seconds": median_time_s(run, device, repeats=repeats)})
        if progress:
            progress()
    return rows
