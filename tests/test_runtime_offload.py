"""Expert offload: counters, slot table, streaming, capacity 0 and "all experts"."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime_fixtures import N_EXPERTS, N_LAYERS, VOCAB, make_tiny_model
from runtime_fixtures import torch_single_thread  # noqa: F401  (autouse: one intra-op thread)
from specfit.runtime.loader import load_model
from specfit.runtime.offload import ExpertOffload, HostExperts

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("qwen3_moe", tmp_path_factory.mktemp("offload"))


def _model(model_dir, cache_experts, **kwargs):
    model = load_model(model_dir, cache_experts=cache_experts, **kwargs)
    model.setup_kv_cache(64)
    return model


def _decode_passes(model, n_prompt=6, n_steps=8, seed=0):
    """A prefill and ``n_steps`` greedy single-token passes; yields each pass's output."""
    ids = torch.randint(0, VOCAB, (n_prompt,), generator=torch.Generator().manual_seed(seed))
    out = model(ids, torch.arange(n_prompt), logits_rows=[-1])
    yield out
    for step in range(n_steps):
        token = out.logits[-1].argmax().reshape(1)
        out = model(token, torch.tensor([n_prompt + step]))
        yield out


def _check_slots(offload: ExpertOffload) -> None:
    """Resident experts have distinct slots holding exactly their host weights; others have none."""
    resident = offload.cache.resident()
    assert np.array_equal(offload.slot_of >= 0, resident)
    slots = offload.slot_of[resident]
    assert len(set(slots.tolist())) == slots.size
    for layer, expert in np.argwhere(resident):
        slot = offload.slot_of[layer, expert]
        assert torch.equal(offload.slot_gate_up[slot], offload.host.gate_up[layer][expert])
        assert torch.equal(offload.slot_down[slot], offload.host.down[layer][expert])


@pytest.mark.parametrize("cache_experts", [0, 1, 3, N_EXPERTS])
def test_counters_match_the_routed_unions(model_dir, cache_experts):
    model = _model(model_dir, cache_experts)
    offload = model.offload
    expert_bytes = offload.host.expert_bytes
    total_misses = 0
    for out in _decode_passes(model):
        c = out.offload
        for layer in range(N_LAYERS):
            union = np.unique(out.expert_ids[:, layer]).size
            assert c.hits[layer] + c.misses[layer] == union
        assert np.array_equal(c.bytes_h2d, c.misses * expert_bytes)
        assert np.all(c.streamed <= c.misses)
        total_misses += c.total_misses
        _check_slots(offload)
    assert offload.cache.bytes_h2d == total_misses * expert_bytes


def test_capacity_zero_streams_everything_and_keeps_nothing(model_dir):
    model = _model(model_dir, 0)
    assert model.offload.n_slots == 0
    for out in _decode_passes(model):
        assert out.offload.total_hits == 0
        assert np.array_equal(out.offload.streamed, out.offload.misses)
    assert not model.offload.cache.resident().any()


def test_all_experts_resident_after_first_use(model_dir):
    model = _model(model_dir, N_EXPERTS)
    assert model.offload.staging_gate_up.shape[0] == 0      # nothing can overflow
    ids = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(5))
    first = model(ids, torch.arange(10))
    assert first.offload.total_misses == first.offload.total_bytes_h2d // model.offload.host.expert_bytes > 0
    again = model(ids, torch.arange(10))                      # the same tokens route the same way
    assert again.offload.total_misses == 0
    assert again.offload.total_hits == first.offload.total_misses
    assert torch.equal(again.logits, first.logits)


@pytest.mark.parametrize("cache_experts,mode", [(1, "per_layer"), (3, "per_layer"), (2, "global"), (9, "global")])
def test_outputs_do_not_depend_on_the_cache(model_dir, cache_experts, mode):
    reference = [out.logits for out in _decode_passes(_model(model_dir, N_EXPERTS))]
    model = _model(model_dir, cache_experts, cache_mode=mode)
    for expected, out in zip(reference, _decode_passes(model)):
        assert torch.equal(out.logits, expected)
        _check_slots(model.offload)


def test_device_holds_only_the_slots_and_staging(model_dir):
    model = _model(model_dir, 3)
    offload = model.offload
    assert offload.n_slots == 3 * N_LAYERS
    expected = (offload.n_slots + 2) * offload.host.expert_bytes   # slots + two staging buffers
    assert offload.device_bytes == expected
    assert offload.device_bytes < offload.host.nbytes
    # the dense model holds no expert weights
    dense_params = sum(p.numel() for p in model.parameters())
    expert_params = N_LAYERS * N_EXPERTS * model.config.expert_params
    assert offload.host.nbytes == expert_params * 4
    assert all("expert" not in name for name, _ in model.named_parameters())
    assert dense_params < expert_params


def test_streaming_more_experts_than_staging_buffers_is_exact():
    """A layer whose union needs many streamed experts cycles the two staging buffers."""
    torch.manual_seed(0)
    host = HostExperts(n_layers=1, n_experts=6, hidden_size=4, intermediate_size=3, dtype=torch.float32)
    for tensor in host.gate_up + host.down:
        tensor.normal_()
    offload = ExpertOffload(host, capacity=1)
    offload.begin_pass()
    seen = [(e, gate_up.clone(), down.clone()) for e, gate_up, down in offload.layer_experts(0, np.array([5, 0, 3, 2, 4]))]
    assert [e for e, _, _ in seen] == [0, 2, 3, 4, 5]
    for expert, gate_up, down in seen:
        assert torch.equal(gate_up, host.gate_up[0][expert])
        assert torch.equal(down, host.down[0][expert])
    assert offload.counters.misses.tolist() == [5]
    assert offload.counters.streamed.tolist() == [4]
    assert offload.cache.resident()[0].tolist() == [True, False, False, False, False, False]


def test_reset_empties_the_device_cache(model_dir):
    model = _model(model_dir, 3)
    passes = list(_decode_passes(model, n_steps=2))
    assert model.offload.cache.resident().any()
    model.offload.reset()
    assert not model.offload.cache.resident().any() and (model.offload.slot_of == -1).all()
    again = list(_decode_passes(model, n_steps=2))
    assert again[0].offload.total_hits == 0
    assert all(torch.equal(a.logits, b.logits) for a, b in zip(passes, again))
    _check_slots(model.offload)


@pytest.mark.parametrize("mode,capacity", [("per_layer", 2), ("global", 6)])
def test_a_saved_cache_comes_back_with_its_experts_in_their_slots(model_dir, mode, capacity):
    """Two runs take turns on one model, each with its own cache (CacheTurns): every pass of each
    hits, misses and computes exactly as in a run of its own, though the other run's passes
    evicted its experts and overwrote the slots in between."""
    from specfit.runtime.offload import CacheTurns

    def passes(model, seed, n=8):
        # growing prefixes of one sequence, each pass from position 0: its output depends on its
        # tokens and the expert weights alone, not on what the KV cache holds
        ids = torch.randint(0, VOCAB, (6 + n,), generator=torch.Generator().manual_seed(seed))
        for j in range(n):
            out = model(ids[:6 + j], torch.arange(6 + j), logits_rows=[-1])
            yield out.logits, out.offload.hits.copy(), out.offload.misses.copy()

    seeds = (0, 1)
    expected = {seed: list(passes(_model(model_dir, capacity, cache_mode=mode), seed)) for seed in seeds}
    model = _model(model_dir, capacity, cache_mode=mode)
    turns = CacheTurns(model.offload)
    runs = {seed: passes(model, seed) for seed in seeds}
    got = {seed: [] for seed in seeds}
    for _ in range(8):
        for seed in seeds:
            turns.take(seed)
            got[seed].append(next(runs[seed]))
            _check_slots(model.offload)
    assert turns.copied > 0                    # the turns did bring experts back into slots
    for seed in seeds:
        for (logits, hits, misses), (e_logits, e_hits, e_misses) in zip(got[seed], expected[seed], strict=True):
            assert np.array_equal(hits, e_hits) and np.array_equal(misses, e_misses)
            assert torch.equal(logits, e_logits)
    # without the turns the runs share one cache, and some pass hits or misses otherwise
    shared = _model(model_dir, capacity, cache_mode=mode)
    runs = {seed: passes(shared, seed) for seed in seeds}
    together = {seed: [] for seed in seeds}
    for _ in range(8):
        for seed in seeds:
            together[seed].append(next(runs[seed]))
    assert any(not np.array_equal(a[1], b[1]) for seed in seeds for a, b in zip(together[seed], expected[seed]))
    # a state restores the same cache however often, copying only the experts whose slots changed
    state = model.offload.save_state()
    assert model.offload.restore_state(state) == 0
    for _ in range(2):
        next(passes(model, 3))
        assert model.offload.restore_state(state) <= int(state.cache.resident().sum())
        _check_slots(model.offload)
        assert np.array_equal(model.offload.cache.resident(), state.cache.resident())


def test_a_global_cache_charges_an_eviction_to_the_layer_that_lost_the_expert():
    """In global mode one pool serves every layer: a layer-1 miss that evicts a layer-0 expert is an
    eviction of layer 0 (whose expert must come back), not of layer 1."""
    host = HostExperts(n_layers=2, n_experts=4, hidden_size=4, intermediate_size=3, dtype=torch.float32)
    offload = ExpertOffload(host, capacity=2, mode="global")
    offload.begin_pass()
    assert [e for e, _, _ in offload.layer_experts(0, np.array([0, 1]))] == [0, 1]     # both admitted: pool full
    assert [e for e, _, _ in offload.layer_experts(1, np.array([2]))] == [2]           # evicts a layer-0 expert
    c = offload.counters
    assert c.misses.tolist() == [2, 1]
    assert c.evictions.tolist() == [1, 0]
    assert offload.cache.resident()[0].sum() == 1 and offload.cache.resident()[1].tolist() == [False, False, True, False]


def test_the_planned_device_bytes_are_what_the_slots_and_staging_buffers_hold():
    """What a plan says the offload will hold is what it allocates: the slots and, below one slot per
    expert, the two staging buffers."""
    host = HostExperts(n_layers=3, n_experts=6, hidden_size=4, intermediate_size=3, dtype=torch.float32)
    for capacity, buffers in ((0, 2), (2, 2), (6, 0)):
        offload = ExpertOffload(host, capacity=capacity)
        assert offload.planned_device_bytes == offload.device_bytes == (3 * capacity + buffers) * host.expert_bytes
    assert host.expert_bytes == (2 * 3 * 4 + 4 * 3) * 4                 # gate, up and down of one expert, float32


@pytest.mark.parametrize("with_keep", [False, True])
def test_global_prefetches_between_passes_keep_every_slot_holding_its_experts_weights(with_keep):
    """A global cache admits a prefetch layer by layer: a later layer's admission could evict an
    expert an earlier layer had just admitted, which then came back both admitted and evicted and
    was copied over another expert's slot (136 of 200 steps inconsistent, wrong weights read)."""
    L, E, H, I = 3, 8, 4, 2
    rng = np.random.default_rng(0)
    host = HostExperts(L, E, H, I, torch.float32)
    torch.manual_seed(0)
    for layer in range(L):
        host.gate_up[layer].copy_(torch.randn(E, 2 * I, H))
        host.down[layer].copy_(torch.randn(E, H, I))
    offload = ExpertOffload(host, 7, mode="global", policy="lru")
    prefetches = 0
    for step in range(200):
        if rng.random() < 0.2:
            mask = rng.random((L, E)) < 0.3
            offload.prefetch(mask, keep=rng.random((L, E)) if with_keep else None)
            offload.wait_prefetch()
            prefetches += 1
        else:
            offload.begin_pass()
            for layer in range(L):
                for e, gate_up, down in offload.layer_experts(layer, np.unique(rng.integers(0, E, size=rng.integers(1, 6)))):
                    assert torch.equal(gate_up, host.gate_up[layer][e]) and torch.equal(down, host.down[layer][e]), step
        assert ((offload.slot_of >= 0) == offload.cache.resident()).all() and -1 not in offload._free_slots, step
    assert prefetches > 20
