"""Expert weights in host memory and the device expert cache that the MoE layers read from.

:class:`HostExperts` holds every expert once, in host memory (pinned when the device is a GPU, so
copies are asynchronous DMA). :class:`ExpertOffload` owns the device side: a pool of expert
*slots* (``capacity`` per layer, or ``capacity`` in all in global mode), the slot table
``slot_of[layer, expert]``, a two-buffer staging area for experts that do not fit, and the
counters. Which experts stay resident is decided by the shared :class:`~specfit.experts.ExpertCache`
(the same bookkeeping the simulator uses); this module only maps its admitted / evicted / streamed
masks onto device buffers and performs the copies.

On CUDA the copies run on a dedicated copy stream (:mod:`~specfit.runtime.copier`), so copying a
layer's misses overlaps with the compute of its hits, which run first, and the next streamed
expert is copied while the current one computes. On CPU the "device" buffers are separate host
tensors and every copy is a real, synchronous copy, so the same code path (and the same counters)
are exercised without a GPU.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ..experts.cache import ExpertCache, LayerCounts
from .copier import StreamCopier, TransferTiming, make_copier
from .devices import resolve_device
from .pinned import CudaHostRegistrar, PinnedHostMemory, page_round

__all__ = ["HostExperts", "ExpertOffload", "OffloadCounters", "OffloadState", "CacheTurns"]


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


@dataclass
class OffloadCounters(LayerCounts):
    """Expert traffic of one forward pass, per layer (int64 [L])."""

    hits: np.ndarray
    misses: np.ndarray
    streamed: np.ndarray
    evictions: np.ndarray
    bytes_h2d: np.ndarray

    FIELDS = ("hits", "misses", "streamed", "evictions", "bytes_h2d")

    @classmethod
    def zeros(cls, n_layers: int) -> "OffloadCounters":
        return cls(*(np.zeros(n_layers, dtype=np.int64) for _ in cls.FIELDS))

    def __iadd__(self, other: "OffloadCounters") -> "OffloadCounters":
        for name in self.FIELDS:
            getattr(self, name)[:] += getattr(other, name)
        return self

    def __sub__(self, other: "OffloadCounters") -> "OffloadCounters":
        return OffloadCounters(*(getattr(self, name) - getattr(other, name) for name in self.FIELDS))

    @property
    def total_bytes_h2d(self) -> int:
        return int(self.bytes_h2d.sum())


@dataclass(frozen=True)
class OffloadState:
    """An :class:`ExpertOffload`'s cache at one moment (:meth:`ExpertOffload.save_state`): the
    cache's bookkeeping, the slot of each resident expert and the free slots."""

    cache: ExpertCache
    slot_of: np.ndarray
    free_slots: list


class ExpertOffload:
    """The device expert cache of a model whose experts live in :class:`HostExperts`.

    Args:
        host: the experts in host memory.
        capacity: device slots per layer (``mode="per_layer"``) or in all (``"global"``);
            0 streams every expert, ``n_experts`` keeps every expert resident after first use.
        device: where the slots live (the compute device; ``cuda`` means ``cuda:N`` of the current
            device, fixed here, and every stream and event below uses that device).
        mode, policy: passed to :class:`~specfit.experts.ExpertCache`.
        cuda_api: a stand-in for ``torch.cuda`` (tests): the stream copier then runs on CPU tensors.

    The MoE block calls :meth:`layer_experts` once per layer and forward pass; counters for the
    current pass accumulate in :attr:`counters` until :meth:`begin_pass` resets them.
    """

    def __init__(self, host: HostExperts, capacity: int, device: str | torch.device = "cpu",
                 mode: str = "per_layer", policy: str = "lru", cuda_api=None):
        self.host = host
        device = torch.device(device)
        self.device = resolve_device(device, option="device") if device.type == "cuda" else device
        L, E = host.n_layers, host.n_experts
        self.cache = ExpertCache(L, E, capacity, mode=mode, policy=policy, expert_bytes=host.expert_bytes)
        self._n_slots = self.cache.capacity * L if mode == "per_layer" else self.cache.capacity
        self._n_staging = ExpertCache.staging_buffers(self.cache.capacity, E, self.cache.policy,
                                                      ExpertCache.slot_limit(L, E, mode))
        self.slot_of = np.full((L, E), -1, dtype=np.int64)   # device slot of each resident expert
        self._free_slots: list[int] = []
        self.released = True
        self.allocate()
        self._copier = make_copier(self.device, cuda_api)
        self.counters = OffloadCounters.zeros(L)
        self.last_timing = TransferTiming.zero()
        # eviction priorities for the pass under way (float [L, E]), set by the decoder from the
        # policy's cache advisor (specfit.experts.lookahead); None: the cache's own policy
        self.keep: np.ndarray | None = None
        # prefetch copies in flight (worker-thread futures on CPU, a marker on CUDA)
        self._prefetch_pending: list = []
        self._prefetch_pool = None

    # ------------------------------------------------------------------ device memory
    def allocate(self) -> None:
        """Allocate the slots and staging buffers (done by the constructor; again after
        :meth:`release`), with an empty cache."""
        host, I, H = self.host, self.host.intermediate_size, self.host.hidden_size
        def buffers(n):
            return (torch.empty((n, 2 * I, H), dtype=host.dtype, device=self.device),
                    torch.empty((n, H, I), dtype=host.dtype, device=self.device))
        # never inference tensors, even when allocated inside inference mode (a calibration's
        # probes, a stand-in's build): copies write them outside it too (a prefetch, on the copy
        # stream or a worker thread; a cache's turn restored), which inference tensors refuse
        with torch.inference_mode(False):
            self.slot_gate_up, self.slot_down = buffers(self._n_slots)
            self.staging_gate_up, self.staging_down = buffers(self._n_staging)
        self.released = False
        self.reset()

    def release(self) -> None:
        """Free the device memory of the slots and staging buffers and empty the cache (e.g. so
        that a calibration probe can allocate its own); :meth:`allocate` brings them back."""
        self.reset()
        self.slot_gate_up = self.slot_gate_up.new_empty((0, *self.slot_gate_up.shape[1:]))
        self.slot_down = self.slot_down.new_empty((0, *self.slot_down.shape[1:]))
        self.staging_gate_up = self.staging_gate_up.new_empty((0, *self.staging_gate_up.shape[1:]))
        self.staging_down = self.staging_down.new_empty((0, *self.staging_down.shape[1:]))
        self._free_slots = []
        self.released = True

    @property
    def n_slots(self) -> int:
        return self._n_slots

    @property
    def device_bytes(self) -> int:
        """Device memory held for experts now: the slots plus the staging buffers (0 when released)."""
        return sum(t.nbytes for t in (self.slot_gate_up, self.slot_down, self.staging_gate_up, self.staging_down))

    @property
    def planned_device_bytes(self) -> int:
        """What :meth:`allocate` holds: slots plus staging buffers."""
        return (self._n_slots + self._n_staging) * self.host.expert_bytes

    def reset(self) -> None:
        """Empty the device cache: no expert resident, every slot free, cache counters zero."""
        if getattr(self, "_prefetch_pending", None):
            self.wait_prefetch()
        self.cache.reset()
        self.slot_of[:] = -1
        self._free_slots = list(range(self._n_slots - 1, -1, -1))   # a stack: pop() hands out slot 0 first

    def save_state(self) -> "OffloadState":
        """The cache as it stands (which experts are resident, in which slots, and the eviction
        policy's own state), for :meth:`restore_state`: several decoders can take turns on one
        model, each with its own cache, as if each had run alone. Waits for prefetch copies in flight."""
        self.wait_prefetch()
        return OffloadState(cache=copy.deepcopy(self.cache), slot_of=self.slot_of.copy(),
                            free_slots=list(self._free_slots))

    def restore_state(self, state: "OffloadState") -> int:
        """Make the cache what :meth:`save_state` saved, and copy each of its resident experts
        back into its slot from host memory where another decoder's expert holds that slot now.
        Off any decode's clock: the copies are synchronous. The same state may be restored again.
        Returns how many experts were copied."""
        if self.released:
            raise RuntimeError("ExpertOffload: device memory was released; call allocate() first")
        if state.slot_of.shape != self.slot_of.shape:
            raise ValueError(f"restore_state: a state of {state.slot_of.shape} (layers, experts) for a cache of "
                             f"{self.slot_of.shape}")
        self.wait_prefetch()
        # a slot that holds the same expert now as in the state holds its weights already
        stale = (state.slot_of >= 0) & (self.slot_of != state.slot_of)
        self.cache = copy.deepcopy(state.cache)
        self.slot_of[...] = state.slot_of
        self._free_slots = list(state.free_slots)
        for layer, expert in np.argwhere(stale).tolist():
            slot = int(self.slot_of[layer, expert])
            for dst, src in self._slot_pairs(layer, expert, slot):
                dst.copy_(src)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return int(stale.sum())

    # ------------------------------------------------------------------ passes
    def begin_pass(self) -> None:
        """Start counting a new forward pass (timings of a pass never read are dropped unread)."""
        self.counters = OffloadCounters.zeros(self.host.n_layers)
        self._copier.discard()

    def pass_timing(self) -> TransferTiming:
        """Copy timing of the pass begun last (call once it is done; it waits for its copies)."""
        self.last_timing = self._copier.take_timing()
        return self.last_timing

    def pass_transfer_time_s(self) -> float:
        """Seconds the pass begun last stood waiting for host-to-device copies: the exposed
        transfer time the cost model charges (on CPU every copy is exposed)."""
        return self.pass_timing().stall_s

    def layer_experts(self, layer: int, expert_ids: np.ndarray) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Yield ``(expert_id, gate_up [2I, H], down [H, I])`` on the device for each id of
        ``expert_ids`` (the layer's union), in the order they can run: the hits (ascending id),
        then the misses in the order they are copied (those admitted into slots, then the
        streamed ones, each ascending). A consumer that must sum in id order keeps the outputs.

        Misses are admitted into slots (all copied before the first yield, so their copies overlap
        the hits' compute) or, when the layer has no slot left for them, streamed one by one
        through the two staging buffers. A streamed expert's tensors are valid until the consumer
        asks for the next expert.
        """
        if self.released:
            raise RuntimeError("ExpertOffload: device memory was released; call allocate() first")
        admit = self.cache.admit_layer(layer, expert_ids, keep=self.keep)
        self._count(layer, admit)
        copier = self._copier
        admitted = admit.admitted_ids.tolist()
        slots = self._reassign(admit.evicted.tolist(), [(layer, expert) for expert in admitted])
        if slots:
            # slots just freed may still be read by compute already enqueued (an earlier layer or
            # pass): the copies into them wait for it
            copier.record_compute("compute")
            copier.issue([(("slot", slot), self._slot_pairs(layer, expert, slot))
                          for expert, slot in zip(admitted, slots)], after="compute")
        streamed = admit.streamed_ids.tolist()
        n_buffers = self._n_staging
        for i in range(min(len(streamed), n_buffers)):
            self._stage(i, layer, streamed[i])

        for expert in admit.hit_ids.tolist():
            slot = int(self.slot_of[layer, expert])
            yield expert, self.slot_gate_up[slot], self.slot_down[slot]
        for expert, slot in zip(admitted, slots):
            copier.wait(("slot", slot))
            yield expert, self.slot_gate_up[slot], self.slot_down[slot]
        for i, expert in enumerate(streamed):
            buffer = i % n_buffers
            copier.wait(("stage", buffer))
            yield expert, self.staging_gate_up[buffer], self.staging_down[buffer]
            # the consumer has enqueued this expert's compute: the buffer can take the streamed
            # expert after next (double buffering)
            copier.record_compute(("stage_free", buffer))
            if i + n_buffers < len(streamed):
                self._stage(i + n_buffers, layer, streamed[i + n_buffers])

    # ------------------------------------------------------------------ prefetch
    def prefetch(self, mask: np.ndarray, keep: np.ndarray | None = None) -> int:
        """Start copying the experts of ``mask`` (bool [L, E]) into slots ahead of the next pass,
        as the cache's :meth:`~specfit.experts.cache.ExpertCache.prefetch` decides; returns how
        many copies were started. On CUDA they run on the copy stream, elsewhere on a worker
        thread, both beside whatever the caller does next (the drafter); :meth:`wait_prefetch`
        waits for them before the pass that reads the slots."""
        if self.released:
            raise RuntimeError("ExpertOffload: device memory was released; call allocate() first")
        result = self.cache.prefetch(mask, keep)
        admitted = np.argwhere(result.admitted_mask).tolist()
        slots = self._reassign(np.argwhere(result.evicted_mask).tolist(), admitted)
        jobs = [(("slot", slot), self._slot_pairs(layer, expert, slot))
                for (layer, expert), slot in zip(admitted, slots)]
        if not jobs:
            return 0
        if isinstance(self._copier, StreamCopier):
            if not self._prefetch_pending:
                # timings the copier still holds are of a pass nobody read (a prompt's pass):
                # dropped, as begin_pass drops them, so that wait_prefetch times these copies alone
                self._copier.discard()
            # the slots may still be read by compute already enqueued: the copies wait for it
            self._copier.record_compute("compute")
            self._copier.issue(jobs, after="compute")
            self._prefetch_pending.extend(key for key, _ in jobs)
            return len(jobs)
        if self._prefetch_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._prefetch_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specfit-prefetch")

        def copy_all() -> float:
            start = time.perf_counter()
            for _, pairs in jobs:
                for dst, src in pairs:
                    dst.copy_(src)
            return time.perf_counter() - start

        self._prefetch_pending.append(self._prefetch_pool.submit(copy_all))
        return len(jobs)

    def wait_prefetch(self) -> tuple[float, float]:
        """Wait for the prefetch copies in flight; returns (their copy time, how long this call
        waited for them) in seconds: the copy time that did not overlap is the wait."""
        if not self._prefetch_pending:
            return 0.0, 0.0
        if isinstance(self._copier, StreamCopier):
            for key in self._prefetch_pending:
                self._copier.wait(key)
            timing = self._copier.take_timing()       # synchronises the copies and the waits
            copy_s, wait_s = timing.copy_busy_s, timing.stall_s
        else:
            start = time.perf_counter()
            copy_s = sum(f.result() for f in self._prefetch_pending)
            wait_s = time.perf_counter() - start
        self._prefetch_pending.clear()
        return copy_s, wait_s

    # ------------------------------------------------------------------ helpers
    def _reassign(self, evicted, admitted) -> list[int]:
        """Free the slots of the ``evicted`` (layer, expert) pairs first (global mode may evict
        other layers' experts), then give each ``admitted`` pair a free slot; returns those slots."""
        for layer, expert in evicted:
            self._free_slots.append(int(self.slot_of[layer, expert]))
            self.slot_of[layer, expert] = -1
        slots = []
        for layer, expert in admitted:
            slot = self._free_slots.pop()
            self.slot_of[layer, expert] = slot
            slots.append(slot)
        return slots

    def _stage(self, index: int, layer: int, expert: int) -> None:
        buffer = index % self._n_staging
        pairs = self._pairs(layer, expert, self.staging_gate_up[buffer], self.staging_down[buffer])
        self._copier.issue([(("stage", buffer), pairs)], after=("stage_free", buffer))

    def _pairs(self, layer: int, expert: int, gate_up: torch.Tensor, down: torch.Tensor):
        return ((gate_up, self.host.gate_up[layer][expert]), (down, self.host.down[layer][expert]))

    def _slot_pairs(self, layer: int, expert: int, slot: int):
        """The (device, host) tensor pairs that load ``expert`` of ``layer`` into cache slot ``slot``."""
        return self._pairs(layer, expert, self.slot_gate_up[slot], self.slot_down[slot])

    def _count(self, layer: int, admit) -> None:
        c = self.counters
        c.hits[layer] += admit.hits
        c.misses[layer] += admit.misses
        c.streamed[layer] += admit.streamed
        np.add.at(c.evictions, admit.evicted[:, 0], 1)   # global mode charges the layer that lost the expert
        c.bytes_h2d[layer] += admit.misses * self.host.expert_bytes


class CacheTurns:
    """Decoders taking turns on one model, each with its own expert cache: :meth:`take` saves the
    cache of whoever had the model and brings back the new owner's, as it left it (an empty cache
    the first time), so each owner's hits and misses are those of a run of its own."""

    def __init__(self, offload: ExpertOffload):
        self.offload = offload
        self.owner = None
        self.copied = 0                 # experts copied back into their slots, over all turns
        self._saved: dict = {}

    def take(self, owner) -> None:
        if owner == self.owner:
            return
        if self.owner is not None:
            self._saved[self.owner] = self.offload.save_state()
        state = self._saved.pop(owner, None)
        if state is None:
            self.offload.reset()
        else:
            self.copied += self.offload.restore_state(state)
        self.owner = owner
