"""Expert weights in host memory and the device expert cache that the MoE layers read from.

:class:`HostExperts` holds every expert once, in host memory (pinned when the device is a GPU, so
copies are asynchronous DMA). :class:`ExpertOffload` owns the device side: a pool of expert
*slots* (``capacity`` per layer, or ``capacity`` in all in global mode), the slot table
``slot_of[layer, expert]``, a two-buffer staging area for experts that do not fit, and the
counters. Which experts stay resident is decided by the shared :class:`~specfit.experts.ExpertCache`
(the same bookkeeping the simulator uses); this module only maps its admitted / evicted / streamed
masks onto device buffers and performs the copies.

On CUDA the copies run on a dedicated copy stream, so copying a layer's misses overlaps with the
compute of its hits, and the next streamed expert is copied while the current one computes. On
CPU the "device" buffers are separate host tensors and every copy is a real, synchronous copy, so
the same code path (and the same counters) are exercised without a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ..experts.cache import ExpertCache, LayerCounts
from .pinned import CudaHostRegistrar, PinnedHostMemory, page_round

__all__ = ["HostExperts", "ExpertOffload", "OffloadCounters"]


class HostExperts:
    """Every expert of every layer, once, in host memory.

    ``gate_up[layer]`` is [E, 2I, H] (rows [:I] the gate projection, [I:] the up projection) and
    ``down[layer]`` is [E, H, I]: the layout the MoE block multiplies with, so a transfer is one
    contiguous copy per matrix.

    With ``pin_memory`` the tensors are page-locked by registering exactly their pages
    (:mod:`~specfit.runtime.pinned`), not through PyTorch's caching host allocator, which would
    round each layer's block up to a power of two. ``registrar`` replaces the CUDA runtime's
    ``cudaHostRegister`` (tests pass a recording fake).
    """

    def __init__(self, n_layers: int, n_experts: int, hidden_size: int, intermediate_size: int,
                 dtype: torch.dtype, pin_memory: bool = False, registrar=None):
        self.n_layers, self.n_experts = int(n_layers), int(n_experts)
        self.hidden_size, self.intermediate_size = int(hidden_size), int(intermediate_size)
        self.dtype = dtype
        if pin_memory and registrar is None:
            registrar = CudaHostRegistrar()
        self._memory = PinnedHostMemory(registrar)
        self.pinned = registrar is not None
        # one allocation per layer and matrix: pinning a whole 58 GB model at once can fail where
        # per-layer allocations succeed, and a layer is the unit the loader fills
        self.gate_up = [self._memory.empty(self.gate_up_shape, dtype) for _ in range(n_layers)]
        self.down = [self._memory.empty(self.down_shape, dtype) for _ in range(n_layers)]

    @property
    def gate_up_shape(self) -> tuple[int, int, int]:
        return (self.n_experts, 2 * self.intermediate_size, self.hidden_size)

    @property
    def down_shape(self) -> tuple[int, int, int]:
        return (self.n_experts, self.hidden_size, self.intermediate_size)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert (gate, up and down), i.e. of one host-to-device transfer."""
        return (self.gate_up[0][0].nbytes + self.down[0][0].nbytes) if self.n_layers else 0

    @property
    def nbytes(self) -> int:
        """Bytes of every expert: what the checkpoint holds for them in this dtype."""
        return self.expert_bytes * self.n_layers * self.n_experts

    @property
    def pinned_bytes(self) -> int:
        """Host bytes page-locked for the experts (0 when pageable): ``nbytes`` plus at most one
        page per layer and matrix."""
        return self._memory.pinned_bytes

    @staticmethod
    def planned_pinned_bytes(n_layers: int, n_experts: int, hidden_size: int, intermediate_size: int,
                             dtype: torch.dtype) -> int:
        """What pinning these experts locks, computed without allocating (the rule
        :class:`PinnedHostMemory` applies: each layer's two matrices rounded up to a page)."""
        gate_up = PinnedHostMemory.tensor_bytes((n_experts, 2 * intermediate_size, hidden_size), dtype)
        down = PinnedHostMemory.tensor_bytes((n_experts, hidden_size, intermediate_size), dtype)
        return n_layers * (page_round(gate_up) + page_round(down))

    def release_pinning(self) -> None:
        """Unlock the host pages now (the experts stay readable, pageable)."""
        self._memory.release()
        self.pinned = False


@dataclass
class OffloadCounters(LayerCounts):
    """Expert traffic of one forward pass, per layer (int64 [L])."""

    hits: np.ndarray
    misses: np.ndarray
    streamed: np.ndarray
    evictions: np.ndarray
    bytes_h2d: np.ndarray

    @classmethod
    def zeros(cls, n_layers: int) -> "OffloadCounters":
        return cls(*(np.zeros(n_layers, dtype=np.int64) for _ in range(5)))

    def __iadd__(self, other: "OffloadCounters") -> "OffloadCounters":
        for name in ("hits", "misses", "streamed", "evictions", "bytes_h2d"):
            getattr(self, name)[:] += getattr(other, name)
        return self

    @property
    def total_bytes_h2d(self) -> int:
        return int(self.bytes_h2d.sum())


class _Copier:
    """Host-to-device copies: asynchronous on a CUDA copy stream, plain ``copy_`` elsewhere.

    ``copy`` returns an event the compute side waits on before reading the destination;
    ``compute_done`` returns an event marking the compute enqueued so far, which a later copy into
    the same buffer waits on. Both are None on CPU, where everything is already in order.

    Copy time is measured where it happens: on CUDA by timing events around each copy on the copy
    stream (read back in :meth:`take_time_s`, after the pass), on CPU by the clock around the copy.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self._time_s = 0.0
        self._timed_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after=None):
        if not self.cuda:
            start = time.perf_counter()
            dst.copy_(src)
            self._time_s += time.perf_counter() - start
            return None
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            # recorded after the wait: the pair brackets the copy itself, not the wait
            begin = torch.cuda.Event(enable_timing=True)
            begin.record(self.stream)
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event(enable_timing=True)
            done.record(self.stream)
        self._timed_events.append((begin, done))
        return done

    def take_time_s(self) -> float:
        """Seconds spent copying since the last call (waits for the copies still in flight).
        Copies on the one copy stream run one after another, so the sum is the stream's busy time."""
        total, self._time_s = self._time_s, 0.0
        if self._timed_events:
            self._timed_events[-1][1].synchronize()
            total += sum(begin.elapsed_time(done) for begin, done in self._timed_events) / 1e3
            self._timed_events.clear()
        return total

    def wait(self, event) -> None:
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def compute_done(self):
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return event


class ExpertOffload:
    """The device expert cache of a model whose experts live in :class:`HostExperts`.

    Args:
        host: the experts in host memory.
        capacity: device slots per layer (``mode="per_layer"``) or in all (``"global"``);
            0 streams every expert, ``n_experts`` keeps every expert resident after first use.
        device: where the slots live (the compute device).
        mode, policy: passed to :class:`~specfit.experts.ExpertCache`.

    The MoE block calls :meth:`layer_experts` once per layer and forward pass; counters for the
    current pass accumulate in :attr:`counters` until :meth:`begin_pass` resets them.
    """

    def __init__(self, host: HostExperts, capacity: int, device: str | torch.device = "cpu",
                 mode: str = "per_layer", policy: str = "lru"):
        self.host = host
        self.device = torch.device(device)
        L, E = host.n_layers, host.n_experts
        self.cache = ExpertCache(L, E, capacity, mode=mode, policy=policy, expert_bytes=host.expert_bytes)
        n_slots = self.cache.capacity * L if mode == "per_layer" else self.cache.capacity
        I, H = host.intermediate_size, host.hidden_size
        self.slot_gate_up = torch.empty((n_slots, 2 * I, H), dtype=host.dtype, device=self.device)
        self.slot_down = torch.empty((n_slots, H, I), dtype=host.dtype, device=self.device)
        self.slot_of = np.full((L, E), -1, dtype=np.int64)   # device slot of each resident expert
        self._free_slots: list[int] = []
        self.reset()
        # A layer's union always fits once capacity >= E (per layer, or globally since only the
        # current layer's union is protected from eviction); below that, overflow is streamed.
        n_staging = 2 if self.cache.capacity < E else 0
        self.staging_gate_up = torch.empty((n_staging, 2 * I, H), dtype=host.dtype, device=self.device)
        self.staging_down = torch.empty((n_staging, H, I), dtype=host.dtype, device=self.device)
        self._staging_free = [None] * n_staging                # event: last compute that read the buffer
        self._copier = _Copier(self.device)
        self.counters = OffloadCounters.zeros(L)

    @property
    def n_slots(self) -> int:
        return int(self.slot_gate_up.shape[0])

    @property
    def device_bytes(self) -> int:
        """Device memory held for experts: the slots plus the staging buffers."""
        return sum(t.nbytes for t in (self.slot_gate_up, self.slot_down, self.staging_gate_up, self.staging_down))

    def reset(self) -> None:
        """Empty the device cache: no expert resident, every slot free, cache counters zero."""
        self.cache.reset()
        self.slot_of[:] = -1
        self._free_slots = list(range(self.n_slots - 1, -1, -1))   # a stack: pop() hands out slot 0 first

    def begin_pass(self) -> None:
        """Start counting a new forward pass."""
        self.counters = OffloadCounters.zeros(self.host.n_layers)
        self._copier.take_time_s()

    def pass_transfer_time_s(self) -> float:
        """Seconds of host-to-device copying in the pass begun last (call once it is done)."""
        return self._copier.take_time_s()

    def layer_experts(self, layer: int, expert_ids: np.ndarray) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Yield ``(expert_id, gate_up [2I, H], down [H, I])`` on the device for each id of
        ``expert_ids`` (the layer's union), in ascending id order.

        Resident experts are hits; misses are admitted into slots (copied once, before the
        first yield, so their copies overlap the hits' compute) or, when the layer has no slot
        left for them, streamed one by one through the staging buffers. A streamed expert's
        tensors are valid until the consumer asks for the next expert.
        """
        expert_ids = np.unique(np.asarray(expert_ids, dtype=np.int64))
        union = np.zeros((self.host.n_layers, self.host.n_experts), dtype=bool)
        union[layer, expert_ids] = True
        result = self.cache.admit(union)
        self._count(layer, result)

        # global mode may evict other layers' experts: free every evicted slot first
        for evicted_layer, evicted_expert in np.argwhere(result.evicted_mask):
            self._free_slots.append(int(self.slot_of[evicted_layer, evicted_expert]))
            self.slot_of[evicted_layer, evicted_expert] = -1
        # slots just freed may still be read by compute already enqueued (an earlier layer or
        # pass); copies into them wait for it
        compute_so_far = self._copier.compute_done()
        ready = {}
        for expert in np.flatnonzero(result.admitted_mask[layer]):
            slot = self._free_slots.pop()
            self.slot_of[layer, expert] = slot
            ready[int(expert)] = self._copy_expert(layer, expert, self.slot_gate_up[slot], self.slot_down[slot],
                                                   after=compute_so_far)

        streamed = [int(e) for e in np.flatnonzero(result.streamed_mask[layer])]
        staged = {}
        for i in range(min(len(streamed), len(self._staging_free))):
            staged[streamed[i]] = self._stage(i, layer, streamed[i])

        n_streamed_done = 0
        for expert in expert_ids.tolist():
            if expert in staged:
                buffer, event = staged.pop(expert)
                self._copier.wait(event)
                yield expert, self.staging_gate_up[buffer], self.staging_down[buffer]
                # the consumer has enqueued this expert's compute: the buffer can be refilled
                # with the streamed expert after next (double buffering)
                self._staging_free[buffer] = self._copier.compute_done()
                following = n_streamed_done + len(self._staging_free)
                if following < len(streamed):
                    staged[streamed[following]] = self._stage(following, layer, streamed[following])
                n_streamed_done += 1
            else:
                slot = int(self.slot_of[layer, expert])
                self._copier.wait(ready.get(expert))
                yield expert, self.slot_gate_up[slot], self.slot_down[slot]

    # ------------------------------------------------------------------ helpers
    def _stage(self, index: int, layer: int, expert: int):
        buffer = index % len(self._staging_free)
        event = self._copy_expert(layer, expert, self.staging_gate_up[buffer], self.staging_down[buffer],
                                  after=self._staging_free[buffer])
        return buffer, event

    def _copy_expert(self, layer: int, expert: int, gate_up: torch.Tensor, down: torch.Tensor, after=None):
        self._copier.copy(gate_up, self.host.gate_up[layer][expert], after=after)
        return self._copier.copy(down, self.host.down[layer][expert])

    def _count(self, layer: int, result) -> None:
        c = self.counters
        c.hits[layer] += result.hits[layer]
        c.misses[layer] += result.misses[layer]
        c.streamed[layer] += result.streamed[layer]
        c.evictions += result.evictions      # global mode charges the layer that lost the expert
        c.bytes_h2d[layer] += result.misses[layer] * self.host.expert_bytes
