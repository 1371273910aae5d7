"""The CUDA paths' logic, checked on the CPU: what gets pinned, which stream and device every
call uses, how many events and synchronising calls a pass makes, what the probes allocate.

Nothing here needs a GPU: the CUDA runtime's entry points are replaced by recording fakes, and the
code under test is the same code that runs on CUDA.
"""

from __future__ import annotations

import gc

import pytest
import torch

from specfit.calibrate.standin import SHAPE_CONFIGS, shape_config
from specfit.runtime.copier import HostCopier, StreamCopier, TransferTiming
from specfit.runtime.offload import HostExperts
from specfit.runtime.pinned import PAGE_BYTES


class RecordingRegistrar:
    """Stands in for cudaHostRegister / cudaHostUnregister: records the ranges."""

    def __init__(self):
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []

    def register(self, ptr, nbytes):
        for other, size in self.registered.items():
            assert ptr + nbytes <= other or other + size <= ptr, "registrations overlap"
        self.registered[ptr] = nbytes

    def unregister(self, ptr):
        assert ptr in self.registered
        self.unregistered.append(ptr)


# ----------------------------------------------------------------- pinned host memory
def test_pinned_experts_lock_their_own_bytes_page_aligned():
    registrar = RecordingRegistrar()
    # odd sizes, so no matrix is a whole number of pages
    host = HostExperts(3, 5, hidden_size=37, intermediate_size=11, dtype=torch.bfloat16, registrar=registrar)
    assert host.pinned
    tensors = host.gate_up + host.down
    assert len(registrar.registered) == len(tensors) == 6
    for tensor in tensors:
        ptr = tensor.data_ptr()
        assert ptr % PAGE_BYTES == 0 and ptr in registrar.registered
        assert tensor.nbytes <= registrar.registered[ptr] < tensor.nbytes + PAGE_BYTES
        assert tensor.is_contiguous()
    assert host.pinned_bytes == sum(registrar.registered.values())
    assert 0 <= host.pinned_bytes - host.nbytes < PAGE_BYTES * len(tensors)
    assert host.pinned_bytes == HostExperts.planned_pinned_bytes(3, 5, 37, 11, torch.bfloat16)
    # the tensors are usable memory of the right layout
    host.gate_up[2].fill_(1.5)
    host.down[0].zero_()
    host.down[0][4].fill_(-2.0)
    assert bool((host.gate_up[2] == 1.5).all()) and bool((host.down[0][4] == -2.0).all())
    assert not bool((host.down[0][3] == -2.0).all())
    del host, tensors, tensor
    gc.collect()
    assert sorted(registrar.unregistered) == sorted(registrar.registered)


def test_unpinned_experts_register_nothing():
    host = HostExperts(2, 4, 8, 4, torch.float32)
    assert not host.pinned and host.pinned_bytes == 0
    assert host.nbytes == 2 * 4 * 3 * 8 * 4 * 4


@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "mixtral-8x7b", "olmoe-1b-7b"])
def test_planned_pinned_bytes_of_full_models_equal_their_expert_bytes(shape):
    config = shape_config(shape)
    L, E, H, I = config.n_layers, config.n_experts, config.hidden_size, config.expert_intermediate_size
    checkpoint_bytes = L * E * 3 * H * I * 2          # bf16 gate, up and down of every expert
    planned = HostExperts.planned_pinned_bytes(L, E, H, I, torch.bfloat16)
    assert 0 <= planned - checkpoint_bytes < PAGE_BYTES * 2 * L
    # what the caching host allocator's power-of-two blocks would have locked
    def pow2(n):
        return 1 << (n - 1).bit_length()
    rounded = L * (pow2(E * 2 * I * H * 2) + pow2(E * H * I * 2))
    if shape != "olmoe-1b-7b":
        assert rounded > 1.1 * checkpoint_bytes       # 72 vs 54 GiB, 96 vs 84 GiB
    assert SHAPE_CONFIGS[shape]["hidden_size"] == H


# ----------------------------------------------------------------- a stand-in for torch.cuda
class FakeStream:
    def __init__(self, cuda, name, device):
        self.cuda, self.name, self.device, self.clock_ms = cuda, name, device, 0.0

    def wait_event(self, event):
        assert event.recorded_on is not None, "waiting on an event never recorded"
        self.cuda.log.append(("wait", self.name, event.id, event.recorded_on))
        self.clock_ms = max(self.clock_ms, event.time_ms)


class FakeEvent:
    def __init__(self, cuda, index, enable_timing):
        self.cuda, self.id, self.timing = cuda, index, enable_timing
        self.recorded_on, self.time_ms = None, 0.0

    def record(self, stream):
        assert stream is not None, "an event recorded on the current stream of no device"
        self.recorded_on, self.time_ms = stream.name, stream.clock_ms
        self.cuda.log.append(("record", stream.name, self.id, self.timing))

    def elapsed_time(self, other):
        assert self.timing and other.timing
        return other.time_ms - self.time_ms

    def synchronize(self):
        self.cuda.log.append(("event_synchronize", self.id))


class FakeCuda:
    """``torch.cuda``'s Stream / Event / current_stream / stream, on a toy timeline: each copy
    takes ``copy_ms`` on the stream that is current when it is enqueued; :meth:`compute` advances
    the compute stream as a consumer's kernels would."""

    def __init__(self, copy_ms=1.0):
        self.copy_ms = copy_ms
        self.log, self.events, self.streams, self.devices_asked = [], [], [], []
        self._compute, self._current = {}, []

    def Stream(self, device=None):
        assert device is not None, "a stream of no particular device"
        stream = FakeStream(self, f"copy{len(self.streams)}", device)
        self.streams.append(stream)
        return stream

    def Event(self, enable_timing=False):
        event = FakeEvent(self, len(self.events), enable_timing)
        self.events.append(event)
        return event

    def compute_stream(self, device):
        return self._compute.setdefault(str(device), FakeStream(self, "compute", device))

    def current_stream(self, device=None):
        self.devices_asked.append(device)
        return self._current[-1] if self._current else self.compute_stream(device)

    def stream(self, stream):
        cuda = self

        class Context:
            def __enter__(self):
                cuda._current.append(stream)

            def __exit__(self, *exc):
                cuda._current.pop()

        return Context()

    def on_copy(self, non_blocking):
        stream = self._current[-1] if self._current else None
        self.log.append(("copy", stream.name if stream else None, non_blocking))
        if stream is not None:
            stream.clock_ms += self.copy_ms

    def compute(self, device, ms):
        self.compute_stream(device).clock_ms += ms


@pytest.fixture
def fake_cuda(monkeypatch):
    cuda = FakeCuda()
    copy = torch.Tensor.copy_

    def logged_copy(self, src, non_blocking=False):
        cuda.on_copy(non_blocking)
        return copy(self, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", logged_copy)
    return cuda


def _host(n_layers=2, n_experts=6, seed=0):
    torch.manual_seed(seed)
    host = HostExperts(n_layers, n_experts, hidden_size=4, intermediate_size=3, dtype=torch.float32)
    for tensor in host.gate_up + host.down:
        tensor.normal_()
    return host


def _consume(offload, layer, ids, cuda=None, compute_ms=0.0):
    """Run a layer as the MoE block does: take each expert, 'compute' it, return the order."""
    order = []
    for expert, gate_up, down in offload.layer_experts(layer, np.asarray(ids)):
        assert torch.equal(gate_up, offload.host.gate_up[layer][expert])
        assert torch.equal(down, offload.host.down[layer][expert])
        order.append(expert)
        if cuda is not None:
            cuda.compute(offload.device, compute_ms)
    return order


import numpy as np  # noqa: E402

from specfit.runtime.offload import ExpertOffload  # noqa: E402


def test_hits_run_before_misses_and_misses_in_copy_order(fake_cuda):
    offload = ExpertOffload(_host(1, 8), capacity=3, cuda_api=fake_cuda)
    offload.begin_pass()
    assert _consume(offload, 0, [5, 6]) == [5, 6]               # two misses, admitted
    offload.pass_timing()
    offload.begin_pass()
    # 0 and 1 are misses (0 admitted, 1 streamed: only one slot is free of the union), 5 and 6 hits
    assert _consume(offload, 0, [6, 0, 5, 1, 7]) == [5, 6, 0, 1, 7]
    assert offload.counters.hits.tolist() == [2] and offload.counters.streamed.tolist() == [2]


def test_a_low_id_miss_no_longer_holds_the_hits_behind_its_copy(fake_cuda):
    """Toy timeline: a copy takes 1 ms, each expert's compute 3 ms. The miss (expert 0) is
    copied while the hits (5, 6) compute, so compute never waits for it."""
    offload = ExpertOffload(_host(1, 8), capacity=3, cuda_api=fake_cuda)
    _consume(offload, 0, [5, 6], fake_cuda, compute_ms=3.0)
    offload.pass_timing()
    offload.begin_pass()
    assert _consume(offload, 0, [0, 5, 6], fake_cuda, compute_ms=3.0) == [5, 6, 0]
    timing = offload.pass_timing()
    assert timing.stall_s == 0.0                 # ascending order would have waited 2 ms for it
    assert timing.copy_busy_s == pytest.approx(2e-3) and timing.n_bursts == 1 and timing.n_waits == 1


@pytest.mark.parametrize("compute_ms,stall_ms", [(0.0, 8.0), (1.5, 3.5)])
def test_the_stall_is_the_time_compute_waits_for_copies(fake_cuda, compute_ms, stall_ms):
    """Capacity 2 of 6 experts, a union of 4: two experts admitted (one burst of 4 copies), two
    streamed (a burst each); copies land at 2, 4 (slots), 6 and 8 ms (staging buffers). With no
    compute, compute waits until 8 ms; with 1.5 ms per expert it waits 2 + 0.5 + 0.5 + 0.5 ms."""
    offload = ExpertOffload(_host(1, 6), capacity=2, cuda_api=fake_cuda)
    offload.begin_pass()
    assert _consume(offload, 0, [0, 1, 2, 3], fake_cuda, compute_ms) == [0, 1, 2, 3]
    timing = offload.pass_timing()
    assert timing.stall_s == pytest.approx(stall_ms / 1e3)
    assert timing.copy_busy_s == pytest.approx(8e-3)
    assert (timing.n_bursts, timing.n_waits) == (3, 4)


def test_every_stream_and_event_call_names_the_offload_device(fake_cuda):
    offload = ExpertOffload(_host(2, 6), capacity=2, cuda_api=fake_cuda)
    rng = np.random.default_rng(0)
    for _ in range(5):
        offload.begin_pass()
        for layer in range(2):
            _consume(offload, layer, rng.choice(6, size=int(rng.integers(1, 7)), replace=False))
        offload.pass_timing()
    assert fake_cuda.devices_asked and all(d == offload.device for d in fake_cuda.devices_asked)
    assert [s.device for s in fake_cuda.streams] == [offload.device]
    copies = [entry for entry in fake_cuda.log if entry[0] == "copy"]
    assert copies and all(entry[1:] == ("copy0", True) for entry in copies)   # async, on the copy stream
    for _, stream, _event, recorded_on in (e for e in fake_cuda.log if e[0] == "wait"):
        # compute waits for copies; the copy stream waits only for compute (buffers being read)
        assert {stream, recorded_on} == {"compute", "copy0"}


def test_events_come_from_a_pool_and_one_timing_pair_brackets_each_burst(fake_cuda):
    L, E, C = 3, 8, 2
    offload = ExpertOffload(_host(L, E), capacity=C, cuda_api=fake_cuda)
    rng = np.random.default_rng(1)
    made_after = []
    for _ in range(12):
        offload.begin_pass()
        start = len(fake_cuda.log)
        n_missed = 0
        for layer in range(L):
            ids = rng.choice(E, size=E // 2 + int(rng.integers(0, E // 2)), replace=False)
            _consume(offload, layer, ids)
        n_missed = int(offload.counters.misses.sum())
        timing = offload.pass_timing()
        made_after.append(len(fake_cuda.events))
        records = [e for e in fake_cuda.log[start:] if e[0] == "record"]
        timed_on_copy = [e for e in records if e[1] == "copy0" and e[3]]
        assert len(timed_on_copy) == 2 * timing.n_bursts
        assert timing.n_waits == n_missed                         # one timed wait per copied expert
        assert sum(1 for e in records if e[3]) == 2 * (timing.n_bursts + timing.n_waits)
        assert timing.n_bursts <= L + n_missed                    # one burst per layer plus staged refills
    # the pool stops growing: markers per slot / staging buffer and the largest pass's timers
    n_markers = L * C + 2 * 2 + 1
    assert made_after[-1] == made_after[-4]
    assert made_after[-1] <= n_markers + 2 * (L + 2 * L * E)


def test_stream_copier_outputs_equal_the_host_copier_bit_for_bit(fake_cuda):
    from specfit.calibrate.standin import random_model

    config = shape_config("tiny", 2)
    expected_model = random_model(config, torch.device("cpu"), torch.float32, cache_experts=3, seed=2)
    model = random_model(config, torch.device("cpu"), torch.float32, cache_experts=3, seed=2)
    model.attach_offload(ExpertOffload(model.offload.host, 3, cuda_api=fake_cuda))
    for m in (expected_model, model):
        m.setup_kv_cache(64)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, 12)
    for step in range(4):
        n = 12 + step
        tokens = ids if step == 0 else np.array([step * 7 % config.vocab_size])
        positions = np.arange(n - tokens.size, n)
        a, b = expected_model(tokens, positions), model(tokens, positions)
        assert torch.equal(a.logits, b.logits)
        np.testing.assert_array_equal(a.expert_ids, b.expert_ids)
        assert a.offload.misses.tolist() == b.offload.misses.tolist()
        assert model.offload.pass_timing().n_waits == int(b.offload.misses.sum())


# ----------------------------------------------------------------- synchronising calls
SYNCING_METHODS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")


@pytest.fixture
def sync_counter(monkeypatch):
    """Counts every call that synchronises host and device on CUDA (a tensor read back to the
    host, torch.equal, torch.cuda.synchronize) outside the runtime's two sanctioned helpers:
    ``to_host`` (counted apart) and ``upload`` (non-blocking, counted apart)."""
    import specfit.runtime.model as model_module

    counts = {"other": [], "to_host": 0, "upload": 0}
    inside = [False]

    def hook(name, original):
        def wrapper(*args, **kwargs):
            if not inside[0]:
                counts["other"].append(name)
            return original(*args, **kwargs)
        return wrapper

    for name in SYNCING_METHODS:
        monkeypatch.setattr(torch.Tensor, name, hook(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch, "equal", hook("torch.equal", torch.equal))

    def names_a_device(args, kwargs):
        return "device" in kwargs or any(isinstance(a, (torch.device, str)) for a in args)

    def device_hook(name, original):
        # a host-to-device copy (from pageable memory on CUDA: a copy plus a synchronisation)
        def wrapper(*args, **kwargs):
            if not inside[0] and names_a_device(args[1:] if name == "Tensor.to" else (), kwargs):
                counts["other"].append(name)
            return original(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(torch.Tensor, "to", device_hook("Tensor.to", torch.Tensor.to))
    monkeypatch.setattr(torch, "tensor", device_hook("torch.tensor", torch.tensor))
    monkeypatch.setattr(torch, "as_tensor", device_hook("torch.as_tensor", torch.as_tensor))
    monkeypatch.setattr(torch.cuda, "synchronize", hook("torch.cuda.synchronize", torch.cuda.synchronize))

    def sanctioned(key, original):
        def wrapper(*args, **kwargs):
            counts[key] += 1
            inside[0] = True
            try:
                return original(*args, **kwargs)
            finally:
                inside[0] = False
        return wrapper

    monkeypatch.setattr(model_module, "to_host", sanctioned("to_host", model_module.to_host))
    monkeypatch.setattr(model_module, "upload", sanctioned("upload", model_module.upload))
    counts["start"] = lambda: (counts.update(to_host=0, upload=0), counts["other"].clear())
    return counts


@pytest.mark.parametrize("capacity", [0, 2, 16])
def test_a_pass_synchronises_once_per_moe_layer(fake_cuda, sync_counter, capacity):
    """Routing to the host is the one read-back per MoE layer; each layer uploads its sorted
    token-expert index once and the pass uploads ids, positions, mask and rows once."""
    from specfit.calibrate.standin import random_model
    from specfit.tree import DraftTree

    config = shape_config("tiny", 3)
    model = random_model(config, torch.device("cpu"), torch.float32, seed=1)
    model.attach_offload(ExpertOffload(model.offload.host, capacity, cuda_api=fake_cuda))
    model.setup_kv_cache(64)
    prompt = np.arange(10) % config.vocab_size
    model(prompt, np.arange(10))
    tree = DraftTree(parents=np.array([-1, 0, 0, 1, 1, 2]), path_probs=np.linspace(1, 0.5, 6),
                     tokens=np.array([3, 1, 4, 1, 5, 9]))
    mask = np.concatenate([np.ones((6, 10), dtype=bool), tree.attention_mask()], axis=1)
    for logits_rows in (None, [0, 3]):
        sync_counter["start"]()
        out = model(tree.tokens, tree.positions(10), mask, logits_rows=logits_rows)
        assert sync_counter["other"] == []
        assert sync_counter["to_host"] == config.n_layers
        assert sync_counter["upload"] == config.n_layers + 1
        assert out.logits.shape[0] == (6 if logits_rows is None else 2)
    sync_counter["start"]()
    model(np.array([7]), np.array([10]))                      # a linear step, no mask given
    assert sync_counter["other"] == [] and sync_counter["upload"] == config.n_layers + 1
    sync_counter["start"]()
    model.compact_kv(10, np.array([0, 1, 3]))
    # the moved slots' indices are uploaded at most once (a model on the host copies with them as
    # they are), and nothing else synchronises
    assert sync_counter["other"] == [] and sync_counter["upload"] <= 1


# ----------------------------------------------------------------- rotary frequencies in bf16
def _reference_angles(positions, head_dim, theta):
    """float64 ``position * theta ** (-2i / head_dim)``, from the RoPE definition."""
    i = np.arange(0, head_dim, 2, dtype=np.float64)
    return np.asarray(positions, dtype=np.float64)[:, None] * theta ** (-i / head_dim)


def test_drafter_rotary_angles_in_bf16_equal_float32_at_position_4000():
    from specfit.runtime.eagle3 import Eagle3Config, Eagle3Drafter

    # Qwen3-30B-A3B's rotary shape: head_dim 128, theta 1e6
    config = Eagle3Config(hidden_size=128, target_hidden_size=128, vocab_size=100, draft_vocab_size=100,
                          num_attention_heads=1, num_key_value_heads=1, head_dim=128, intermediate_size=96,
                          rope_theta=1e6, max_position_embeddings=8192)
    positions = torch.tensor([0, 100, 1000, 4000])
    reference = _reference_angles(positions, config.head_dim, config.rope_theta)
    float32 = Eagle3Drafter(config)
    bf16 = Eagle3Drafter(config).to(dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and bf16.inv_freq.dtype == torch.float32
    assert torch.equal(bf16.inv_freq, float32.inv_freq)
    angles = bf16.rope_angles(positions).double().numpy()
    assert np.abs(angles - float32.rope_angles(positions).double().numpy()).max() <= 1e-3
    assert np.abs(angles - reference).max() <= 1e-3
    # what rounding the frequencies to bf16 would do at position 4000
    rounded = 4000 * float32.inv_freq.to(torch.bfloat16).double().numpy()
    assert np.abs(rounded - reference[-1]).max() > 4.0
    cos, sin = bf16.rope(positions)
    assert cos.dtype == torch.bfloat16
    bf16_step = 2.0 ** -8                                  # bf16's rounding of values in [-1, 1]
    assert np.abs(cos[:, : config.head_dim // 2].double().numpy() - np.cos(reference)).max() <= bf16_step
    assert np.abs(sin[:, : config.head_dim // 2].double().numpy() - np.sin(reference)).max() <= bf16_step


def test_target_rotary_frequencies_stay_float32_when_the_model_is_cast():
    from specfit.calibrate.standin import random_model

    config = shape_config("tiny", 1)
    model = random_model(config, torch.device("cpu"), torch.float32)
    expected = model.rotary.inv_freq.clone()
    model.to(torch.bfloat16)
    assert model.dtype == torch.bfloat16 and model.rotary.inv_freq.dtype == torch.float32
    assert torch.equal(model.rotary.inv_freq, expected)
    angles = (4000 * model.rotary.inv_freq).double().numpy()
    assert np.abs(angles - _reference_angles([4000], config.head_dim, config.rope_theta)[0]).max() <= 1e-3


# ----------------------------------------------------------------- calibration probes
def _tracked_offloads(monkeypatch, original):
    """Patch the probes' ExpertOffload to record, at every allocation, the device bytes that all
    offloads (the model's own included) hold together."""
    import specfit.calibrate.cycles as cycles

    made, together = [original], []

    class Tracked(ExpertOffload):
        def allocate(self):
            super().allocate()
            if self not in made:
                made.append(self)
            together.append(sum(o.device_bytes for o in made))

    monkeypatch.setattr(cycles, "ExpertOffload", Tracked)
    return made, together


def _probe_model(cache_experts):
    from specfit.calibrate.standin import random_model

    return random_model(shape_config("tiny", 2), torch.device("cpu"), torch.float32, cache_experts=cache_experts, seed=4)


def test_probe_caches_hold_at_most_one_offload_at_a_time(monkeypatch):
    from specfit.calibrate.cycles import probe_cycles

    model = _probe_model(cache_experts=8)
    original = model.offload
    before_bytes = original.device_bytes
    model.setup_kv_cache(64)
    ids = np.arange(9) % 97
    expected = model(ids, np.arange(9)).logits
    made, together = _tracked_offloads(monkeypatch, original)
    rows = probe_cycles(model, [0, 8, 16], node_counts=(1, 3), repeats=1, context_len=8)
    assert sorted({r["capacity"] for r in rows}) == [0, 8, 16]
    largest = max(o.planned_device_bytes for o in made)
    assert len(made) == 4 and max(together) <= largest
    assert all(o.device_bytes == 0 for o in made[1:])          # every probe cache released
    assert model.offload is original and original.device_bytes == before_bytes and not original.released
    original.reset()
    assert torch.equal(model(ids, np.arange(9)).logits, expected)
    for row in rows:
        assert row["transfer_stall_s"] >= 0 and row["copy_busy_s"] >= 0
        assert row["seconds"] > 0 and row["hits"] + row["misses"] > 0


def test_probe_cache_sizes_fit_the_free_device_memory(monkeypatch):
    import specfit.calibrate.cycles as cycles

    model = _probe_model(cache_experts=4)
    host = model.offload.host
    L, eb = host.n_layers, host.expert_bytes
    # room for 5 experts per layer plus the two staging buffers, beyond the reserve
    monkeypatch.setattr(cycles, "free_device_bytes", lambda device: cycles.PROBE_RESERVE_BYTES + (5 * L + 2) * eb)
    made, together = _tracked_offloads(monkeypatch, model.offload)
    rows = cycles.probe_cycles(model, [0, 4, 8, 16], node_counts=(2,), repeats=1, context_len=8)
    assert sorted({r["capacity"] for r in rows}) == [0, 4, 5]
    assert max(together) <= (5 * L + 2) * eb


@pytest.mark.parametrize("budget_experts", [None, 2, 3, 9, 2 * 16 + 1, 2 * 16 + 2, 10**6])
def test_fit_capacities_takes_the_largest_cache_that_fits(budget_experts):
    from specfit.calibrate.cycles import fit_capacities

    L, E, eb = 2, 16, 1000
    wanted = [0, 4, 8, 16, 30]
    budget = None if budget_experts is None else budget_experts * eb
    got = fit_capacities(wanted, L, E, eb, budget)

    def fits(c):   # slots, plus two staging buffers unless every expert has a slot
        return budget is None or (c * L + (2 if c < E else 0)) * eb <= budget

    largest = max(c for c in range(E + 1) if fits(c))
    assert got == sorted({min(c, E, largest) for c in wanted})
    assert all(fits(c) for c in got)


def test_fit_capacities_refuses_a_device_without_room_for_staging():
    from specfit.calibrate.cycles import fit_capacities
    from specfit.errors import SpecFitError

    with pytest.raises(SpecFitError, match="staging"):
        fit_capacities([0, 4], 2, 16, 1000, 1999)


def test_hit_probe_times_the_moe_blocks_own_expert_body(monkeypatch):
    import specfit.calibrate.probes as probes

    calls = []
    original = probes.expert_output

    def counted(x, weights, index, gate_up, down):
        calls.append((x.shape[0], index.shape))
        return original(x, weights, index, gate_up, down)

    monkeypatch.setattr(probes, "expert_output", counted)
    added = []
    index_add = torch.Tensor.index_add_
    monkeypatch.setattr(torch.Tensor, "index_add_", lambda self, *a: added.append(a[1].numel()) or index_add(self, *a))
    rows = probes.probe_expert_compute(16, 8, torch.float32, torch.device("cpu"), token_counts=(1, 4), repeats=3)
    assert [r["tokens"] for r in rows] == [1, 4] and all(r["seconds"] > 0 for r in rows)
    # 2 warm-up + 3 timed runs per row, each the body and its index_add_ over the row's tokens
    assert [n for n, _ in calls] == [1] * 5 + [4] * 5 and added == [1] * 5 + [4] * 5
    assert [shape for _, shape in calls][-1] == (2, 4)
    assert set(probes.MEASURES) >= {"h2d", "expert_compute", "cycles", "draft"}


# ----------------------------------------------------------------- --device
def test_resolve_device_names_an_explicit_cuda_index(monkeypatch):
    from specfit.errors import SpecFitError
    from specfit.runtime.devices import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SpecFitError, match="no CUDA device is available"):
        resolve_device("cuda:0")
    with pytest.raises(SpecFitError, match="expected cpu, cuda or cuda:N"):
        resolve_device("gpu")
    with pytest.raises(SpecFitError, match="the runtime supports no other device"):
        resolve_device("meta")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device("cuda") == torch.device("cuda", 1)      # never "the current one" later
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(SpecFitError, match=r"2 CUDA device\(s\), cuda:0..cuda:1"):
        resolve_device("cuda:2")


def test_experts_drawn_elsewhere_are_copied_in_whole_blocks_within_the_bound():
    """On a GPU the stand-in's experts are drawn on the device a block at a time and copied into
    pinned host memory: every expert of every block is written, in bounds, none a copy of another."""
    from specfit.calibrate.standin import _fill_host

    tensor = torch.full((7, 6, 40), float("nan"))
    expert_bytes = tensor[0].nbytes
    _fill_host(tensor, torch.Generator().manual_seed(3), block_bytes=2 * expert_bytes + 1, blocks=True)
    bound = (3.0 / 40) ** 0.5
    assert not bool(tensor.isnan().any()) and float(tensor.abs().max()) <= bound
    assert float(tensor.std()) == pytest.approx(bound / 3 ** 0.5, rel=0.1)
    flat = tensor.reshape(7, -1)
    assert all(not torch.equal(flat[i], flat[j]) for i in range(7) for j in range(i))
    # one generator's draws, in the same order, whether in place or a block at a time
    same = torch.empty_like(tensor)
    assert torch.equal(_fill_host(same, torch.Generator().manual_seed(3)), tensor)


def test_caches_taking_turns_hand_each_run_its_experts_on_the_copy_stream_path(fake_cuda):
    """Two runs alternating on one offload through CacheTurns, with the stream copier: every
    expert each layer hands out holds its host weights (``_consume`` checks), and each run hits
    pass by pass as it did alone."""
    from specfit.runtime.offload import CacheTurns

    L, E, C = 2, 8, 3
    rng = np.random.default_rng(3)
    runs = {r: [[rng.choice(E, size=int(rng.integers(1, 5)), replace=False) for _ in range(L)] for _ in range(6)]
            for r in "ab"}

    def one_pass(offload, layers):
        offload.begin_pass()
        for layer, ids in enumerate(layers):
            _consume(offload, layer, ids)
        hits = offload.counters.hits.copy()
        offload.pass_timing()
        return hits

    expected = {}
    for r in "ab":
        alone = ExpertOffload(_host(L, E), capacity=C, cuda_api=fake_cuda)
        expected[r] = [one_pass(alone, layers) for layers in runs[r]]
    offload = ExpertOffload(_host(L, E), capacity=C, cuda_api=fake_cuda)
    turns = CacheTurns(offload)
    got = {r: [] for r in "ab"}
    for i in range(6):
        for r in "ab":
            turns.take(r)
            got[r].append(one_pass(offload, runs[r][i]))
    assert turns.copied > 0
    for r in "ab":
        assert all(np.array_equal(g, e) for g, e in zip(got[r], expected[r], strict=True))


def test_a_copy_into_an_evicted_slot_waits_for_the_compute_that_read_it(fake_cuda):
    cuda = fake_cuda
    offload = ExpertOffload(_host(1, 4), capacity=1, cuda_api=cuda)
    offload.begin_pass()
    _consume(offload, 0, [0], cuda, compute_ms=3.0)          # expert 0 into the layer's one slot, read for 3 ms
    offload.pass_timing()
    offload.begin_pass()
    start = len(cuda.log)
    _consume(offload, 0, [1], cuda, compute_ms=3.0)          # expert 1 evicts it and takes its slot
    log = cuda.log[start:]
    waits = [i for i, e in enumerate(log) if e[0] == "wait" and e[1] == "copy0" and e[3] == "compute"]
    copies = [i for i, e in enumerate(log) if e[0] == "copy"]
    assert copies and waits and waits[0] < copies[0]         # the copy stream waits for that compute first
    assert cuda.streams[0].clock_ms >= 3.0 + 2 * cuda.copy_ms   # so expert 1's two tensors land after it


@pytest.mark.parametrize("layers,experts,hidden,inter", [(3, 5, 37, 11), (2, 1, 37, 29), (1, 3, 64, 33)])
def test_planned_pinned_bytes_round_each_matrix_to_pages_as_pinning_does(layers, experts, hidden, inter):
    """The plan rounds each layer's gate_up and down up to whole pages on their own (each is one
    registration), so it equals what pinning the experts locks for any shape."""
    registrar = RecordingRegistrar()
    host = HostExperts(layers, experts, hidden, inter, torch.float32, registrar=registrar)
    assert HostExperts.planned_pinned_bytes(layers, experts, hidden, inter, torch.float32) == host.pinned_bytes
    if PAGE_BYTES == 4096 and (layers, experts, hidden, inter) == (2, 1, 37, 29):
        # gate_up: 2*29*37*4 = 8584 B -> 3 pages; down: 37*29*4 = 4292 B -> 2 pages; per layer 5 pages
        assert host.pinned_bytes == 2 * 5 * 4096


def test_host_copier_timing_covers_one_pass_and_starts_again_from_zero():
    copier = HostCopier()
    src, dst = torch.arange(1000, dtype=torch.float32), torch.zeros(1000)
    copier.issue([(("slot", 0), [(dst, src)])])
    copier.issue([(("slot", 1), [(dst, src)])])
    first = copier.take_timing()
    assert first.n_bursts == 2 and first.n_waits == 0
    assert first.stall_s == first.copy_busy_s >= 0.0
    assert torch.equal(dst, src)
    assert copier.take_timing() == TransferTiming.zero()      # the next pass copied nothing
    copier.issue([(("slot", 0), [(dst, src)])])
    assert copier.take_timing().n_bursts == 1


def test_stream_copier_waits_for_the_last_burst_and_the_last_wait_to_end_before_reading_timers():
    cuda = FakeCuda(copy_ms=1.0)
    copier = StreamCopier(torch.device("cpu"), api=cuda)
    src, dst = torch.ones(4), torch.zeros(4)
    copier.issue([(("slot", 0), [(dst, src)])])
    copier.wait(("slot", 0))
    copier.issue([(("slot", 1), [(dst, src)])])
    copier.wait(("slot", 1))
    timing_events = [e for e in cuda.events if e.timing]
    # timers in the order they were taken: burst 1 (begin, end), wait 1 (before, after), burst 2, wait 2
    burst2_end, wait2_after = timing_events[5], timing_events[7]
    start = len(cuda.log)
    timing = copier.take_timing()
    synced = [entry[1] for entry in cuda.log[start:] if entry[0] == "event_synchronize"]
    assert sorted(synced) == sorted([burst2_end.id, wait2_after.id])
    assert timing.n_bursts == 2 and timing.n_waits == 2


def test_a_prefetch_after_a_pass_nobody_timed_waits_and_copies_for_its_own_experts_alone(fake_cuda):
    """The decoder reads no timing of the prompt's pass: the first cycle's prefetch, on the copy
    stream, is timed by itself (one expert, two copies of 1 ms), not with the prompt pass's
    copies and waits, which the prefetcher would learn its overlap from."""
    offload = ExpertOffload(_host(2, 8), capacity=3, cuda_api=fake_cuda)
    offload.begin_pass()
    for layer in range(2):
        _consume(offload, layer, [0, 1, 2, 3, 4, 5])           # misses, admitted and streamed
    assert int(offload.counters.misses.sum()) == 12
    mask = np.zeros((2, 8), dtype=bool)
    mask[0, 7] = True
    assert offload.prefetch(mask) == 1
    copy_s, wait_s = offload.wait_prefetch()
    assert copy_s == pytest.approx(2e-3) and wait_s == pytest.approx(2e-3)
    # a second prefetch before the wait is timed with the first
    offload.begin_pass()
    _consume(offload, 1, [0, 1, 2, 3])
    for expert in (6, 7):
        mask = np.zeros((2, 8), dtype=bool)
        mask[1, expert] = True
        assert offload.prefetch(mask) == 1
    assert offload.wait_prefetch()[0] == pytest.approx(4e-3)


def test_the_decoders_clock_waits_for_compute_not_for_copies_in_flight(fake_cuda, monkeypatch):
    """A clock read right after a prefetch burst is enqueued (the decoder reads one before each
    draft level) waits for the compute stream alone: waiting for the device, copy stream
    included, would hold the drafter back until the prefetch copies landed, so they never
    overlapped it. ``torch.cuda.synchronize`` stands in as waiting for every stream, as it does."""
    from specfit.runtime.decoder import device_clock

    offload = ExpertOffload(_host(1, 8), capacity=3, cuda_api=fake_cuda)
    mask = np.zeros((1, 8), dtype=bool)
    mask[0, [5, 6]] = True
    assert offload.prefetch(mask) == 2
    copy_stream = fake_cuda.streams[0]
    assert copy_stream.clock_ms == 4.0                     # four copies in flight
    fake_cuda.compute(offload.device, 1.0)                 # and a millisecond of compute
    waited = []
    monkeypatch.setattr(FakeStream, "synchronize", lambda self: waited.append((self.name, self.device)), raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream", fake_cuda.current_stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.extend(
        [(s.name, s.device) for s in fake_cuda.streams] + [("compute", device)]))
    device = torch.device("cuda", 1)
    now = device_clock(device)
    now()
    assert waited == [("compute", device)]
    offload.wait_prefetch()


@pytest.mark.parametrize("stream_copier", [False, True])
def test_an_offload_allocated_in_inference_mode_takes_prefetches_and_turns_outside_it(fake_cuda, stream_copier):
    """A calibration's probes reallocate the model's expert cache inside inference mode (a
    stand-in is built inside it): a prefetch (a worker thread on the CPU, the copy stream on
    CUDA, both outside it) and a cache's turn restored still copy into its slots."""
    from specfit.runtime.offload import CacheTurns

    host = _host(2, 8)
    with torch.inference_mode():
        offload = ExpertOffload(host, capacity=3, cuda_api=fake_cuda if stream_copier else None)
        offload.release()
        offload.allocate()
    mask = np.zeros((2, 8), dtype=bool)
    mask[:, [1, 6]] = True
    assert offload.prefetch(mask) == 4
    offload.wait_prefetch()
    for layer in range(2):
        slot = offload.slot_of[layer, 6]
        assert torch.equal(offload.slot_gate_up[slot], host.gate_up[layer][6])
    turns = CacheTurns(offload)
    turns.take("a")
    _consume(offload, 0, [2, 3])
    turns.take("b")
    _consume(offload, 0, [4, 5, 7])                           # b's experts take a's slots
    turns.take("a")
    assert turns.copied == 2
    assert _consume(offload, 0, [2, 3]) == [2, 3] and offload.counters.hits[0] == 2
