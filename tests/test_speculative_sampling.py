"""Tree speculative sampling is lossless: committed tokens follow the target's distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from runtime_fixtures import VOCAB, make_tiny_model
from runtime_fixtures import torch_single_thread  # noqa: F401  (autouse: one intra-op thread)
from speculative_fixtures import make_drafter, speculative_decoder
from specfit.costmodel import CostModel
from specfit.policies import make_policy
from specfit.runtime.acceptance import sample_accept, target_probs
from specfit.runtime.eagle3 import Eagle3Config, Eagle3Drafter
from specfit.runtime.loader import load_model
from specfit.runtime.model import causal_mask
from specfit.tree import DraftTree

COST = CostModel(base_s=2e-3, per_node_s=5e-5, hit_s=2e-5, miss_s=2e-4, draft_level_s=3e-4)


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
        path, bonus = sample_accept(tree, np.arange(6), logits, temperature, rng)
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
    path, bonus = sample_accept(tree, np.array([0, 1]), logits, 1.0, np.random.default_rng(0))
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
    it: what a policy that learns acceptance is told under sampling."""
    from specfit.runtime.acceptance import sampled_edge_outcomes

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
        path, _ = sample_accept(tree, np.arange(4), logits, temperature, rng)
        accepted[path[1:2]] += 1          # the root's child on the path, if any
    # the rule's probabilities, and the frequencies within 4.5 standard errors of them
    nodes, probs = sampled_edge_outcomes(tree, np.arange(4), np.array([0]), logits, temperature)
    assert nodes.tolist() == [1, 2, 3]
    assert probs == pytest.approx(p[0, [3, 5, 7]], rel=1e-12)
    freq = accepted[nodes] / n
    assert np.all(np.abs(freq - probs) <= 4.5 * np.sqrt(probs * (1 - probs) / n))
    # the drafter's order changes nothing: the third child is accepted as often as its token's mass,
    # not as often as what is left after its siblings (p3 / (1 - p1 - p2), 1.6-2.2x more here)
    assert abs(freq[2] - p[0, 7] / (1 - p[0, 3] - p[0, 5])) > 10 * np.sqrt(probs[2] / n)


def test_sampled_edge_outcomes_are_the_children_of_the_accepted_path_priced_at_their_parents():
    from specfit.runtime.acceptance import sampled_edge_outcomes

    # 0 ─┬─ 1 ─┬─ 3 ── 5
    #    │     └─ 4
    #    └─ 2
    tree = DraftTree(parents=np.array([-1, 0, 0, 1, 1, 3]), path_probs=np.array([1.0, 0.6, 0.3, 0.4, 0.1, 0.3]),
                     tokens=np.array([0, 1, 2, 3, 4, 5]))
    logits = torch.log(torch.tensor([[0.1, 0.5, 0.2, 0.1, 0.05, 0.05],      # at the root (row 0)
                                     [0.1, 0.1, 0.1, 0.3, 0.3, 0.1],        # at node 1 (row 1)
                                     [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]]) + 1e-30)   # at node 3 (row 2)
    verified = np.array([0, 1, 3])
    # path 0 -> 1: the children of 0 and of 1, at temperature 1 the rows' own probabilities; node 3's
    # children are left out (its parent's outcome is known, its own verdict continues no kept context)
    nodes, probs = sampled_edge_outcomes(tree, verified, np.array([0, 1]), logits, 1.0)
    assert nodes.tolist() == [1, 2, 3, 4]
    assert probs == pytest.approx([0.5, 0.2, 0.3, 0.3])
    # a sharper temperature: the softmax of logits / T
    nodes, probs = sampled_edge_outcomes(tree, verified, np.array([0, 1, 3]), logits, 0.5)
    sharp = target_probs(logits, 0.5)
    assert nodes.tolist() == [1, 2, 3, 4, 5]
    assert probs == pytest.approx([sharp[0, 1], sharp[0, 2], sharp[1, 3], sharp[1, 4], sharp[2, 5]])


def test_the_bonus_draw_is_numpys_choice_draw_for_draw():
    """The same seed samples the same tokens as ``rng.choice(p.size, p=p)`` did (same stream after it)."""
    from specfit.runtime.acceptance import draw

    maker = np.random.default_rng(12)
    for seed in range(300):
        logits = maker.normal(size=int(maker.integers(1, 3000))) * maker.uniform(0.1, 8)
        p = np.exp(logits - logits.max())
        p[maker.random(p.size) < 0.2] = 0.0          # rejected tokens zeroed, as the walk leaves them
        if p.sum() == 0:
            p[0] = 1.0
        p = p / p.sum()
        ours, numpys = np.random.default_rng(seed), np.random.default_rng(seed)
        assert draw(p, ours) == int(numpys.choice(p.size, p=p))
        assert ours.random() == numpys.random()
