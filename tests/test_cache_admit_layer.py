"""``ExpertCache.admit_layer`` (one layer's union, as the live offload admits it) against
``admit`` of the same union as an [L, E] array, on random sequences; and in per-layer mode it
reads and writes only the layer's rows of the state."""

from __future__ import annotations

import numpy as np
import pytest

from specfit import ExpertCache

STATE = ("_bits", "_score", "_count", "_slots", "_n_used", "_clock")
COUNTERS = ("hits", "misses", "evictions", "streamed")


def _random_calls(rng, n_layers, n_experts, n_calls):
    """(layer, ids) pairs: layers in forward order with repeats and skips, unions of 0..E ids."""
    for _ in range(n_calls):
        layer = int(rng.integers(n_layers))
        size = int(rng.integers(0, n_experts + 1))
        yield layer, rng.choice(n_experts, size=size, replace=False).astype(np.int64)


def _assert_same_state(a: ExpertCache, b: ExpertCache, step) -> None:
    for name in STATE + COUNTERS:
        assert np.array_equal(getattr(a, name), getattr(b, name)), f"step {step}: {name}"


CASES = [("per_layer", c) for c in (0, 1, 3, 8)] + [("global", c) for c in (0, 1, 5, 17, 40)]


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo", "moe-infinity"])
@pytest.mark.parametrize("mode,capacity", CASES)
def test_admit_layer_equals_admit_of_a_one_row_union(mode, capacity, policy):
    L, E = 5, 8
    rng = np.random.default_rng(capacity * 7 + len(policy))
    by_rows = ExpertCache(L, E, capacity, mode=mode, policy=policy, expert_bytes=3)
    by_layer = ExpertCache(L, E, capacity, mode=mode, policy=policy, expert_bytes=3)
    warm = rng.random((L, E)) < 0.3
    by_rows.warm(warm)
    by_layer.warm(warm)
    for step, (layer, ids) in enumerate(_random_calls(rng, L, E, 300)):
        union = np.zeros((L, E), dtype=bool)
        union[layer, ids] = True
        expected = by_rows.admit(union)
        got = by_layer.admit_layer(layer, ids[::-1])          # order of the ids does not matter
        assert got.hit_ids.tolist() == np.flatnonzero(expected.hit_mask[layer]).tolist(), f"step {step}"
        assert got.admitted_ids.tolist() == np.flatnonzero(expected.admitted_mask[layer]).tolist(), f"step {step}"
        assert got.streamed_ids.tolist() == np.flatnonzero(expected.streamed_mask[layer]).tolist(), f"step {step}"
        assert got.evicted.tolist() == np.argwhere(expected.evicted_mask).tolist(), f"step {step}"
        assert (got.hits, got.misses, got.streamed) == (expected.hits[layer], expected.misses[layer],
                                                        expected.streamed[layer])
        assert got.evictions == expected.evictions.sum()
        for array in (got.hit_ids, got.admitted_ids, got.streamed_ids, got.evicted):
            assert array.dtype == np.int64
        _assert_same_state(by_rows, by_layer, step)
    assert by_layer.bytes_h2d == by_rows.bytes_h2d


class RowGuard(np.ndarray):
    """An [L, ...] state array that lets only row ``allowed`` be indexed; any whole-array
    operation (a ufunc, a reduction, a copy, a reshape) fails the test."""

    allowed: int = -1

    def _check(self, key):
        row = key[0] if isinstance(key, tuple) else key
        if not (isinstance(row, (int, np.integer)) and int(row) == self.allowed):
            raise AssertionError(f"admit_layer indexed the state with {key!r}, not row {self.allowed}")

    def __getitem__(self, key):
        self._check(key)
        return np.ndarray.view(self, np.ndarray)[key]

    def __setitem__(self, key, value):
        self._check(key)
        np.ndarray.view(self, np.ndarray)[key] = value

    def __array_ufunc__(self, *args, **kwargs):
        raise AssertionError("admit_layer ran a ufunc over every layer's state")

    def __array_function__(self, *args, **kwargs):
        raise AssertionError("admit_layer ran a numpy function over every layer's state")

    def _whole(self, *args, **kwargs):
        raise AssertionError("admit_layer copied or reshaped every layer's state")

    copy = ravel = reshape = flatten = sum = any = all = _whole


def test_per_layer_admit_layer_touches_only_its_layer():
    L, E, C = 6, 16, 4
    rng = np.random.default_rng(3)
    for policy in ("lru", "lfu", "fifo", "moe-infinity"):
        cache = ExpertCache(L, E, C, policy=policy)
        reference = ExpertCache(L, E, C, policy=policy)
        for step, (layer, ids) in enumerate(_random_calls(rng, L, E, 120)):
            union = np.zeros((L, E), dtype=bool)
            union[layer, ids] = True
            reference.admit(union)
            plain = {name: getattr(cache, name) for name in STATE}
            for name, array in plain.items():
                guarded = array.view(RowGuard)
                guarded.allowed = layer
                setattr(cache, name, guarded)
            cache.admit_layer(layer, ids)
            for name, array in plain.items():
                setattr(cache, name, array)
            _assert_same_state(reference, cache, step)
