"""The search benchmark's worst case for the greedy baseline is what it says: trees the greedy grows
to the end, where the exact search takes every node too."""

from __future__ import annotations

from bench_helpers import bench_module
from specfit import best_subtree, greedy_subtree

bench = bench_module("bench_search")


def test_the_wide_trees_are_grown_to_the_end_by_both_searches():
    case = bench.wide_case(120)
    assert greedy_subtree(*case).n_nodes == 120
    assert best_subtree(*case).n_nodes == 120
    table = bench.greedy_growth([40, 80])
    assert [list(c.cells) for c in table.columns if c.header in ("nodes", "greedy nodes", "exact nodes")] == \
        [["40", "80"]] * 3
