"""Probes repeated in rounds: the median of each measurement, its spread, and a warning when the
machine is busy.

On a machine with other work on it a probe's time is its work plus whatever the scheduler gave to
others, and a single disturbed pass can move a fitted term. :func:`repeat_rounds` runs every probe
once per round, the rounds one after another (round 1 of every probe, then round 2, ...), so each
measurement's samples are seconds apart and a disturbance shorter than that touches one sample; it
keeps the median per measurement. The probes are seeded, so every round measures the same work
(the same copies, the same trees, the same hits and misses), which is checked.

Before the timed rounds every probe runs once untimed (``warmup_rounds``): a process's first pass
over a shape pays one-off costs (compiled kernels loaded from their cache, allocations, cold
caches). On the bundled model, quiet, the first of three rounds took markedly longer than the
median of each measurement, and every ``--quick`` calibration warned "busy"; with the untimed round
first, side-by-side runs put the median spread well below what it was (``benchmarks/RESULTS.md``,
"Stop 33: a cold first round read as a busy machine"): what is left is the jitter of passes of a
few milliseconds.

What the rounds say about the machine (:func:`machine_noise`):

- ``spread``: per measurement (max - min) / median over the rounds; its median over measurements
  is the probe's noise;
- ``cpu_share``: the probing process's CPU time over the wall time (on a CPU device with one torch
  thread the work is CPU-bound, so a share well below 1 means other processes held the cores);
- ``load_average``: the system's one-minute load average against its CPU count.

:func:`busy_warnings` turns these into sentences for the profile and the command line;
:func:`machine_busy` says whether the probes were disturbed (``specfit decode`` does not keep such a
quick calibration in its cache).
"""

from __future__ import annotations

import os
import time
from typing import Callable

import numpy as np

from ..errors import SpecFitError

__all__ = ["repeat_rounds", "machine_noise", "busy_warnings", "machine_busy", "rounds_text", "SPREAD_BUSY",
           "CPU_SHARE_BUSY"]

# a median spread over the rounds above this says the timings are disturbed
SPREAD_BUSY = 0.15
# a CPU-bound probe that gets less of a core than this shared it with other processes
CPU_SHARE_BUSY = 0.8
# the fields that describe the work of a row; every round must measure the same work
_WORK_FIELDS = ("capacity", "tree", "n_nodes", "hits", "misses", "bytes_h2d", "bytes", "n_experts", "tokens", "pinned", "width",
                "level")


def repeat_rounds(probes: dict[str, Callable[[], list[dict]]], rounds: int,
                  warmup_rounds: int = 1) -> tuple[dict[str, list[dict]], dict]:
    """Run each probe ``warmup_rounds`` times untimed (their rows dropped), then ``rounds`` times,
    interleaved; return (rows per probe, timing summary).

    Each returned row is the first round's row with ``seconds`` replaced by the median over the
    rounds, ``seconds_rounds`` (every round's value) and ``spread`` added; a ``gbps`` field is
    recomputed from the median. The summary holds per probe the wall and CPU seconds of each round.
    """
    if rounds < 1:
        raise SpecFitError(f"calibrate: expected at least 1 round of probes, got {rounds}")
    for _ in range(warmup_rounds):
        for probe in probes.values():
            probe()
    results: dict[str, list[list[dict]]] = {name: [] for name in probes}
    timing = {name: {"wall_s": [], "cpu_s": []} for name in probes}
    for _ in range(rounds):
        for name, probe in probes.items():
            wall, cpu = time.perf_counter(), time.process_time()
            results[name].append(probe())
            timing[name]["wall_s"].append(time.perf_counter() - wall)
            timing[name]["cpu_s"].append(time.process_time() - cpu)
    return {name: _combine(name, runs) for name, runs in results.items()}, timing


def _combine(name: str, runs: list[list[dict]]) -> list[dict]:
    first = runs[0]
    if any(len(run) != len(first) for run in runs):
        raise SpecFitError(f"calibrate: probe {name!r} returned {[len(r) for r in runs]} rows over its rounds; "
                           f"expected the same measurements every round")
    rows = []
    for i, row in enumerate(first):
        for run in runs[1:]:
            other = run[i]
            changed = [k for k in _WORK_FIELDS if k in row and other.get(k) != row[k]]
            if changed:
                raise SpecFitError(f"calibrate: probe {name!r} row {i} measured different work in another round "
                                   f"({', '.join(f'{k}: {row[k]} vs {other.get(k)}' for k in changed)}); its "
                                   f"rounds cannot be combined")
        samples = np.array([run[i]["seconds"] for run in runs], dtype=np.float64)
        median = float(np.median(samples))
        out = {**row, "seconds": median, "seconds_rounds": samples.tolist(),
               "spread": float(np.ptp(samples) / median) if median > 0 else 0.0}
        if "gbps" in row and "bytes" in row and median > 0:
            out["gbps"] = row["bytes"] / median / 1e9
        rows.append(out)
    return rows


def machine_noise(rows: dict[str, list[dict]], timing: dict, device_type: str, threads: int) -> dict:
    """What the probe rounds say about the machine: the spread of the measurements (median and 90th
    percentile, per probe and over all), the CPU share of the probing process (on a CPU device with
    one thread only, where the probes are CPU-bound), the load average and the CPU count."""
    spreads = {name: [r["spread"] for r in probe_rows] for name, probe_rows in rows.items() if probe_rows}
    every = np.concatenate([np.asarray(v) for v in spreads.values()]) if spreads else np.zeros(0)
    wall = sum(sum(t["wall_s"]) for t in timing.values())
    cpu = sum(sum(t["cpu_s"]) for t in timing.values())
    try:
        load = os.getloadavg()[0]
    except OSError:                     # not every platform has it
        load = float("nan")
    out = {
        "rounds": len(next(iter(timing.values()))["wall_s"]) if timing else 0,
        "spread_median": float(np.median(every)) if every.size else float("nan"),
        "spread_p90": float(np.percentile(every, 90)) if every.size else float("nan"),
        "spread_by_probe": {name: float(np.median(v)) for name, v in spreads.items()},
        "wall_s": wall,
        "cpu_s": cpu,
        "cpu_share": cpu / wall if wall > 0 and device_type == "cpu" and threads == 1 else None,
        "load_average": load,
        "cpu_count": os.cpu_count(),
        "round_wall_s": {name: t["wall_s"] for name, t in timing.items()},
    }
    return out


def _spread_busy(noise: dict) -> bool:
    spread = noise.get("spread_median", float("nan"))
    return spread == spread and spread > SPREAD_BUSY


def _share_busy(noise: dict) -> bool:
    share = noise.get("cpu_share")
    return share is not None and share < CPU_SHARE_BUSY


def machine_busy(noise: dict) -> bool:
    """Whether the probes' own checks say other work disturbed them (the first two of
    :func:`busy_warnings`): they got less than a core, or, but for a ``--quick`` calibration, their
    timings spread over the rounds (a quick one's few short passes spread beyond that on an idle
    machine too: in about half the runs on a 2-core VM, stop 33). A high load average alone is
    not: the probes may still have had their core."""
    return _share_busy(noise) or (_spread_busy(noise) and not noise.get("quick"))


def busy_warnings(noise: dict) -> list[str]:
    """Sentences saying why the probes' timings may not describe the machine at rest (empty: none)."""
    warnings = []
    spread = noise.get("spread_median", float("nan"))
    if _spread_busy(noise):
        # a --quick calibration's few short passes jitter on an idle machine too
        cause, again = (("the machine is busy or its passes jitter (--quick probes are few and short: they vary "
                         "on an idle machine too)", "when it is quiet and without --quick") if noise.get("quick") else
                        ("the machine is busy", "when it is quiet"))
        warnings.append(f"the probes' timings varied by {spread:.0%} (median over measurements of (max - min) / "
                        f"median across {noise['rounds']} rounds): {cause}; the profile is uncertain. Calibrate "
                        f"again {again}, or rely on the online refit while decoding")
    share = noise.get("cpu_share")
    if _share_busy(noise):
        warnings.append(f"the probes got {share:.0%} of a CPU core (CPU time over wall time): other processes "
                        f"were running; the profile describes this machine as loaded as it was")
    load, count = noise.get("load_average", float("nan")), noise.get("cpu_count") or 0
    if load == load and count and load > count:
        warnings.append(f"load average {load:.1f} on {count} CPU cores during calibration")
    return warnings


def rounds_text(noise: dict) -> str:
    """"3 rounds after 1 untimed": the timed and warm-up rounds of a profile's probes."""
    warm = noise.get("warmup_rounds")
    return f"{noise['rounds']} rounds" + (f" after {warm} untimed" if warm else "")
