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
import torch.nn.functional as F
from scipy import stats

__all__ = ["median_time_s", "probe_h2d", "fit_h2d", "probe_expert_compute"]


def median_time_s(fn: Callable[[], object], device: torch.device, repeats: int = 7, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` in seconds (device events on CUDA)."""
    for _ in range(warmup):
        fn()
    samples = []
    if device.type == "cuda":
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
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

    Rows: ``bytes``, ``n_experts``, ``pinned``, ``seconds``, ``gbps``. On CPU the "device" is a
    second host buffer (what the CPU offload path does); pageable memory is probed only on CUDA.
    """
    rows = []
    pinned_modes = (True, False) if device.type == "cuda" else (False,)
    for pinned in pinned_modes:
        for factor in size_factors:
            one = max(int(expert_bytes * factor) // 2 * 2, 2)
            for n in batch_sizes:
                numel = one * n // 2  # bf16 elements
                src = torch.empty(numel, dtype=torch.bfloat16, pin_memory=pinned and device.type == "cuda")
                src.fill_(1)
                dst = torch.empty(numel, dtype=torch.bfloat16, device=device)
                seconds = median_time_s(lambda: dst.copy_(src, non_blocking=pinned), device, repeats=repeats)
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
    fit = stats.linregress(x, y)
    slope = max(fit.slope, 1e-15)
    return {"gbps": float(1.0 / slope / 1e9), "overhead_s": float(max(fit.intercept, 0.0)), "r2": float(fit.rvalue**2)}


def probe_expert_compute(hidden_size: int, intermediate_size: int, dtype: torch.dtype, device: torch.device,
                         token_counts=(1, 2, 4, 8, 16, 32), repeats: int = 9,
                         progress: Callable[[], None] | None = None) -> list[dict]:
    """Time to run one resident SwiGLU expert on ``n`` tokens (the cost of a cache hit).

    Rows: ``tokens``, ``seconds``.
    """
    gen = torch.Generator(device="cpu").manual_seed(0)
    gate_up = (torch.randn(2 * intermediate_size, hidden_size, generator=gen) * 0.02).to(device=device, dtype=dtype)
    down = (torch.randn(hidden_size, intermediate_size, generator=gen) * 0.02).to(device=device, dtype=dtype)
    rows = []
    for n in token_counts:
        x = torch.randn(n, hidden_size, generator=gen).to(device=device, dtype=dtype)

        def run():
            gate, up = (x @ gate_up.T).chunk(2, dim=-1)
            return (F.silu(gate) * up) @ down.T

        rows.append({"tokens": int(n), "seconds": median_time_s(run, device, repeats=repeats)})
        if progress:
            progress()
    return rows
