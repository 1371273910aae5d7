"""The live decoder on the bundled tiny MoE and its EAGLE-3 drafter: the KV cache sized to the
request, drafting near the end of the model's positions, and the routing handed to the expert
predictor."""

from __future__ import annotations


from runtime_fixtures import torch_single_thread  # noqa: F401  (autouse: one intra-op thread)
from specfit.assets import tiny_moe_dir, tiny_moe_eagle3_dir
from specfit.costmodel import CostModel
from specfit.policies import make_policy
from specfit.runtime.decoder import Decoder
from specfit.runtime.drafting import Proposer
from specfit.runtime.loader import drafter_capture_layers, load_drafter, load_model

PROMPT = [5, 17, 230, 41, 8, 99, 1020, 3, 64, 12]
COST = CostModel(base_s=4e-3, per_node_s=1e-4, hit_s=2e-4, miss_s=3e-3, draft_level_s=8e-4)


def test_speculative_decoding_at_the_end_of_the_position_range_stays_lossless():
    """A prompt that leaves the model only a few positions: drafting must stop where the KV slots
    run out (each level after the first adds top_k * top_k nodes), and the output equals the
    autoregressive one."""
    capture = drafter_capture_layers(tiny_moe_eagle3_dir(), load_model(tiny_moe_dir()).config)
    model = load_model(tiny_moe_dir(), cache_experts=16, capture_layers=capture)
    drafter = load_drafter(tiny_moe_eagle3_dir(), model)
    n_positions = model.config.max_position_embeddings
    new_tokens = 12
    prompt = (PROMPT * n_positions)[: n_positions - new_tokens]
    expected = Decoder(model).generate(prompt, new_tokens, ignore_eos=True).output_ids
    for spec in ("eagle3:16:4", "specfit"):
        decoder = Decoder(model, Proposer(drafter, 4), make_policy(spec), COST, online_refit=False)
        result = decoder.generate(prompt, new_tokens, ignore_eos=True)
        assert result.output_ids == expected, spec
        assert decoder.cache_len <= n_positions
        # the KV cache is never sized past the model's positions (tree slots stop there)
        assert model.max_seq_len <= n_positions


def test_each_cycles_predictions_see_the_routing_of_the_token_before_its_root():
    """The routing the predictor is given (``last_known``) is that of the last committed token the
    target ran, i.e. output[p - 1] for a cycle at position p, whatever the previous cycle accepted:
    the same as the autoregressive decode's routing of that token (not the previous cycle's root's)."""
    import numpy as np

    capture = drafter_capture_layers(tiny_moe_eagle3_dir(), load_model(tiny_moe_dir()).config)
    model = load_model(tiny_moe_dir(), cache_experts=16, capture_layers=capture)
    drafter = load_drafter(tiny_moe_eagle3_dir(), model)
    ar = Decoder(model, cost=COST).generate(PROMPT, 24, ignore_eos=True)
    spec = Decoder(model, Proposer(drafter, 4), make_policy("eagle3:16:4"), COST, online_refit=False).generate(
        PROMPT, 24, ignore_eos=True)
    assert spec.output_ids == ar.output_ids
    routing_of = {c.position: np.sort(c.verification.expert_ids[0], axis=-1) for c in ar.cycles}  # output[p]'s
    after_multi = 0
    for before, cycle in zip(spec.cycles, spec.cycles[1:]):
        after_multi += before.committed_tokens > 1
        np.testing.assert_array_equal(np.sort(cycle.draft.last_known, axis=-1), routing_of[cycle.position - 1])
    assert after_multi > 0, "the drafter must get some multi-token cycles accepted"


def test_the_kv_cache_holds_the_committed_tokens_and_one_tree_not_the_whole_position_range():
    """generate sizes the static KV cache to prompt + new tokens + one tree's drafted nodes; sizing
    it to the model's whole position range would allocate max_position_embeddings slots per layer
    (gigabytes at 32k-40k positions) for a short request."""
    from specfit.runtime.drafting import tree_capacity

    capture = drafter_capture_layers(tiny_moe_eagle3_dir(), load_model(tiny_moe_dir()).config)
    model = load_model(tiny_moe_dir(), cache_experts=16, capture_layers=capture)
    drafter = load_drafter(tiny_moe_eagle3_dir(), model)
    policy = make_policy("eagle3:16:4")
    Decoder(model, Proposer(drafter, 4), policy, COST, online_refit=False).generate(PROMPT, 8, ignore_eos=True)
    assert model.max_seq_len == len(PROMPT) + 8 + tree_capacity(4, policy.max_levels) - 1
    assert model.max_seq_len < model.config.max_position_embeddings


def test_a_level_that_fills_the_kv_cache_exactly_may_be_drafted():
    """The first level adds top_k nodes, each later one top_k * top_k: a level is drafted when the
    committed tokens, the tree so far and that level fit the KV slots, the last slot included."""
    from types import SimpleNamespace

    def room(cache_len, n_nodes, levels, slots=64, top_k=3):
        decoder = SimpleNamespace(top_k=top_k, cache_len=cache_len, model=SimpleNamespace(max_seq_len=slots))
        view = SimpleNamespace(draft_levels=levels, tree=SimpleNamespace(n_nodes=n_nodes))
        return Decoder._room_for_level(decoder, view)

    assert room(60, 1, 0) and not room(61, 1, 0)           # 60 + 1 + 3 = 64 slots: exactly full
    assert room(51, 4, 1) and not room(52, 4, 1)           # 51 + 4 + 9 = 64
    assert room(42, 13, 2) and not room(43, 13, 2)
