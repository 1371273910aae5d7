"""Speculative decoding on the runtime: lossless for every policy, tree verification vs linear
sequences, drafter state after acceptance, expert prediction."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime_fixtures import FAMILIES, VOCAB, load_reference, make_tiny_model
from runtime_fixtures import torch_single_thread  # noqa: F401  (autouse: one intra-op thread)
from speculative_fixtures import make_drafter, speculative_decoder
from specfit.accounting import live_row
from specfit.costmodel import CostModel
from specfit.policies import make_policy
from specfit.runtime.decoder import Decoder
from specfit.runtime.drafting import Proposer
from specfit.runtime.config import ModelConfig
from specfit.runtime.loader import drafter_capture_layers, load_drafter, load_model
from specfit.runtime.model import causal_mask
from specfit.experts.predictors import NodeBatch
from specfit.experts.router import RouterPredictor
from specfit.tree import DraftTree

pytest.importorskip("transformers")

NEW_TOKENS = 20
POLICIES = ("ar", "chain:3", "static:6", "eagle3:16:4", "eagle3", "specfit")
# misses expensive enough that specfit's choices vary between the root alone and small trees
COST = CostModel(base_s=2e-3, per_node_s=5e-5, hit_s=2e-5, miss_s=2e-4, draft_level_s=3e-4, expert_bytes=24576)


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in (1, 4, 9, 16)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (target dir, drafter dir): a drafter fitted to the target's greedy continuations
    of the test prompts (wider than the target, own embedding), so paths of several tokens are
    accepted."""
    out = {}
    for family in FAMILIES:
        root = tmp_path_factory.mktemp(family)
        model_dir = make_tiny_model(family, root / "model", seed=7)
        drafter_dir = make_drafter(model_dir, root / "drafter", hidden_size=256, fit_prompts=prompts(),
                                   new_tokens=NEW_TOKENS, layer_prefix="layers.0." if family == "olmoe" else "midlayer.")
        out[family] = (model_dir, drafter_dir)
    return out


def load(model_dir, drafter_dir, cache_experts: int):
    """The target and its drafter as ``specfit decode`` loads them."""
    model = load_model(model_dir, cache_experts=cache_experts,
                       capture_layers=drafter_capture_layers(drafter_dir, ModelConfig.from_dir(model_dir)))
    return model, load_drafter(drafter_dir, model)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_output_equals_autoregressive_and_transformers_for_every_policy(checkpoints, family):
    model_dir, drafter_dir = checkpoints[family]
    reference = load_reference(model_dir)
    expected = [reference.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p):].tolist()
                for p in prompts()]
    for cache_experts in (2, 8):
        model, drafter = load(model_dir, drafter_dir, cache_experts)
        assert [Decoder(model).generate(p, NEW_TOKENS, ignore_eos=True).output_ids for p in prompts()] == expected
        for spec in POLICIES:
            policy = make_policy(spec, max_levels=6)
            decoder = speculative_decoder(model, drafter, policy, COST, tree_top_k=3)
            results = [decoder.generate(p, NEW_TOKENS, ignore_eos=True) for p in prompts()]
            for prompt, result, want in zip(prompts(), results, expected):
                assert result.output_ids == want, f"{spec}, cache {cache_experts}, prompt of {len(prompt)} tokens"
            committed = [c.committed_tokens for r in results for c in r.cycles]
            if policy.max_levels and spec != "specfit":
                # the fitted drafter makes multi-token acceptance common: compaction is exercised
                assert max(committed) >= 3 and np.mean(committed) > 1.5, spec


def test_greedy_output_is_lossless_with_a_random_drafter_of_the_targets_width(checkpoints, tmp_path):
    """A drafter sharing the target's embedding (its hidden states then feed the router
    predictor); random weights, several seeds and tree widths."""
    model_dir, _ = checkpoints["qwen3_moe"]
    model = load_model(model_dir, cache_experts=3)
    expected = [Decoder(model).generate(p, NEW_TOKENS, ignore_eos=True).output_ids for p in prompts()]
    for seed, top_k in ((1, 2), (2, 5)):
        drafter_dir = make_drafter(model_dir, tmp_path / f"drafter{seed}", seed=seed, draft_vocab_size=48)
        model, drafter = load(model_dir, drafter_dir, cache_experts=3)
        for spec in ("eagle3:12:3", "specfit"):
            decoder = speculative_decoder(model, drafter, make_policy(spec), COST, tree_top_k=top_k)
            assert decoder.drafter_context
            outputs = [decoder.generate(p, NEW_TOKENS, ignore_eos=True).output_ids for p in prompts()]
            assert outputs == expected, f"seed {seed}, top-k {top_k}, {spec}"


def test_every_cycle_reports_measured_and_predicted(checkpoints):
    model, drafter = load(*checkpoints["mixtral"], cache_experts=2)
    decoder = speculative_decoder(model, drafter, make_policy("specfit"), COST, tree_top_k=3)
    result = decoder.generate(prompts()[2], NEW_TOKENS, ignore_eos=True)
    assert sum(c.committed_tokens for c in result.cycles) == NEW_TOKENS - 1 == sum(result.cycle_tokens)
    for stats in result.cycles:
        row = live_row(stats, COST, model.offload.host.expert_bytes)
        # the cycle ends once the policy, the predictor and the cost model have learnt from it
        assert row["measured_time_s"] == pytest.approx(row["draft_time_s"] + row["verify_time_s"] + row["learn_time_s"])
        assert row["learn_time_s"] > 0 and 0 < row["cpu_time_s"] <= row["measured_time_s"] * 1.05
        assert 0 < row["target_time_s"] <= row["verify_time_s"]
        assert row["drafter_time_s"] + row["search_time_s"] + row["predict_time_s"] <= row["draft_time_s"] + 1e-9
        assert row["bytes_h2d"] == row["misses"] * model.offload.host.expert_bytes
        assert 0 <= row["transfer_time_s"] <= row["target_time_s"]
        assert (row["transfer_time_s"] > 0) == (row["misses"] > 0)
        sel = stats.draft.selection
        assert row["nodes_verified"] == sel.n_nodes and row["predicted_time_s"] == sel.time_s
        assert row["predicted_tokens"] == pytest.approx(sel.expected_tokens)
        assert row["nodes_drafted"] >= row["nodes_verified"] >= 1
        # the true union is what the offload moved; the cost model on it is the charged time
        assert row["union_size"] == row["hits"] + row["misses"]
        assert row["charged_time_s"] == pytest.approx(COST.time_s(row["draft_levels"], row["nodes_verified"],
                                                                  row["hits"], row["misses"]))
        assert 0 <= row["union_overlap"] <= min(row["union_size"], row["predicted_union_size"])
        # per layer: the sums are the cycle's totals, the predicted misses the ones the search saw
        assert sum(row["union_per_layer"]) == row["union_size"]
        assert sum(row["predicted_union_per_layer"]) == row["predicted_union_size"]
        assert sum(row["predicted_misses_per_layer"]) == row["predicted_misses"] == sel.misses
        # the profile's prediction of the same selection next to the one the policy decided with
        assert row["prior_predicted_time_s"] == pytest.approx(COST.time_s(sel.draft_levels, sel.n_nodes, sel.hits,
                                                                          sel.misses))
        assert row["online_predicted_time_s"] == row["predicted_time_s"]


class ReversingCalibrator:
    """An acceptance calibrator that ranks each node's children the other way round from the
    drafter: its last (least probable) child is the most probable one."""

    def calibrate_level(self, edge_lp, width, new, parents, depth, edge_product, path_prob):
        rank = np.arange(new.size) % width
        path_prob[new] = path_prob[parents] * (0.5 + 0.4 * rank / max(width - 1, 1))
        edge_product[new] = path_prob[new]


@pytest.mark.parametrize("spec, drafters_choice", [("eagle3:2:1", True), ("static:2", False)])
def test_live_eagle3_reranks_by_the_drafters_probabilities_where_the_run_calibrates(checkpoints, spec,
                                                                                   drafters_choice):
    """EAGLE-3 ranks by the drafter's cumulative log-probability: with an acceptance calibrator
    that reverses the order, ``eagle3`` still verifies the drafter's top child, ``static:N`` (SpecFit's
    fixed size) the calibrated favourite."""
    model, drafter = load(*checkpoints["qwen3_moe"], cache_experts=8)
    decoder = speculative_decoder(model, drafter, make_policy(spec), COST, tree_top_k=3,
                                  calibrator=ReversingCalibrator())
    drafted = []
    decoder.generate(prompts()[1], 6, ignore_eos=True, on_cycle=lambda stats, _: drafted.append(stats.draft))
    drafted = [draft for draft in drafted if draft.tree.n_nodes > 1]     # the last cycle may draft nothing
    assert drafted
    for draft in drafted:
        children = np.flatnonzero(draft.tree.parents == 0)
        top = children[np.argmax(draft.edge_logprob[children])]
        assert draft.nodes.tolist() == [0, int(top) if drafters_choice else int(children[-1])]


def test_drafter_state_after_acceptance_equals_a_fresh_run(checkpoints):
    """After cycles that accepted several tokens, the drafter's cache holds exactly the entries
    a from-scratch run over the committed sequence (with the target's features) would."""
    model, drafter = load(*checkpoints["qwen3_moe"], cache_experts=8)
    prompt = prompts()[1]
    decoder = speculative_decoder(model, drafter, make_policy("eagle3:16:4"), COST, tree_top_k=3)
    result = decoder.generate(prompt, NEW_TOKENS, ignore_eos=True)
    assert max(result.cycle_tokens) >= 3
    live = decoder.proposer._sync()           # the pending accepted entries, as the next cycle would
    sequence = prompt + result.output_ids
    n = len(sequence)
    model.setup_kv_cache(n)
    features = model(sequence, np.arange(n), causal_mask(0, n)).hidden
    fresh = drafter(features[: n - 1], torch.tensor(sequence[1:]), torch.arange(n - 1))
    torch.testing.assert_close(live.logits[-1], fresh.logits[-1], rtol=1e-4, atol=1e-4)


def test_the_prompt_runs_through_the_drafter_in_the_prefill_and_the_first_cycle_is_like_the_others(checkpoints):
    """The prefill runs the prompt's drafter entries but the last; the first cycle's level 1 runs
    one pass over the pending entries, as every later cycle does over its accepted ones (not a
    prompt-length pass, which its cost model would not price)."""
    model, drafter = load(*checkpoints["qwen3_moe"], cache_experts=8)
    prompt = prompts()[2]
    calls: list[tuple[str, int]] = []
    phase = ["prefill"]
    forward = drafter.forward

    def counted(hidden, input_ids, positions, mask=None, **options):
        calls.append((phase[0], int(input_ids.numel())))
        return forward(hidden, input_ids, positions, mask, **options)

    drafter.forward = counted
    decoder = speculative_decoder(model, drafter, make_policy("chain:2"), COST)
    model.setup_kv_cache(len(prompt) + NEW_TOKENS + 8)
    root, _ = decoder.prefill(prompt, NEW_TOKENS)
    assert calls == [("prefill", len(prompt) - 1)]
    assert decoder.proposer.session.n_committed == len(prompt) - 1
    phase[0] = "cycle"
    draft = decoder.draft(root, max_levels=2)
    assert draft.draft_levels == 2
    # level 1: the pending entry alone; level 2: the one frontier node
    assert calls[1:] == [("cycle", 1), ("cycle", 1)]


def test_the_drafter_warm_up_runs_each_catch_up_length_once_per_drafter_and_changes_no_draft(checkpoints):
    """A proposer with ``warm_lengths`` runs the drafter over 1 .. n entries in its first prefill
    (on a GPU a length's first pass is slow; off the clock there), once per drafter; the slots it
    writes are overwritten before they are read, so every cycle drafts and commits as without it."""
    model, drafter = load(*checkpoints["qwen3_moe"], cache_experts=8)
    assert Proposer(drafter, 4).warm_lengths == 0            # the CPU's default: nothing to warm
    prompt = prompts()[2]
    policy = make_policy("eagle3:16:4")
    plain = Decoder(model, Proposer(drafter, 4, warm_lengths=0), policy, COST).generate(prompt, NEW_TOKENS,
                                                                                          ignore_eos=True)
    calls: list[int] = []
    forward = drafter.forward

    def counted(hidden, input_ids, positions, mask=None, **options):
        calls.append(int(input_ids.numel()))
        return forward(hidden, input_ids, positions, mask, **options)

    drafter.forward = counted
    warmed = Decoder(model, Proposer(drafter, 4, warm_lengths=6), policy, COST).generate(prompt, NEW_TOKENS,
                                                                                          ignore_eos=True)
    assert calls[:7] == [1, 2, 3, 4, 5, 6, len(prompt) - 1]
    assert warmed.output_ids == plain.output_ids and warmed.cycle_tokens == plain.cycle_tokens
    for a, b in zip(warmed.cycles, plain.cycles, strict=True):
        assert a.verification.nodes.tolist() == b.verification.nodes.tolist()
        assert a.draft.tree.tokens.tolist() == b.draft.tree.tokens.tolist()
    calls.clear()
    Decoder(model, Proposer(drafter, 4, warm_lengths=6), policy, COST).generate(prompt, 4, ignore_eos=True)
    assert calls[0] == len(prompt) - 1                       # the same drafter is not warmed twice


def test_a_generations_kept_cycles_hold_no_logits_or_features(checkpoints):
    """Each kept cycle held its verification's [nodes, vocab] logits and captured features and the
    predictions' per-node rows to the generation's end (0.63 MB a cycle of this model's EAGLE-3
    tree; on CUDA on the device): only the cycle itself reads them."""
    model, drafter = load(*checkpoints["qwen3_moe"], cache_experts=8)
    seen = []

    def during(stats, tokens):           # the callback still sees the whole cycle
        seen.append(stats.verification.logits is not None and stats.verification.hidden is not None)

    result = Decoder(model, Proposer(drafter, 4), make_policy("eagle3:16:4"), COST).generate(
        prompts()[2], NEW_TOKENS, ignore_eos=True, on_cycle=during)
    assert result.cycles and all(seen)
    for stats in result.cycles:
        assert stats.verification.logits is None and stats.verification.hidden is None
        assert stats.draft.last_known_rows is None and stats.draft.contexts == []
        assert stats.verification.expert_ids.shape[0] == stats.verification.nodes.size   # the rows' data stays


def test_tree_verification_equals_linear_sequences_and_compaction_keeps_the_path(checkpoints):
    """One pass over a tree (mask + per-node positions) gives every node the logits of its own
    root-to-node path run as a plain sequence; after compaction of an accepted path, decoding
    continues as if only that path had ever been run."""
    model = load_model(checkpoints["olmoe"][0], cache_experts=3)
    prefix = prompts()[2]
    rng = np.random.default_rng(5)
    parents = np.array([-1, 0, 0, 1, 1, 2, 3, 3])
    tree = DraftTree(parents=parents, path_probs=0.5 ** np.r_[0, 1, 1, 2, 2, 2, 3, 3].astype(float),
                     tokens=rng.integers(0, VOCAB, parents.size))
    decoder = Decoder(model)
    model.setup_kv_cache(len(prefix) + 16)
    decoder.prefill(prefix)
    verification = decoder.verify(tree, np.arange(tree.n_nodes))

    def linear(path, then=()):
        sequence = prefix + tree.tokens[path].tolist() + list(then)
        model.setup_kv_cache(len(sequence) + 4)
        return model(sequence, np.arange(len(sequence)), causal_mask(0, len(sequence))).logits

    for node in range(tree.n_nodes):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(int(parents[path[-1]]))
        torch.testing.assert_close(verification.logits[node], linear(path[::-1])[-1], rtol=1e-4, atol=1e-4)

    # commit root -> 1 -> 3 with a chosen bonus token, then run one more token on the compacted cache
    model.setup_kv_cache(len(prefix) + 16)
    decoder.prefill(prefix)
    verification = decoder.verify(tree, np.arange(tree.n_nodes))
    decoder.keep_path(verification, np.array([0, 1, 3]))
    bonus = 7
    n = decoder.cache_len
    after = model([bonus], [n], np.ones((1, n + 1), dtype=bool)).logits[-1]
    torch.testing.assert_close(after, linear([0, 1, 3], then=[bonus])[-1], rtol=1e-4, atol=1e-4)


def test_router_predictor_routes_an_embedding_like_the_target_and_tells_siblings_apart(checkpoints):
    model = load_model(checkpoints["qwen3_moe"][0], cache_experts=3)
    predictor = RouterPredictor(model)
    tokens = np.arange(12)
    unknown = np.full((12, model.config.n_layers, model.config.top_k), -1)
    experts = predictor.predict(NodeBatch(tokens, unknown))
    assert experts.shape == (12, model.config.n_layers, model.config.top_k)
    # by hand: RMSNorm of the embedding, each layer's post-attention norm, its router's top-k
    x = model.embed_tokens.weight[torch.from_numpy(tokens)]
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + model.config.rms_norm_eps)
    for layer, block in enumerate(model.layers):
        logits = block.moe.gate(block.post_attention_layernorm.weight * x)
        want = logits.topk(model.config.top_k, dim=-1).indices.numpy()
        assert np.array_equal(np.sort(experts[:, layer], axis=1), np.sort(want, axis=1))
    # siblings (different tokens, same parent context) get different expert sets somewhere
    context = torch.randn(1, model.config.hidden_size).expand(12, -1)
    with_context = predictor.predict(NodeBatch(tokens, unknown, context=context))
    assert len({e.tobytes() for e in np.sort(with_context, axis=2)}) > 1
    assert not np.array_equal(np.sort(with_context, axis=2), np.sort(experts, axis=2))


def test_levers_keep_greedy_output_and_prefetched_experts_are_the_right_weights(checkpoints):
    """Eviction by the draft's look-ahead, prefetch into the drafter's time (a worker thread on
    CPU) and online acceptance: the output stays the target's own, token for token; a slot filled
    by a prefetch with a wrong expert's weights would change it."""
    model_dir, drafter_dir = checkpoints["qwen3_moe"]
    model, drafter = load(model_dir, drafter_dir, cache_experts=3)
    expected = [Decoder(model).generate(p, NEW_TOKENS, ignore_eos=True).output_ids for p in prompts()]
    # a draft level long enough to carry several copies: prefetch happens in every drafting cycle
    cost = COST.replace(draft_level_s=2e-3)
    for spec in ("chain:3+cache+prefetch", "specfit+cache+prefetch+online"):
        model.offload.reset()
        decoder = speculative_decoder(model, drafter, make_policy(spec, max_levels=6), cost, tree_top_k=3)
        results = [decoder.generate(p, NEW_TOKENS, ignore_eos=True) for p in prompts()]
        assert [r.output_ids for r in results] == expected, spec
        cycles = [c for r in results for c in r.cycles]
        assert sum(c.draft.prefetched for c in cycles) > 0, spec
        for stats in cycles:
            row = live_row(stats, cost, model.offload.host.expert_bytes)
            assert row["bytes_h2d"] == (row["misses"] + row["prefetched"]) * model.offload.host.expert_bytes
            assert stats.draft.prefetch_wait_s <= stats.verify_time_s + 1e-9
        # a prompt's record counts every copy: its prompt pass, its cycles' passes, its prefetches
        expert_bytes = model.offload.host.expert_bytes
        for r in results:
            record = r.to_dict()
            copied = sum(c.offload.total_misses + c.draft.prefetched for c in r.cycles) * expert_bytes
            assert record["decode_bytes_h2d"] == copied
            assert record["bytes_h2d"] == copied + r.prefill_offload.total_misses * expert_bytes


def test_the_decoder_reports_what_each_cycle_revealed(checkpoints):
    """The Observation the live decoder hands the policy: the drafted tree, the verified nodes and
    their verdicts (every accepted token among them), the misses against what the policy saw, and
    the policy's own time; the same fields the replay fills in."""
    from specfit.policy_base import edge_outcomes
    from specfit.specfit_policy import SpecFitPolicy

    seen = []

    class Spy(SpecFitPolicy):
        def observe(self, observation):
            seen.append(observation)
            super().observe(observation)

    model, drafter = load(*checkpoints["qwen3_moe"], cache_experts=3)
    # with the online refit the measured cycles the cost model is fitted on hold the decisions'
    # time already: it is not reported for pricing on top
    online = speculative_decoder(model, drafter, Spy(6), COST, tree_top_k=3)
    online.generate(prompts()[3], 8, ignore_eos=True)
    assert seen and all(obs.decision_time_s is None for obs in seen)
    seen.clear()
    decoder = speculative_decoder(model, drafter, Spy(6), COST, tree_top_k=3, online_refit=False)
    result = decoder.generate(prompts()[3], NEW_TOKENS, ignore_eos=True)
    assert len(seen) == len(result.cycles)
    for obs, stats in zip(seen, result.cycles):
        assert obs.tree is stats.draft.tree and obs.verified.tolist() == stats.verification.nodes.tolist()
        assert obs.verdicts.tolist() == stats.verification.verdicts.tolist()
        assert obs.misses == stats.offload.total_misses and obs.predicted_misses == stats.draft.selection.misses
        if obs.verified.size == 1:
            assert obs.misses == obs.root_misses
        assert obs.decision_time_s is not None and 0 <= obs.decision_time_s <= stats.draft_time_s
        nodes, accepted = edge_outcomes(obs)
        # the committed draft tokens are exactly the accepted edges on the verified path
        assert int(accepted[np.isin(nodes, stats.verification.nodes)].sum()) == stats.committed_tokens - 1


def _compiled_signatures() -> dict:
    """kernel name -> the argument types numba has compiled it for, in this process."""
    import importlib

    from numba.core.registry import CPUDispatcher

    from specfit import kernels

    out = {}
    for name in kernels._MODULES:
        module = importlib.import_module(f"specfit.kernels.{name}")
        for attr, value in vars(module).items():
            if isinstance(value, CPUDispatcher) and value.__module__ == module.__name__:
                out[f"{name}.{attr}"] = set(value.signatures)
    return out


def test_a_live_decode_after_the_warm_up_compiles_nothing(checkpoints):
    """Every kernel a live cycle calls is loaded by the warm-up with the argument types the cycle
    passes (read-only tree arrays, the KV cache's bytes, ...): otherwise a timed cycle compiles."""
    from specfit.kernel_warmup import warm_up

    model, drafter = load(*checkpoints["qwen3_moe"], cache_experts=2)
    warm_up()
    before = _compiled_signatures()
    for spec in ("ar", "eagle3:12:3", "specfit", "specfit+cache+prefetch", "ar+usage"):
        decoder = speculative_decoder(model, drafter, make_policy(spec), COST, tree_top_k=3)
        decoder.generate(prompts()[2], NEW_TOKENS, ignore_eos=True)
    # sampling: the walk, and the acceptance learned online from its edges (refitted within the run)
    policy = make_policy("specfit+online")
    policy.acceptance.min_edges = 4
    decoder = speculative_decoder(model, drafter, policy, COST, tree_top_k=3, temperature=0.8, seed=1)
    decoder.generate(prompts()[2], NEW_TOKENS, ignore_eos=True)
    assert policy.acceptance.coef_ is not None
    after = _compiled_signatures()
    new = {k: sorted(map(str, v - before.get(k, set()))) for k, v in after.items() if v - before.get(k, set())}
    assert new == {}, "\n".join(f"{k}: {v}" for k, v in new.items())
