"""Tree speculative sampling is lossless: committed tokens follow the target's distribution."""

from __future__ import annotations

import ctypes
from collections import namedtuple

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from runtime_fixtures import VOCAB, make_tiny_model
from runtime_fixtures import torch_single_thread  # noqa: F401  (autouse: one intra-op thread)
from speculative_fixtures import make_drafter, speculative_decoder
from specfit.costmodel import CostModel
from specfit.policies import make_policy
from specfit.errors import SpecFitError
from specfit.assets import tiny_moe_dir, tiny_moe_eagle3_dir
from specfit.runtime.acceptance import NonFiniteLogits, sample_accept, sample_token
from specfit.runtime.decoder import Decoder
from specfit.runtime.drafting import Proposer
from specfit.runtime.eagle3 import Eagle3Config, Eagle3Drafter
from specfit.runtime.loader import drafter_capture_layers, load_drafter, load_model
from specfit.runtime.config import ModelConfig
from specfit.runtime.model import causal_mask
from specfit.tree import DraftTree

COST = CostModel(base_s=2e-3, per_node_s=5e-5, hit_s=2e-5, miss_s=2e-4, draft_level_s=3e-4)


def target_probs(logits: torch.Tensor, temperature: float) -> np.ndarray:
    """The target's distribution at ``temperature``, float64 (the reference the walk must follow)."""
    return torch.softmax(logits.double() / temperature, dim=-1).numpy()


def reference_walk(tree: DraftTree, nodes: np.ndarray, logits: torch.Tensor, temperature: float, rng):
    """Tree speculative sampling written out in numpy, as the module docstring states it: (path,
    bonus, edges) with the uniform numbers drawn in the same order as the compiled walk's."""
    row_of = np.full(tree.n_nodes, -1, dtype=np.int64)
    row_of[nodes] = np.arange(nodes.size)
    path, edge_nodes, edge_probs = [0], [], []
    while True:
        node = path[-1]
        p = target_probs(logits[row_of[node]], temperature)
        kids = np.flatnonzero(tree.parents == node)
        edge_nodes += kids.tolist()
        edge_probs += p[tree.tokens[kids]].tolist()
        kids = kids[row_of[kids] >= 0]
        kids = kids[np.lexsort((kids, -tree.path_probs[kids]))]
        accepted = -1
        for child in kids:
            token = int(tree.tokens[child])
            rest = p.sum() - p[token]
            if rng.random() < p[token] or rest <= 0.0:
                accepted = int(child)
                break
            p[token] = 0.0
            p /= rest
        if accepted < 0:
            return path, int(rng.choice(p.size, p=p / p.sum())), (edge_nodes, edge_probs)
        path.append(accepted)


def _chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of ``counts`` against ``probs``, rare outcomes pooled so every bin expects >= 5."""
    expected = probs * counts.sum()
    rare = expected < 5
    obs = np.r_[counts[~rare], counts[rare].sum()]
    exp = np.r_[expected[~rare], expected[rare].sum()]
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


def test_tree_sampling_commits_tokens_with_the_targets_distributions():
    """Root with draft children a, b, c (in the drafter's order); a has children d, e. The first
    committed token must follow the target's distribution at the root, and the second (after a)
    its distribution at a — whichever drafts were accepted or rejected on the way."""
    V = 12
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, V, generator=gen)
    # give the drafted tokens real mass, as a good drafter's would: acceptances and rejections both occur
    tokens = np.array([0, 3, 5, 7, 2, 9])
    parents = np.array([-1, 0, 0, 0, 1, 1])
    logits[0, [3, 5, 7]] += torch.tensor([1.5, 1.0, 0.5])
    logits[1, [2, 9]] += torch.tensor([1.2, 0.8])
    tree = DraftTree(parents=parents, path_probs=np.array([1.0, 0.5, 0.3, 0.1, 0.3, 0.2]), tokens=tokens)
    temperature = 0.8
    probs = target_probs(logits, temperature)
    rng = np.random.default_rng(1)
    first, second_after_a = np.zeros(V, dtype=np.int64), np.zeros(V, dtype=np.int64)
    for _ in range(6000):
        path, bonus, _ = sample_accept(tree, np.arange(6), logits, temperature, rng)
        committed = list(tokens[path[1:]]) + [bonus]
        first[committed[0]] += 1
        if committed[0] == 3:
            second_after_a[committed[1]] += 1
    assert _chi_square_p(first, probs[0]) > 1e-3
    assert _chi_square_p(second_after_a, probs[1]) > 1e-3
    # and the test has power: the drafter's own ranking is not what comes out
    assert _chi_square_p(first, np.r_[0.0, 0, 0, 0.5, 0, 0.3, 0, 0.2, 0, 0, 0, 0] * 0.9 + 0.1 / V) < 1e-6


def test_tree_sampling_only_walks_verified_nodes():
    tree = DraftTree(parents=np.array([-1, 0, 1]), path_probs=np.array([1.0, 0.9, 0.8]), tokens=np.array([0, 1, 2]))
    logits = torch.full((2, 4), -30.0)
    logits[:, 1] = 30.0          # the target wants token 1 after the root and after node 1 alike
    path, bonus, _ = sample_accept(tree, np.array([0, 1]), logits, 1.0, np.random.default_rng(0))
    assert path.tolist() == [0, 1] and bonus == 1     # node 2 was not verified: the bonus comes from node 1


@pytest.fixture(scope="module")
def sampling_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampling")
    model_dir = make_tiny_model("qwen3_moe", root / "model", seed=3)
    prompt = [5, 17, 42]
    drafter_dir = make_drafter(model_dir, root / "drafter", hidden_size=256, fit_prompts=[prompt], new_tokens=6)
    config = Eagle3Config.from_file(drafter_dir / "config.json")
    model = load_model(model_dir, cache_experts=4, capture_layers=config.aux_hidden_state_layer_ids)
    return model, Eagle3Drafter.from_pretrained(drafter_dir), prompt


def test_speculative_sampling_matches_the_target_distribution_end_to_end(sampling_setup):
    """The second generated token (the first one a cycle commits, by an accepted draft or the
    bonus draw) over many seeds, against its exact marginal under the target."""
    model, drafter, prompt = sampling_setup
    temperature = 0.6
    n = len(prompt)
    model.setup_kv_cache(n + 3)
    p_first = target_probs(model(prompt, np.arange(n), causal_mask(0, n)).logits[-1], temperature)
    marginal = np.zeros(VOCAB)
    for token in np.flatnonzero(p_first > 1e-9):
        sequence = prompt + [int(token)]
        logits = model(sequence, np.arange(n + 1), causal_mask(0, n + 1)).logits[-1]
        marginal += p_first[token] * target_probs(logits, temperature)
    counts = np.zeros(VOCAB, dtype=np.int64)
    accepted = 0
    decoder = speculative_decoder(model, drafter, make_policy("eagle3:7:2"), COST, tree_top_k=2,
                                  temperature=temperature, seed=123)
    for _ in range(700):
        result = decoder.generate(prompt, 3, ignore_eos=True)     # one level can be drafted
        counts[result.output_ids[1]] += 1
        accepted += result.cycles[0].committed_tokens > 1
    assert _chi_square_p(counts, marginal) > 1e-3
    assert accepted > 50          # drafts were accepted, not only bonus tokens drawn


def test_a_drafted_child_is_accepted_with_the_targets_probability_of_its_token():
    """The walk tries the root's children in the drafter's order; each is accepted (its token
    committed first) with the target's probability of that token, whichever siblings come before
    it: what a policy that learns acceptance is told under sampling (the walk's edges)."""
    V = 10
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(4, V, generator=gen)       # the target's at nodes 0-3, all verified
    logits[0, [3, 5, 7]] += torch.tensor([2.0, 1.5, 1.0])
    tokens = np.array([0, 3, 5, 7, 2])
    tree = DraftTree(parents=np.array([-1, 0, 0, 0, 1]), path_probs=np.array([1.0, 0.5, 0.3, 0.1, 0.2]), tokens=tokens)
    temperature = 0.9
    p = target_probs(logits, temperature)
    n, rng = 20000, np.random.default_rng(5)
    accepted = np.zeros(5)
    for _ in range(n):
        path, _, (nodes, probs) = sample_accept(tree, np.arange(4), logits, temperature, rng)
        accepted[path[1:2]] += 1          # the root's child on the path, if any
    # the rule's probabilities (the root's children among the last walk's edges), and the
    # frequencies within 4.5 standard errors of them
    nodes, probs = nodes[tree.parents[nodes] == 0], probs[tree.parents[nodes] == 0]
    assert nodes.tolist() == [1, 2, 3]
    assert probs == pytest.approx(p[0, [3, 5, 7]], rel=1e-12)
    freq = accepted[nodes] / n
    assert np.all(np.abs(freq - probs) <= 4.5 * np.sqrt(probs * (1 - probs) / n))
    # the drafter's order changes nothing: the third child is accepted as often as its token's mass,
    # not as often as what is left after its siblings (p3 / (1 - p1 - p2), 1.6-2.2x more here)
    assert abs(freq[2] - p[0, 7] / (1 - p[0, 3] - p[0, 5])) > 10 * np.sqrt(probs[2] / n)


def test_the_walks_edges_are_the_children_of_the_accepted_path_priced_at_their_parents():
    # 0 ─┬─ 1 ─┬─ 3 ── 5
    #    │     └─ 4
    #    └─ 2
    tree = DraftTree(parents=np.array([-1, 0, 0, 1, 1, 3]), path_probs=np.array([1.0, 0.6, 0.3, 0.4, 0.1, 0.3]),
                     tokens=np.array([0, 1, 2, 3, 4, 5]))
    logits = torch.log(torch.tensor([[0.1, 0.5, 0.2, 0.1, 0.05, 0.05],      # at the root (row 0)
                                     [0.1, 0.1, 0.1, 0.3, 0.3, 0.1],        # at node 1 (row 1)
                                     [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]]) + 1e-30)   # at node 3 (row 2)
    verified = np.array([0, 1, 3])
    sharp = target_probs(logits, 0.5)
    seen = set()
    for seed in range(200):
        for temperature in (1.0, 0.5):
            path, _, (nodes, probs) = sample_accept(tree, verified, logits, temperature, np.random.default_rng(seed))
            seen.add(tuple(path.tolist()))
            # every drafted child of a path node, verified or not (node 4 was not), at its parent's row;
            # the children of a node off the path are left out
            if path.tolist() == [0, 1] and temperature == 1.0:
                assert nodes.tolist() == [1, 2, 3, 4]
                assert probs == pytest.approx([0.5, 0.2, 0.3, 0.3])
            elif path.tolist() == [0, 1, 3] and temperature == 0.5:
                assert nodes.tolist() == [1, 2, 3, 4, 5]
                assert probs == pytest.approx([sharp[0, 1], sharp[0, 2], sharp[1, 3], sharp[1, 4], sharp[2, 5]])
            elif path.tolist() == [0]:
                assert nodes.tolist() == [1, 2]
    assert seen == {(0,), (0, 1), (0, 1, 3)}          # node 2 was not verified: never on a path


def test_the_compiled_walk_is_the_reference_walk_draw_for_draw():
    """Random trees, verified subsets, vocabularies and temperatures: the same path, bonus token
    and edges as the rule written out in numpy from the same seed, and the stream left in the same
    state (every uniform number drawn in the same order)."""
    maker = np.random.default_rng(21)
    walks = 0
    for case in range(300):
        n = int(maker.integers(1, 14))
        parents = np.r_[-1, [int(maker.integers(0, v)) for v in range(1, n)]].astype(np.int64)
        probs = np.ones(n)
        for v in range(1, n):
            probs[v] = probs[parents[v]] * maker.uniform(0.05, 1.0)
        V = int(maker.integers(2, 40))
        tokens = maker.integers(0, V, size=n)
        tree = DraftTree(parents=parents, path_probs=probs, tokens=tokens)
        # an ancestor-closed verified set: each node kept with probability 0.7 when its parent is
        keep = np.r_[True, maker.random(n - 1) < 0.7]
        for v in range(1, n):
            keep[v] &= keep[parents[v]]
        verified = np.flatnonzero(keep)
        logits = torch.from_numpy(maker.normal(size=(verified.size, V)) * maker.uniform(0.2, 4)).float()
        logits[:, tokens[maker.integers(0, n)]] += float(maker.uniform(0, 6))   # some drafts the target likes
        temperature = float(maker.uniform(0.3, 1.5))
        ours, theirs = np.random.default_rng(case), np.random.default_rng(case)
        path, bonus, (nodes, edge_probs) = sample_accept(tree, verified, logits, temperature, ours)
        ref_path, ref_bonus, (ref_nodes, ref_probs) = reference_walk(tree, verified, logits, temperature, theirs)
        assert path.tolist() == ref_path and bonus == ref_bonus
        assert nodes.tolist() == ref_nodes          # path order, each node's children ascending
        np.testing.assert_allclose(edge_probs, ref_probs, rtol=1e-12, atol=1e-300)
        assert ours.random() == theirs.random()
        walks += len(path) > 1
    assert walks > 60          # drafts were accepted, not only bonus tokens drawn


def test_a_drafted_token_outside_the_targets_vocabulary_is_one_clear_error():
    tree = DraftTree(parents=np.array([-1, 0]), path_probs=np.array([1.0, 0.5]), tokens=np.array([0, 9]))
    with pytest.raises(ValueError, match=r"a token drafted after node 0 is not in the target's vocabulary \[0, 6\)"):
        sample_accept(tree, np.arange(2), torch.zeros(2, 6), 1.0, np.random.default_rng(0))


def test_the_first_token_is_drawn_from_the_targets_distribution_draw_for_draw_as_numpys_choice():
    """The walk over the root alone (the prompt's first token): the same token as
    ``rng.choice(V, p=p)`` from the same seed, and the stream left in the same state."""
    maker = np.random.default_rng(12)
    for seed in range(300):
        logits = torch.from_numpy(maker.normal(size=int(maker.integers(1, 3000))) * maker.uniform(0.1, 8)).float()
        temperature = float(maker.uniform(0.2, 2.0))
        p = target_probs(logits, temperature)
        ours, numpys = np.random.default_rng(seed), np.random.default_rng(seed)
        assert sample_token(logits, temperature, ours) == int(numpys.choice(p.size, p=p))
        assert ours.random() == numpys.random()
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5])
    rng = np.random.default_rng(3)
    counts = np.bincount([sample_token(logits, 0.7, rng) for _ in range(20000)], minlength=5)
    assert _chi_square_p(counts, target_probs(logits, 0.7)) > 1e-3


def test_rows_copied_one_at_a_time_walk_as_rows_read_in_place():
    """Logits the walk cannot read in place (bfloat16 here, or on a device) are copied a visited row
    at a time, the walk resuming where it stopped: the same walk as on their float32 copy read in
    place."""
    maker = np.random.default_rng(8)
    parents = np.array([-1, 0, 0, 0, 1, 1, 2, 4, 4])
    probs = np.array([1.0, 0.6, 0.3, 0.1, 0.5, 0.05, 0.2, 0.4, 0.1])
    tree = DraftTree(parents=parents, path_probs=probs, tokens=np.array([0, 1, 2, 3, 4, 5, 6, 7, 8]))
    for seed in range(100):
        logits = torch.from_numpy(maker.normal(size=(9, 12)) * 2).to(torch.bfloat16)
        logits[parents[1:], np.arange(1, 9)] += 3.0          # drafts the target likes
        a = sample_accept(tree, np.arange(9), logits, 0.8, np.random.default_rng(seed))
        b = sample_accept(tree, np.arange(9), logits.float(), 0.8, np.random.default_rng(seed))
        assert a[0].tolist() == b[0].tolist() and a[1] == b[1]
        np.testing.assert_array_equal(a[2][0], b[2][0])
        np.testing.assert_array_equal(a[2][1], b[2][1])


def test_a_logit_far_above_the_others_in_the_last_column_is_a_point_mass_not_an_overflow():
    """The softmax is shifted by the row's maximum over every column, the last one included: a
    drafted token holding (numerically) all the mass is accepted, priced 1, and drawn as the bonus."""
    V = 5
    logits = torch.zeros(2, V)
    logits[:, V - 1] = 1000.0                     # exp(1000) overflows float64 unless shifted by it
    tree = DraftTree(parents=np.array([-1, 0]), path_probs=np.array([1.0, 0.9]), tokens=np.array([0, V - 1]))
    for seed in range(5):
        path, bonus, (nodes, probs) = sample_accept(tree, np.arange(2), logits, 1.0, np.random.default_rng(seed))
        assert path.tolist() == [0, 1] and bonus == V - 1
        assert nodes.tolist() == [1] and probs.tolist() == [1.0]
    # a drafted token elsewhere is priced 0, not NaN, and rejected
    tree = DraftTree(parents=np.array([-1, 0]), path_probs=np.array([1.0, 0.9]), tokens=np.array([0, 1]))
    path, bonus, (_, probs) = sample_accept(tree, np.arange(2), logits, 0.7, np.random.default_rng(0))
    assert path.tolist() == [0] and bonus == V - 1 and probs.tolist() == [0.0]
    assert sample_token(logits[0], 0.3, np.random.default_rng(1)) == V - 1


def test_a_drafted_token_equal_to_the_vocabulary_size_is_rejected_as_out_of_range():
    """[0, V) excludes V: a token one past the last column must not be read out of the row."""
    tree = DraftTree(parents=np.array([-1, 0]), path_probs=np.array([1.0, 0.5]), tokens=np.array([0, 6]))
    with pytest.raises(ValueError, match=r"not in the target's vocabulary \[0, 6\)"):
        sample_accept(tree, np.arange(2), torch.zeros(2, 6), 1.0, np.random.default_rng(0))
    tree = DraftTree(parents=np.array([-1, 0]), path_probs=np.array([1.0, 0.5]), tokens=np.array([0, 5]))
    sample_accept(tree, np.arange(2), torch.zeros(2, 6), 1.0, np.random.default_rng(0))     # V - 1 is fine


def test_siblings_with_equal_path_probabilities_are_tried_earlier_node_first():
    """Ties in the drafter's order go to the earlier node: with two tokens of mass 1/2 each, the
    first uniform number decides, and below 1/2 it accepts the first-tried child (node 1)."""
    logits = torch.full((3, 4), -1000.0)
    logits[0, [1, 2]] = 0.0                      # p(1) = p(2) = 1/2 at the root
    tree = DraftTree(parents=np.array([-1, 0, 0]), path_probs=np.array([1.0, 0.4, 0.4]), tokens=np.array([0, 1, 2]))
    seen = set()
    for seed in range(40):
        u = np.random.default_rng(seed).random()
        path, _, _ = sample_accept(tree, np.arange(3), logits, 1.0, np.random.default_rng(seed))
        # u < 1/2: the first tried (node 1) is accepted; else it is rejected and node 2 holds all that is left
        assert path.tolist() == ([0, 1] if u < 0.5 else [0, 2]), (seed, u)
        seen.add(path[1])
    assert seen == {1, 2}


def test_float64_logits_are_read_at_float64_precision():
    """Logits already on the host in float64 are read in place, not rounded to float32 first: the
    edges carry the float64 softmax to 1e-12 (float32 rounding moves them by ~1e-8 here)."""
    logits = torch.tensor([[0.1, 0.2 + 1e-9, 0.3 - 3e-9, 0.15 + 7e-9]], dtype=torch.float64)
    tree = DraftTree(parents=np.array([-1, 0, 0]), path_probs=np.array([1.0, 0.5, 0.4]), tokens=np.array([0, 1, 2]))
    _, _, (nodes, probs) = sample_accept(tree, np.array([0]), logits, 0.01, np.random.default_rng(0))
    exact = torch.softmax(logits[0] / 0.01, dim=-1).numpy()
    assert nodes.tolist() == [1, 2]
    np.testing.assert_allclose(probs, exact[[1, 2]], rtol=1e-12)


def test_a_row_whose_largest_logit_is_infinite_is_a_point_mass_on_that_token():
    """+inf (an overflowed logit) is the softmax's limit: the bonus is that token, a drafted child
    of it is accepted priced 1, every other child priced 0 (not NaN, which online learning of
    acceptance could not fit); two +inf tokens share the mass."""
    inf = float("inf")
    logits = torch.tensor([0.0, 1.0, 2.0, inf, -1.0])
    for seed in range(3):
        assert sample_token(logits, 1.0, np.random.default_rng(seed)) == 3
    tree = DraftTree(parents=np.array([-1, 0, 0]), path_probs=np.array([1.0, 0.5, 0.4]), tokens=np.array([0, 1, 3]))
    path, bonus, (nodes, probs) = sample_accept(tree, np.array([0]), logits[None], 1.0, np.random.default_rng(0))
    assert path.tolist() == [0] and bonus == 3 and nodes.tolist() == [1, 2] and probs.tolist() == [0.0, 1.0]
    path, bonus, (_, probs) = sample_accept(tree, np.arange(3), torch.stack([logits] * 3), 0.7,
                                            np.random.default_rng(0))
    assert path.tolist() == [0, 2] and bonus == 3 and probs.tolist() == [0.0, 1.0]       # node 2 has no children
    two = torch.tensor([inf, 0.0, inf, 5.0])
    drawn = {sample_token(two, 1.0, np.random.default_rng(seed)) for seed in range(40)}
    assert drawn == {0, 2}


@pytest.mark.parametrize("row", [[0.0, float("nan"), 1.0, 2.0], [float("nan")] * 4, [-float("inf")] * 4])
def test_a_row_without_a_distribution_is_one_error_not_nan_edges(row):
    """A NaN logit, or every logit -inf: no distribution to sample, named, before any draw."""
    tree = DraftTree(parents=np.array([-1, 0]), path_probs=np.array([1.0, 0.5]), tokens=np.array([0, 1]))
    rng = np.random.default_rng(0)
    with pytest.raises(NonFiniteLogits, match="the row of node 0 holds NaN or no logit above -inf"):
        sample_accept(tree, np.array([0]), torch.tensor([row]), 1.0, rng)
    assert rng.random() == np.random.default_rng(0).random()          # nothing drawn


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_nan_logits_in_a_verification_pass_are_one_error_naming_the_target(sampling_setup, temperature):
    """The prompt's pass is finite, a later verification pass is not (a dtype that overflows at some
    position): the decode stops with the target named, greedy or sampling, not with garbage tokens."""
    model, drafter, prompt = sampling_setup
    forward, calls = model.forward, []

    def overflowing(*args, **kwargs):
        out = forward(*args, **kwargs)
        calls.append(1)
        if len(calls) == 3:
            with torch.inference_mode():              # the pass's tensors are inference tensors
                out.logits[0, 4] = float("nan")
        return out

    decoder = speculative_decoder(model, drafter, make_policy("eagle3:7:2"), COST, tree_top_k=2,
                                  temperature=temperature, seed=1)
    model.forward = overflowing
    try:
        with pytest.raises(SpecFitError, match=r"target model.*: the verification pass after \d+ tokens gave NaN or "
                                               "infinite logits"):
            decoder.generate(prompt, 8, ignore_eos=True)
    finally:
        del model.forward
    assert len(calls) == 3


class _ScriptedBits(np.random.PCG64):
    """A bit generator whose doubles are scripted (``script``, then 0.0 once it runs out), read by
    the compiled walk: numba draws through the bit generator's ``ctypes`` interface, which this
    overrides (``drawn`` counts the draws)."""

    _interface = namedtuple("interface", "state_address state next_uint64 next_uint32 next_double bit_generator")

    def __init__(self):
        super().__init__(0)
        self.script, self.drawn = [], 0
        base = super().ctypes
        self._callbacks = (ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_void_p)(lambda _: 0),
                           ctypes.CFUNCTYPE(ctypes.c_uint32, ctypes.c_void_p)(lambda _: 0),
                           ctypes.CFUNCTYPE(ctypes.c_double, ctypes.c_void_p)(self._next_double))
        self._scripted = self._interface(base.state_address, base.state, *self._callbacks, base.bit_generator)

    def _next_double(self, _state):
        u = self.script[self.drawn] if self.drawn < len(self.script) else 0.0
        self.drawn += 1
        return u

    @property
    def ctypes(self):
        return self._scripted


def exact_walk_outcomes(tree: DraftTree, nodes: np.ndarray, logits: torch.Tensor, temperature: float) -> dict:
    """{(path, bonus): probability} of one walk over every uniform number it can draw (numpy's
    ``random()`` draws ``k / 2**53``), found by running the compiled walk on scripted numbers: each
    draw's outcomes are intervals of ``k``, whose ends bisection finds, and each interval is
    followed into the next draw (their widths multiplied)."""
    grid = 1 << 53
    bits = _ScriptedBits()
    rng = np.random.Generator(bits)

    def run(script):
        bits.script, bits.drawn = [k / grid for k in script], 0
        path, bonus, _ = sample_accept(tree, nodes, logits, temperature, rng)
        return (tuple(path.tolist()), int(bonus)), bits.drawn

    outcomes = {}

    def follow(script, probability):
        outcome, drawn = run(script)
        if drawn <= len(script):          # decided before the next draw
            outcomes[outcome] = outcomes.get(outcome, 0.0) + probability
            return
        low = 0
        while low < grid:
            outcome = run(script + [low])
            inside, outside = low, grid
            while outside - inside > 1:
                middle = (inside + outside) // 2
                if run(script + [middle]) == outcome:
                    inside = middle
                else:
                    outside = middle
            follow(script + [(low + outside - 1) // 2], probability * (outside - low) / grid)
            low = outside

    follow([], 1.0)
    assert bits.drawn > 0          # the walk drew through the scripted interface
    return outcomes


def test_every_token_a_cycle_commits_follows_the_target_exactly_over_all_outcomes():
    """Random trees, their one-cycle outcomes enumerated exactly (not sampled): after every accepted
    token prefix, the next committed token (a drafted child or the bonus) has exactly the target's
    distribution there, ``softmax(logits / temperature)`` (temperature once, float64), to 1e-9.
    The trees have duplicate siblings (a reduced draft vocabulary mapped onto the target's), tokens
    the target gives probability 0 or 1, tokens never drafted (only the bonus can commit them),
    deep chains, unverified subtrees, and float32, float64 and bfloat16 logits; the target's
    logits depend on the token path alone, as a real target's do."""
    maker = np.random.default_rng(7)
    seen = dict(prefixes=0, non_first=0, after_leaf=0, undrafted=0, duplicates=0)
    for case in range(150):
        n, V = int(maker.integers(1, 10)), int(maker.integers(2, 6))
        parents = (np.r_[-1, np.arange(n - 1)] if case % 4 == 0 else              # a chain
                   np.r_[-1, [int(maker.integers(0, v)) for v in range(1, n)]]).astype(np.int64)
        probs = np.ones(n)
        for v in range(1, n):
            probs[v] = probs[parents[v]] * maker.choice([0.5, maker.uniform(0.05, 1.0)])
        tokens = maker.integers(0, V, size=n)
        keep = np.r_[True, maker.random(n - 1) < 0.8]
        for v in range(1, n):
            keep[v] &= keep[parents[v]]
        verified = np.flatnonzero(keep)

        def token_path(v):
            return (*token_path(parents[v]), int(tokens[v])) if v > 0 else ()

        by_context, rows = {}, []
        for v in verified:
            if token_path(v) not in by_context:
                row = maker.normal(size=V) * maker.uniform(0.2, 3)
                kind = case % 5
                if kind == 1:           # zeros
                    row[maker.random(V) < 0.4] = -np.inf
                    row[maker.integers(0, V)] = 0.5
                elif kind == 2:         # a point mass
                    row[:] = -np.inf
                    row[maker.integers(0, V)] = 1.0
                elif kind == 3:         # drafts the target likes
                    row[tokens[maker.integers(0, n)]] += 3.0
                by_context[token_path(v)] = row
            rows.append(by_context[token_path(v)])
        logits = torch.tensor(np.array(rows), dtype=(torch.float32, torch.float64, torch.bfloat16)[case % 3])
        temperature = float(maker.choice([1.0, maker.uniform(0.2, 2.0)]))
        tree = DraftTree(parents=parents, path_probs=probs, tokens=tokens)
        p = target_probs(logits, temperature)
        row_of = {int(v): i for i, v in enumerate(verified)}

        def first_tried(v):          # the drafter's order: path probability descending, ties the earlier node
            children = verified[parents[verified] == v]
            return children[np.lexsort((children, -probs[children]))][0]

        outcomes = exact_walk_outcomes(tree, verified, logits, temperature)
        assert sum(outcomes.values()) == pytest.approx(1.0, abs=1e-12)
        following, node_at = {}, {}        # accepted token prefix -> next token's probability, its node
        for (path, bonus), probability in outcomes.items():
            committed = [int(t) for t in tokens[list(path[1:])]] + [bonus]
            for j, token in enumerate(committed):
                node_at.setdefault(tuple(committed[:j]), set()).add(path[j])
                next_token = following.setdefault(tuple(committed[:j]), np.zeros(V))
                next_token[token] += probability
            seen["after_leaf"] += len(path) > 1 and not np.any(parents[verified] == path[-1])
            seen["non_first"] += any(path[j + 1] != first_tried(path[j]) for j in range(len(path) - 1))
        for prefix, next_token in following.items():
            (node,) = node_at[prefix]          # one node per accepted prefix
            np.testing.assert_allclose(next_token / next_token.sum(), p[row_of[node]], rtol=0, atol=1e-9,
                                       err_msg=f"case {case}, after {prefix}")
            drafted = tokens[verified[parents[verified] == node]]
            seen["undrafted"] += np.any(np.isin(np.flatnonzero(p[row_of[node]] > 0), drafted, invert=True))
            seen["duplicates"] += np.unique(drafted).size < drafted.size
            seen["prefixes"] += 1
    assert min(seen.values()) > 20, seen


def test_sampled_cycles_verify_with_the_logits_of_the_committed_sequence_recomputed():
    """Sampling accepts paths greedy decoding never would (a non-first child, a token other than
    the argmax): after each cycle's KV compaction the next cycle's target logits, at every node of
    its accepted path, equal a plain causal pass over the committed sequence. The bundled model and
    its EAGLE-3 drafter (a reduced draft vocabulary, mapped by d2t), several seeds and temperatures."""
    drafter_dir = tiny_moe_eagle3_dir()
    config = ModelConfig.from_dir(tiny_moe_dir())
    model = load_model(tiny_moe_dir(), cache_experts=6, capture_layers=drafter_capture_layers(drafter_dir, config))
    drafter = load_drafter(drafter_dir, model)
    reference = load_model(tiny_moe_dir(), cache_experts=config.n_experts)
    prompt = [1, 57, 300, 12, 9, 77]
    non_first = 0
    for temperature, seed in ((1.0, 0), (0.6, 1)):
        decoder = Decoder(model, Proposer(drafter, 4), make_policy("eagle3:8:3"), COST, temperature=temperature,
                          seed=seed)
        cycles = []

        def keep(stats, _tokens):
            rows = stats.verification.nodes.searchsorted(stats.path)
            cycles.append((stats.position, stats.verification.logits[rows].clone(), stats.path, stats.draft.tree))

        result = decoder.generate(prompt, 40, ignore_eos=True, on_cycle=keep)
        sequence = prompt + result.output_ids
        n = len(sequence)
        reference.setup_kv_cache(n)
        full = reference(sequence, np.arange(n), causal_mask(0, n)).logits
        for position, logits, path, tree in cycles:
            start = len(prompt) + position          # the cycle's root in the sequence
            torch.testing.assert_close(logits, full[start:start + path.size], rtol=0, atol=1e-4)
            non_first += any(path[j + 1] != np.flatnonzero(tree.parents == path[j])[0] for j in range(path.size - 1))
    assert non_first >= 3          # paths through a later sibling were accepted and compacted
