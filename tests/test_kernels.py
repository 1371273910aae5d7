"""The compiled kernels' building blocks against numpy and plain Python: bitsets, popcounts,
numpy's pairwise sum, the min cut's source side, and the guard that drops stale cached kernels."""

from __future__ import annotations

import math

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from core_helpers import core_settings
from specfit import kernels
from specfit.kernel_warmup import warm_up
from specfit.kernels import drop_stale_caches


@core_settings(100)
@given(st.integers(1, 5), st.integers(1, 200), st.integers(1, 9), st.integers(0, 2**32 - 1))
def test_pack_rows_and_unpack_are_the_sets_of_the_ids(n, n_experts, k, seed):
    rng = np.random.default_rng(seed)
    experts = rng.integers(0, n_experts, size=(n, 3, k))
    bits, ok = kernels.bitsets.pack_rows(experts, n_experts)
    assert ok and bits.dtype == np.uint64 and bits.shape == (n, 3, (n_experts + 63) // 64)
    dense = kernels.bitsets.unpack(bits, n_experts)
    assert dense.dtype == np.bool_ and dense.shape == (n, 3, n_experts)
    for v in range(n):
        for layer in range(3):
            assert set(np.flatnonzero(dense[v, layer]).tolist()) == set(experts[v, layer].tolist())
    for word in bits.ravel()[:20]:
        assert kernels.bitsets.popcount(word) == bin(int(word)).count("1")
        if word:
            assert kernels.bitsets.lowest_bit(word) == (int(word) & -int(word)).bit_length() - 1


@core_settings(100)
@given(st.integers(1, 12), st.integers(1, 200), st.integers(1, 9), st.integers(0, 2**32 - 1))
def test_unions_and_misses_of_packed_rows_are_those_of_the_ids(n, n_experts, k, seed):
    # the replay takes its unions and the root's misses on a prepared trace's per-node sets
    rng = np.random.default_rng(seed)
    experts = rng.integers(0, n_experts, size=(n, 4, k)).astype(np.int16)
    bits, ok = kernels.bitsets.pack_rows(experts, n_experts)
    words = (n_experts + 63) // 64
    cached = kernels.bitsets.pack_mask(rng.random((4, n_experts)) < 0.5)
    base = int(rng.integers(0, n))
    nodes = np.sort(rng.choice(n - base, size=int(rng.integers(1, n - base + 1)), replace=False)).astype(np.int64)
    got, want = np.empty((4, words), np.uint64), np.empty((4, words), np.uint64)
    kernels.bitsets.union_of_rows(bits, base, nodes, nodes.size, got)
    kernels.evaluate.union_of_ids(experts, base, nodes, nodes.size, want)
    assert ok and np.array_equal(got, want)
    dense = kernels.bitsets.unpack(cached, n_experts)
    for row in range(n):
        missing = sum(len(set(experts[row, layer].tolist()) - set(np.flatnonzero(dense[layer]).tolist()))
                      for layer in range(4))
        assert kernels.bitsets.count_missing_row(bits, row, cached) == missing
        assert kernels.bitsets.count_missing(experts, row, cached) == missing


@core_settings(100)
@given(st.integers(1, 30), st.integers(1, 300), st.integers(1, 8), st.integers(0, 2**32 - 1))
def test_first_bad_routing_finds_what_a_sort_finds(n, n_experts, k, seed):
    # the trace validation's check of expert ids, against sorting each layer's ids (both paths:
    # up to 128 experts in registers, more in words)
    k = min(k, n_experts)
    rng = np.random.default_rng(seed)
    experts = np.stack([np.stack([rng.permutation(n_experts)[:k] for _ in range(3)]) for _ in range(n)])
    experts = experts.astype(np.int16)
    for _ in range(int(rng.integers(0, 3))):
        v, layer, s = rng.integers(0, n), rng.integers(0, 3), rng.integers(0, k)
        experts[v, layer, s] = rng.choice([-1, -3, n_experts, n_experts + 5, int(rng.integers(0, n_experts))])
    experts[rng.random(n) < 0.2, 0, 0] = -1            # unknown rows are skipped
    known = experts[:, 0, 0] >= 0
    out = known & ((experts < 0) | (experts >= n_experts)).any(axis=(1, 2))
    srt = np.sort(experts, axis=2)
    rep = known & (srt[:, :, 1:] == srt[:, :, :-1]).any(axis=(1, 2))
    first_out = int(np.flatnonzero(out)[0]) if out.any() else -1
    got_out, got_rep = kernels.bitsets.first_bad_routing(experts, n_experts)
    assert got_out == first_out
    if first_out < 0:
        assert got_rep == (int(np.flatnonzero(rep)[0]) if rep.any() else -1)


@pytest.mark.parametrize("n_experts", [1, 7, 8, 63, 64, 65, 128, 136])
def test_pack_mask_matches_a_bit_by_bit_reference(n_experts):
    # multiples of 8 take the eight-bytes-at-once path, the others the plain loop
    mask = np.random.default_rng(n_experts).random((5, n_experts)) < 0.4
    bits = kernels.bitsets.pack_mask(mask)
    for layer in range(5):
        for e in range(n_experts):
            assert bool(int(bits[layer, e // 64]) >> (e % 64) & 1) == mask[layer, e]
    assert np.array_equal(kernels.bitsets.unpack(bits, n_experts), mask)


def test_pack_rows_reports_ids_out_of_range():
    for bad in (-1, 10):
        experts = np.zeros((2, 1, 2), dtype=np.int64)
        experts[1, 0, 1] = bad
        assert kernels.bitsets.pack_rows(experts, 10)[1] is False


@core_settings(100)
@given(st.lists(st.floats(0.0, 1.0), max_size=600))
def test_pairwise_sum_equals_numpys_sum_bit_for_bit(values):
    # the compiled evaluate promises DraftTree.expected_tokens' numbers exactly
    a = np.array(values, dtype=np.float64)
    got = kernels.evaluate.pairwise_sum(a, a.size)
    assert got == float(a.sum())
    assert math.isclose(got, math.fsum(values), rel_tol=1e-12, abs_tol=1e-300)


def test_min_cut_source_side_is_what_the_source_reaches():
    # s=0 -> 1 (3), 1 -> 2 (1), 2 -> t=3 (5), 0 -> 2 (1): max flow 2 saturates 1->2 and 0->2;
    # the source still reaches 1 through the unsaturated 0 -> 1
    f = np.array([0, 1, 2, 0]), np.array([1, 2, 3, 2]), np.array([3.0, 1.0, 5.0, 1.0])
    seen = kernels.closure.min_cut_source_side(4, 0, 3, *f, 1e-12)
    assert seen.tolist() == [True, True, False, False]
    # an infinite edge is never cut
    seen = kernels.closure.min_cut_source_side(3, 0, 2, np.array([0, 1]), np.array([1, 2]),
                                               np.array([np.inf, 2.0]), 1e-12)
    assert seen.tolist() == [True, True, False]


def test_kv_compaction_refuses_a_keep_one_slot_past_the_cache_and_moves_nothing():
    # 2 rows of 8 slots of 4 bytes; the new tokens sit at slots cache_len + keep[i] = 4 + keep[i]:
    # keep[-1] = 4 would read slot 8, one past the last. The rows are the front of a larger
    # buffer, so a kernel that did read past them would read the buffer, not unowned memory.
    buffer = np.arange(3 * 8 * 4, dtype=np.uint8).reshape(3, 8, 4)
    rows = buffer[:2]
    before = rows.copy()
    assert kernels.kv.compact(rows, 4, np.array([0, 4])) == kernels.kv.OUT_OF_RANGE
    assert np.array_equal(rows, before)
    # keep[-1] = 3 reads slot 7, the last: moved (slot 4 stays, slot 7 goes to slot 5)
    assert kernels.kv.compact(rows, 4, np.array([0, 3])) == kernels.kv.OK
    expected = before.copy()
    expected[:, 5] = before[:, 7]
    assert np.array_equal(rows, expected)


def _fake_package(tmp_path):
    src = tmp_path / "pkg"
    cache = src / "__pycache__"
    cache.mkdir(parents=True)
    (src / "a.py").write_text("x = 1\n")
    (src / "b.py").write_text("y = 2\n")
    for name in ("a.f-1.py311.nbi", "a.f-1.py311.1.nbc", "a.cpython-311.pyc"):
        (cache / name).write_text("")
    return src, cache


def test_stale_cached_kernels_are_dropped_when_any_source_changes(tmp_path):
    src, cache = _fake_package(tmp_path)
    sources = [src / "a.py", src / "b.py"]
    args = (sources, cache / "kernels.sha256", [(cache, "*.nb[ic]")])
    assert drop_stale_caches(*args) is True          # no stamp yet: whatever is there may be stale
    assert sorted(p.name for p in cache.iterdir()) == ["a.cpython-311.pyc", "kernels.sha256"]
    (cache / "a.f-1.py311.nbi").write_text("")       # numba caches again
    assert drop_stale_caches(*args) is False          # same sources: kept
    assert (cache / "a.f-1.py311.nbi").exists()
    (src / "b.py").write_text("y = 3\n")             # a file the cached kernel may have inlined
    assert drop_stale_caches(*args) is True
    assert not (cache / "a.f-1.py311.nbi").exists() and (cache / "a.cpython-311.pyc").exists()


def test_a_cached_kernel_that_cannot_be_dropped_is_passed_over(tmp_path):
    """A cache file that cannot be deleted (another user's in a shared, sticky ``__pycache__``; here a
    folder of a cache file's name) is passed over as the other OSErrors there are: the except clause
    named SpecFitError before its import had run, and the first kernel stopped with an UnboundLocalError."""
    src, cache = _fake_package(tmp_path)
    (cache / "a.f-1.py311.1.nbc").unlink()
    (cache / "a.f-1.py311.1.nbc").mkdir()
    assert drop_stale_caches([src / "a.py", src / "b.py"], cache / "kernels.sha256", [(cache, "*.nb[ic]")]) is True
    assert (cache / "a.f-1.py311.1.nbc").is_dir()


def test_a_read_only_install_caches_its_kernels_in_a_folder_of_their_digest(tmp_path):
    """An install whose kernels' ``__pycache__`` cannot be written (a read-only site-packages): numba
    fell back to a per-user folder keyed on each file alone, or, with none writable, stopped at the
    first kernel with a traceback. The kernels now cache in the user's cache directory under their
    sources' digest (a changed kernel gets a new folder)."""
    import os
    import shutil
    import subprocess
    import sys

    package = Path(kernels.__file__).resolve().parents[1]
    copy = tmp_path / "site" / "specfit"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__", "assets"))
    (copy / "kernels" / "__pycache__").write_text("")        # a file where the folder would be: not writable
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env.update(PYTHONPATH=str(tmp_path / "site"), XDG_CACHE_HOME=str(tmp_path / "xdg"))
    probe = ("import numpy as np, numba, specfit.kernels as k; "
             "print(k.bitsets.popcount(np.uint64(7))); print(numba.config.CACHE_DIR)")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    count, folder = out.stdout.split()
    digest = kernels.sources_digest(sorted((copy / "kernels").glob("*.py")))
    assert count == "3" and Path(folder) == tmp_path / "xdg" / "specfit" / "numba" / digest[:16]
    assert list(Path(folder).rglob("*.nbi"))                  # cached there


def test_writable_folders_are_told_from_those_that_cannot_be_made(tmp_path):
    assert kernels.writable(tmp_path / "new" / "folder") and (tmp_path / "new" / "folder").is_dir()
    (tmp_path / "file").write_text("")
    assert not kernels.writable(tmp_path / "file" / "folder")


def test_with_no_writable_cache_the_first_kernel_says_so_naming_numba_cache_dir(tmp_path, monkeypatch):
    import os
    import tempfile

    from specfit.errors import SpecFitError

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kernels.cache_folder("ab" * 32) == tmp_path / "xdg" / "specfit" / "numba" / ("ab" * 8)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file" / "xdg"))
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path / "file" / "tmp"))
    with pytest.raises(SpecFitError, match="set NUMBA_CACHE_DIR to a writable directory"):
        kernels.cache_folder("ab" * 32)
    # numba's cache files are pickles: a folder another user made first on a shared temporary
    # directory is not used (only root can give a folder away, as a test)
    shared = tmp_path / "shared" / f"specfit-numba-{os.getuid()}"
    shared.mkdir(parents=True)
    shared.chmod(0o777)
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path / "shared"))
    if os.getuid() == 0:
        os.chown(shared, 65534, 65534)
        with pytest.raises(SpecFitError, match="cannot be written or are another user's; set NUMBA_CACHE_DIR"):
            kernels.cache_folder("ab" * 32)
        os.chown(shared, 0, 0)
    assert kernels.cache_folder("ab" * 32) == shared / ("ab" * 8) and shared.stat().st_mode & 0o777 == 0o700
    # the user's own folder that others may write to (made under a umask of 002): made private, used
    own = tmp_path / "xdg2" / "specfit" / "numba"
    own.mkdir(parents=True)
    own.chmod(0o775)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg2"))
    assert kernels.cache_folder("ab" * 32) == own / ("ab" * 8) and own.stat().st_mode & 0o777 == 0o700


def test_warm_up_loads_the_live_kernels_and_leaves_no_state():
    # a second call finds everything compiled: it takes a few milliseconds, not a compilation
    warm_up()
    assert warm_up() < 0.5


def test_the_cold_cache_is_seen_and_the_side_by_side_compile_loads_the_same_kernels(tmp_path):
    """An empty numba cache reads as cold (a fresh process with its own cache directory); with the
    kernels cached, ``warm_up(parallel=True)`` runs its child process and leaves every kernel
    loaded in this one, with nothing compiled twice here."""
    import os
    import subprocess
    import sys

    from specfit.kernel_warmup import cache_is_cold

    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "empty")}
    probe = "from specfit.kernel_warmup import cache_is_cold; print(cache_is_cold())"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
    warm_up()
    assert cache_is_cold() is False
    signatures = {name: len(k.signatures) for name, k in vars(kernels.search).items() if hasattr(k, "signatures")}
    warm_up(parallel=True)
    assert {name: len(k.signatures) for name, k in vars(kernels.search).items()
            if hasattr(k, "signatures")} == signatures
    assert warm_up() < 0.5


def test_pairwise_sum_of_eight_values_uses_numpys_eight_accumulators():
    # numpy sums 8 values as ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)): here
    # (1e16 + 1) + (-1e16 + 1) rounds to 0, while a left-to-right loop gives 1
    a = np.array([1e16, 1.0, -1e16, 1.0, 0.0, 0.0, 0.0, 0.0])
    assert float(np.sum(a)) == 0.0
    assert kernels.evaluate.pairwise_sum(a, 8) == 0.0
    # seven values are summed left to right (1e16 + 1 + -1e16 + 1 = 1) in numpy and here alike
    assert kernels.evaluate.pairwise_sum(a, 7) == float(np.sum(a[:7])) == 1.0


@pytest.mark.parametrize("n", [8, 9, 15, 16, 129, 136, 140, 200, 260, 1000, 4099])
def test_pairwise_sum_of_values_of_many_magnitudes_equals_numpys_bit_for_bit(n):
    # a wide range of magnitudes makes every difference in the order of additions show: the
    # split of a block above 128 values at a multiple of 8, the 8-accumulator leaf
    for seed in range(20):
        rng = np.random.default_rng(seed)
        a = rng.uniform(0, 1, n) * 10.0 ** rng.integers(-8, 9, n)
        assert kernels.evaluate.pairwise_sum(a, n) == float(np.sum(a)), (n, seed)


def test_union_accounting_reads_the_predicted_rows_of_the_verified_nodes():
    # one layer, 8 experts, top-1; expert 0 resident. Predicted per drafted node: 0 -> e0,
    # 1 -> e0, 2 -> e2; verified nodes [0, 2] whose true experts are e0 and e3 (in that order).
    # true union {0, 3}; predicted union {0, 2} (rows 0 and 2, not 0 and 1); overlap {0};
    # predicted misses {2}; true misses {3}
    ev = kernels.evaluate
    predicted = np.array([0, 0, 2]).reshape(3, 1, 1)
    true = np.array([0, 3]).reshape(2, 1, 1)
    cached = np.array([[1]], dtype=np.uint64)
    out = ev.union_accounting(predicted, np.array([0, 2]), true, cached)
    assert out.shape == (5, 1)
    assert out[ev.TRUE_UNION, 0] == 2
    assert out[ev.PREDICTED_UNION, 0] == 2
    assert out[ev.OVERLAP, 0] == 1
    assert out[ev.PREDICTED_MISSES, 0] == 1
    assert out[ev.TRUE_MISSES, 0] == 1


def test_count_missing_tells_expert_64_from_expert_0():
    # one layer routed to experts 0 and 64 (either order), nothing resident: both are missing
    cached = np.zeros((1, 2), dtype=np.uint64)
    for ids in ([0, 64], [64, 0], [1, 65], [64, 64]):
        experts = np.array([[ids]], dtype=np.int64)
        want = len(set(ids))
        assert kernels.bitsets.count_missing(experts, 0, cached) == want, ids
    # expert 0 resident, 64 not: one missing
    cached[0, 0] = np.uint64(1)
    assert kernels.bitsets.count_missing(np.array([[[0, 64]]]), 0, cached) == 1


def test_slots_right_looks_at_every_true_slot_when_fewer_are_predicted():
    true = np.array([[[3, 5, 9, 11]]], dtype=np.int64)          # [1 node, 1 layer, top-4]
    assert kernels.bitsets.slots_right(np.array([[[11]]], dtype=np.int64), true) == 1
    assert kernels.bitsets.slots_right(np.array([[[9, 4]]], dtype=np.int64), true) == 1
    assert kernels.bitsets.slots_right(np.array([[[5, 11]]], dtype=np.int64), true) == 2


def test_first_bad_routing_does_not_take_ids_64_apart_for_a_repeat():
    # up to 128 experts a layer's ids are two words; e and e + 64 share a bit index, not a word
    for ids in ([0, 64], [33, 97], [63, 127], [5, 69, 100, 36]):
        experts = np.array([[ids], [ids]], dtype=np.int16)              # 2 rows, 1 layer
        assert kernels.bitsets.first_bad_routing(experts, 128) == (-1, -1), ids
    repeated = np.array([[[0, 64]], [[64, 64]]], dtype=np.int16)
    assert kernels.bitsets.first_bad_routing(repeated, 128) == (-1, 1)
