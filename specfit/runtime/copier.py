"""Host-to-device copies of expert weights, and what they cost the compute.

Two copiers with one interface serve :class:`~specfit.runtime.offload.ExpertOffload`:

- :class:`HostCopier` (CPU): a copy is a synchronous ``copy_`` between host tensors, so compute
  waits for every copy: the stall is the copy time.
- :class:`StreamCopier` (CUDA): copies run on a dedicated copy stream of the offload's device and
  the compute stream (that device's current stream) waits only where it reads a copied expert.
  ``api`` is the ``torch.cuda`` module; tests pass a recording fake with the same names, which
  runs this exact code on the CPU.

A copy is named by a *key* (``("slot", s)``, ``("stage", b)``): the key's event marks it done.
:meth:`~StreamCopier.record_compute` marks the compute enqueued so far under a key
(``"compute"``, ``("stage_free", b)``) that a later copy waits for before overwriting a buffer
compute may still read. Events are made once per key and re-recorded: re-recording is safe once
every wait on the previous record has been enqueued, and the offload's order guarantees that (a
slot is refilled only after the layer that waited on it; a staging buffer is refilled only after
its last reader was enqueued).

What is timed, with timing events from a pool reused every pass and read once after it:

- ``stall_s``: around each wait of the compute stream on a copy, a pair of events on the compute
  stream; their gap is how long compute sat waiting for that copy. This is what copies cost a
  pass beyond its compute, the transfer the cost model charges for a miss.
- ``copy_busy_s``: one pair per *burst* (copies enqueued back to back, with no wait between) on
  the copy stream. The span includes the host's dispatch gaps inside the burst, so it is an upper
  bound of the copy engine's busy time, not a stall.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

__all__ = ["TransferTiming", "HostCopier", "StreamCopier", "make_copier"]


@dataclass(frozen=True)
class TransferTiming:
    """Copy timing of one pass (see the module docstring for what each figure is)."""

    stall_s: float
    copy_busy_s: float
    n_bursts: int
    n_waits: int

    @classmethod
    def zero(cls) -> "TransferTiming":
        return cls(0.0, 0.0, 0, 0)


class HostCopier:
    """Synchronous copies between host tensors; the clock around them is both figures."""

    def __init__(self):
        self._copy_s, self._bursts = 0.0, 0

    def issue(self, jobs, after=None) -> None:
        """Copy each job's ``(dst, src)`` pairs; ``jobs`` is a list of ``(key, pairs)``."""
        if not jobs:
            return
        start = time.perf_counter()
        for _, pairs in jobs:
            for dst, src in pairs:
                dst.copy_(src)
        self._copy_s += time.perf_counter() - start
        self._bursts += 1

    def record_compute(self, key) -> None:
        pass

    def wait(self, key) -> None:
        pass

    def discard(self) -> None:
        self._copy_s, self._bursts = 0.0, 0

    def take_timing(self) -> TransferTiming:
        timing = TransferTiming(self._copy_s, self._copy_s, self._bursts, 0)
        self.discard()
        return timing


class StreamCopier:
    """Asynchronous copies on a copy stream of ``device``; compute on ``device``'s current stream."""

    def __init__(self, device: torch.device, api=None):
        self.api = torch.cuda if api is None else api
        self.device = device
        self.stream = self.api.Stream(device=device)
        self._markers: dict = {}               # key -> event, made once
        self._recorded: set = set()            # keys recorded at least once
        self._timers: list = []                # timing events, reused every pass
        self._n_timers = 0                     # used in the current pass
        self._bursts: list[tuple[int, int]] = []
        self._waits: list[tuple[int, int]] = []

    def compute_stream(self):
        return self.api.current_stream(self.device)

    def _marker(self, key):
        event = self._markers.get(key)
        if event is None:
            event = self._markers[key] = self.api.Event()
        return event

    def _timer(self) -> int:
        if self._n_timers == len(self._timers):
            self._timers.append(self.api.Event(enable_timing=True))
        self._n_timers += 1
        return self._n_timers - 1

    def issue(self, jobs, after=None) -> None:
        """Enqueue one burst: each job's ``(dst, src)`` copies, then its key's event; the whole
        burst waits first for ``after``'s last record, if it was ever recorded."""
        if not jobs:
            return
        stream = self.stream
        with self.api.stream(stream):
            if after is not None and after in self._recorded:
                stream.wait_event(self._markers[after])
            begin = self._timer()
            self._timers[begin].record(stream)
            for key, pairs in jobs:
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=True)
                self._marker(key).record(stream)
                self._recorded.add(key)
            end = self._timer()
            self._timers[end].record(stream)
        self._bursts.append((begin, end))

    def record_compute(self, key) -> None:
        self._marker(key).record(self.compute_stream())
        self._recorded.add(key)

    def wait(self, key) -> None:
        """Make compute wait for the copy under ``key``, timing how long it is held."""
        stream = self.compute_stream()
        before, after = self._timer(), self._timer()
        self._timers[before].record(stream)
        stream.wait_event(self._markers[key])
        self._timers[after].record(stream)
        self._waits.append((before, after))

    def discard(self) -> None:
        """Forget this pass's timings without reading them (no synchronisation)."""
        self._n_timers = 0
        self._bursts.clear()
        self._waits.clear()

    def take_timing(self) -> TransferTiming:
        """This pass's timing; waits for the copies and waits it timed to finish."""
        for pairs in (self._bursts, self._waits):
            if pairs:
                self._timers[pairs[-1][1]].synchronize()

        def total_s(pairs):
            return sum(self._timers[a].elapsed_time(self._timers[b]) for a, b in pairs) / 1e3

        timing = TransferTiming(total_s(self._waits), total_s(self._bursts), len(self._bursts), len(self._waits))
        self.discard()
        return timing


def make_copier(device: torch.device, api=None):
    """The copier for ``device``: a stream copier on CUDA (or with a CUDA-like ``api``)."""
    if api is not None or device.type == "cuda":
        return StreamCopier(device, api)
    return HostCopier()
