"""The standalone forward pass against ``transformers`` on tiny random checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime_fixtures import (FAMILIES, N_LAYERS, TOP_K, VOCAB, load_reference, make_tiny_model,
                              shard_checkpoint)
from runtime_fixtures import torch_single_thread  # noqa: F401  (autouse: one intra-op thread)
from specfit.runtime.loader import load_model
from specfit.runtime.decoder import greedy_verdicts
from specfit.runtime.acceptance import NonFiniteLogits
from specfit.runtime.model import causal_mask
from specfit.tree import DraftTree

pytest.importorskip("transformers")

SEQ = 12


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Checkpoints built once per module: key -> directory."""
    cache = {}

    def get(family, fused=False, **overrides):
        key = (family, fused, tuple(sorted(overrides.items())))
        if key not in cache:
            cache[key] = make_tiny_model(family, tmp_path_factory.mktemp(family), fused_experts=fused, **overrides)
        return cache[key]

    return get


def _tokens(n=SEQ, seed=1):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _reference_outputs(model_dir, ids, dtype=torch.float32):
    ref = load_reference(model_dir, dtype)
    with torch.no_grad():
        return ref(ids[None], output_router_logits=True, output_hidden_states=True)


def _ours(model_dir, dtype=torch.float32, cache_experts=3, max_seq_len=64, **kwargs):
    model = load_model(model_dir, dtype=dtype, cache_experts=cache_experts, **kwargs)
    model.setup_kv_cache(max_seq_len)
    return model


CASES = [(family, {}) for family in FAMILIES] + [
    ("qwen3_moe", {"tie_word_embeddings": True}),
    ("olmoe", {"clip_qkv": 0.3}),
    ("mixtral", {"sliding_window": 5}),
    # against a regression in config.py (OLMoE's window applied): transformers' OLMoE ignores the key
    ("olmoe", {"sliding_window": 4}),
]


@pytest.mark.parametrize("family,overrides", CASES, ids=lambda v: v if isinstance(v, str) else "-".join(map(str, v)) or "default")
def test_logits_match_transformers_float32(model_dirs, family, overrides):
    model_dir = model_dirs(family, **overrides)
    ids = _tokens()
    expected = _reference_outputs(model_dir, ids).logits[0]
    out = _ours(model_dir)(ids, torch.arange(SEQ))
    assert (out.logits - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_argmax_matches_transformers_bfloat16(model_dirs, family):
    model_dir = model_dirs(family)
    ids = _tokens()
    expected = _reference_outputs(model_dir, ids, torch.bfloat16).logits[0]
    out = _ours(model_dir, dtype=torch.bfloat16)(ids, torch.arange(SEQ))
    assert out.logits.dtype == torch.bfloat16
    assert torch.equal(out.logits.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("family", FAMILIES)
def test_routing_and_captured_hidden_states_match_transformers(model_dirs, family):
    model_dir = model_dirs(family)
    ids = _tokens()
    reference = _reference_outputs(model_dir, ids)
    model = _ours(model_dir, capture_layers=(0, 1, 1))
    out = model(ids, torch.arange(SEQ))
    assert out.expert_ids.shape == (SEQ, N_LAYERS, TOP_K)
    for layer, router_logits in enumerate(reference.router_logits):
        expected = torch.topk(router_logits.softmax(-1), TOP_K, dim=-1).indices.numpy()
        np.testing.assert_array_equal(out.expert_ids[:, layer], expected)
    # hidden_states[l] is the input of decoder layer l
    expected_hidden = torch.cat([reference.hidden_states[layer][0] for layer in (0, 1, 1)], dim=-1)
    torch.testing.assert_close(out.hidden, expected_hidden, rtol=0, atol=1e-6)


def test_default_capture_layers_follow_eagle3_and_clip_for_tiny_models(model_dirs):
    model = _ours(model_dirs("qwen3_moe"))
    assert model.capture_layers == (1, 1, 0)   # layers 2, L/2, L-3 clipped to [0, L-1] for L = 2
    out = model(_tokens(), torch.arange(SEQ))
    assert out.hidden.shape == (SEQ, 3 * 64)


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_expert_checkpoint_gives_the_same_logits(model_dirs, family):
    ids = _tokens()
    per_expert = _ours(model_dirs(family))(ids, torch.arange(SEQ)).logits
    fused = _ours(model_dirs(family, fused=True))(ids, torch.arange(SEQ)).logits
    assert torch.equal(per_expert, fused)


def test_sharded_checkpoint_loads(tmp_path):
    model_dir = make_tiny_model("qwen3_moe", tmp_path / "sharded")
    ids = _tokens()
    single = _ours(model_dir)(ids, torch.arange(SEQ)).logits
    shard_checkpoint(model_dir, n_shards=3)
    assert not (model_dir / "model.safetensors").exists()
    assert torch.equal(_ours(model_dir)(ids, torch.arange(SEQ)).logits, single)


def _tree():
    #        0
    #      / | \
    #     1  2  3
    #    / \     \
    #   4   5     6
    #   |
    #   7
    parents = np.array([-1, 0, 0, 0, 1, 1, 3, 4])
    tokens = np.array([5, 17, 42, 9, 63, 2, 88, 30])
    return DraftTree(parents=parents, path_probs=np.linspace(1.0, 0.3, 8), tokens=tokens)


def _path_to(tree, node):
    path = [node]
    while tree.parents[path[-1]] >= 0:
        path.append(int(tree.parents[path[-1]]))
    return path[::-1]


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_masked_logits_equal_linear_sequences(model_dirs, family):
    model_dir = model_dirs(family)
    prompt = _tokens(6, seed=3)
    tree = _tree()
    model = _ours(model_dir)
    model(prompt, torch.arange(prompt.numel()))
    n = prompt.numel()
    mask = np.concatenate([np.ones((tree.n_nodes, n), dtype=bool), tree.attention_mask()], axis=1)
    tree_logits = model(tree.tokens, tree.positions(n), torch.from_numpy(mask)).logits

    linear = _ours(model_dir)
    for node in range(tree.n_nodes):
        sequence = torch.cat([prompt, torch.as_tensor(tree.tokens[_path_to(tree, node)])])
        expected = linear(sequence, torch.arange(sequence.numel()), logits_rows=[-1]).logits[0]
        assert (tree_logits[node] - expected).abs().max().item() <= 1e-5, f"node {node}"


@pytest.mark.parametrize("family", FAMILIES)
def test_kv_compaction_continues_like_the_linear_sequence(model_dirs, family):
    model_dir = model_dirs(family)
    prompt = _tokens(6, seed=4)
    tree = _tree()
    accepted = [0, 1, 4, 7]
    model = _ours(model_dir)
    model(prompt, torch.arange(prompt.numel()))
    n = prompt.numel()
    mask = np.concatenate([np.ones((tree.n_nodes, n), dtype=bool), tree.attention_mask()], axis=1)
    model(tree.tokens, tree.positions(n), torch.from_numpy(mask))
    model.compact_kv(n, accepted)
    # after compaction the accepted path is an ordinary prefix: continue linearly
    cache_len = n + len(accepted)
    next_ids = torch.tensor([11, 12, 13])
    after = model(next_ids, torch.arange(cache_len, cache_len + 3)).logits

    sequence = torch.cat([prompt, torch.as_tensor(tree.tokens[accepted]), next_ids])
    expected = _ours(model_dir)(sequence, torch.arange(sequence.numel())).logits[-3:]
    assert (after - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64, torch.bfloat16])
def test_kv_compaction_moves_the_kept_entries_of_every_layer(model_dirs, dtype):
    """Every layer's keys and values at the kept slots move to the slots after the committed ones,
    the entries already in place stay, the committed ones are untouched: checked slot by slot
    against copies taken before, by the compiled kernel on the host's bytes (float32, float16,
    float64) and on the one torch tensor that holds every layer (bfloat16, which numpy cannot
    view)."""
    model = _ours(model_dirs("qwen3_moe"), dtype=dtype, max_seq_len=32)
    generator = torch.Generator().manual_seed(5)
    caches = [layer.self_attn.kv_cache for layer in model.layers]
    for cache in caches:
        cache.k.copy_(torch.randn(cache.k.shape, generator=generator))
        cache.v.copy_(torch.randn(cache.v.shape, generator=generator))
    before = [(cache.k.clone(), cache.v.clone()) for cache in caches]
    committed, keep = 7, np.array([0, 1, 4, 6, 9])
    model.compact_kv(committed, keep)
    for cache, (k, v) in zip(caches, before):
        for slot in range(committed):
            assert torch.equal(cache.k[:, slot], k[:, slot]) and torch.equal(cache.v[:, slot], v[:, slot])
        for i, kept in enumerate(keep):
            assert torch.equal(cache.k[:, committed + i], k[:, committed + kept])
            assert torch.equal(cache.v[:, committed + i], v[:, committed + kept])


# float32 on the CPU: the compiled host kernel; bfloat16: the torch path (every GPU dtype, MLA models
# too), which checked only the order until mutation round s52 (keep = [-1, 2] copied committed slot
# cache_len - 1 over a new token's slot; an index past the cache was a raw IndexError)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["host-kernel", "torch-path"])
@pytest.mark.parametrize("keep, message", [([0, 3, 2], "ascending"), ([1, 1], "ascending"), ([-1, 2], "within"),
                                            ([0, 40], "within"),
                                            ([0, 28], "within")])     # slot 4 + 28 = 32: one past the last
def test_kv_compaction_rejects_keep_it_cannot_move_and_moves_nothing(model_dirs, keep, message, dtype):
    model = _ours(model_dirs("qwen3_moe"), dtype=dtype, max_seq_len=32)
    assert (model._kv_host is None) == (dtype != torch.float32)
    cache = model.layers[0].self_attn.kv_cache
    cache.k.copy_(torch.randn(cache.k.shape, generator=torch.Generator().manual_seed(1)))
    before = cache.k.clone()
    with pytest.raises(ValueError, match=message):
        model.compact_kv(4, np.array(keep))
    assert torch.equal(cache.k, before)


def test_greedy_verdicts_are_torch_argmax_ties_to_the_first():
    generator = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 4, (64, 50), generator=generator).float()    # many ties
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        got = greedy_verdicts(logits.to(dtype))
        assert got.dtype == np.int64 and got.tolist() == logits.to(dtype).argmax(dim=-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_greedy_verdicts_refuse_a_row_without_a_greedy_token(dtype):
    """NaN (which both argmaxes take for the maximum) or every logit -inf: named by its row; +inf is
    the greedy token it is."""
    logits = torch.zeros(3, 5, dtype=dtype)
    logits[1, 2] = float("inf")
    assert greedy_verdicts(logits).tolist() == [0, 2, 0]
    for row, values in ((2, [0.0, 1.0, float("nan"), 3.0, 0.0]), (1, [-float("inf")] * 5)):
        bad = logits.clone()
        bad[row] = torch.tensor(values, dtype=dtype)
        with pytest.raises(NonFiniteLogits, match=f"row {row} holds NaN or no logit above -inf"):
            greedy_verdicts(bad)


def test_causal_mask_is_a_linear_continuation():
    mask = causal_mask(2, 3)
    assert mask.tolist() == [[True, True, True, False, False],
                             [True, True, True, True, False],
                             [True, True, True, True, True]]


def test_bad_forward_arguments_are_rejected(model_dirs):
    model = _ours(model_dirs("qwen3_moe"), max_seq_len=16)
    with pytest.raises(ValueError, match="positions"):
        model(torch.tensor([1, 2]), torch.tensor([0]))
    with pytest.raises(ValueError, match="consecutive"):
        model(torch.tensor([1, 2]), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="attn_mask"):
        model(torch.tensor([1, 2]), torch.tensor([0, 1]), torch.ones(3, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="exceed"):
        model(torch.arange(17) % VOCAB, torch.arange(17))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model.setup_kv_cache(10_000)


# against a regression in routers.py (the routing weights cast to the activation dtype for the wrong
# families): in bfloat16, each family's routing weights equal its transformers router's, dtype included
@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "mixtral"])
def test_bfloat16_routing_weights_equal_the_transformers_router_with_its_dtype(family):
    from transformers import AutoModelForCausalLM

    from runtime_fixtures import tiny_config
    from specfit.runtime.config import ModelConfig
    from specfit.runtime.routers import route

    reference_config = tiny_config(family)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(reference_config, dtype=torch.bfloat16)
    gate = reference.model.layers[0].mlp.gate
    with torch.no_grad():
        gate.weight.normal_(0.0, 0.5)
    config = ModelConfig.from_dict(reference_config.to_dict() | {"architectures": [type(reference).__name__]})
    x = torch.randn(32, reference_config.hidden_size, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        _, want_weights, want_ids = gate(x)
    weights, ids = route(x, gate.weight, config)
    assert torch.equal(ids, want_ids)
    assert weights.dtype == want_weights.dtype and torch.equal(weights, want_weights)


# against a regression in model.py (a sliding window measured from the tree nodes' slots instead of their
# positions): a tree whose deep node has an ancestor drafted late in its level, so slot != position
def test_tree_masked_logits_equal_linear_sequences_under_a_sliding_window(tmp_path):
    from specfit.tree import DraftTree

    model_dir = make_tiny_model("mixtral", tmp_path, sliding_window=2)
    prompt = torch.randint(0, 96, (6,), generator=torch.Generator().manual_seed(3))
    #   0 -> 1, 2, 3;  3 -> 4 -> 5   (node 3: position n + 1, slot n + 3)
    tree = DraftTree(parents=np.array([-1, 0, 0, 0, 3, 4]), path_probs=np.linspace(1.0, 0.5, 6),
                     tokens=np.array([5, 17, 42, 9, 63, 2]))
    model = load_model(model_dir, cache_experts=8)
    model.setup_kv_cache(32)
    n = prompt.numel()
    model(prompt, torch.arange(n))
    mask = np.concatenate([np.ones((tree.n_nodes, n), dtype=bool), tree.attention_mask()], axis=1)
    tree_logits = model(tree.tokens, tree.positions(n), torch.from_numpy(mask)).logits
    linear = load_model(model_dir, cache_experts=8)
    linear.setup_kv_cache(32)
    for node, path in enumerate([[0], [0, 1], [0, 2], [0, 3], [0, 3, 4], [0, 3, 4, 5]]):
        sequence = torch.cat([prompt, torch.as_tensor(tree.tokens[path])])
        expected = linear(sequence, torch.arange(sequence.numel()), logits_rows=[-1]).logits[0]
        assert (tree_logits[node] - expected).abs().max().item() <= 1e-5, f"node {node}"


# against a regression in model.py (routed experts summed in another order): with top-k 4 (more than two
# terms per token, where float addition order matters) float32 logits equal transformers' bit for
# bit, as the MoE block's comment promises
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_float32_logits_equal_transformers_bit_for_bit_with_four_experts_per_token(tmp_path, family):
    from runtime_fixtures import load_reference

    model_dir = make_tiny_model(family, tmp_path, num_experts_per_tok=4)
    ids = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = load_reference(model_dir)(ids[None]).logits[0]
    model = load_model(model_dir, cache_experts=8)
    model.setup_kv_cache(32)
    assert torch.equal(model(ids, torch.arange(12)).logits, want)


# against a regression in model.py (attention softmax in the compute dtype instead of float32: in float16 it
# rounds differently now and then) and G04 / RT05 in the whole forward: test_argmax_matches_transformers_bfloat16
# pins the argmax only, while the 16-bit logits are in fact bit-identical to transformers' eager path
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "mixtral"])
def test_16_bit_logits_equal_transformers_bit_for_bit(tmp_path, family, dtype):
    from runtime_fixtures import load_reference

    model_dir = make_tiny_model(family, tmp_path)
    ids = torch.randint(0, 96, (48,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = load_reference(model_dir, dtype)(ids[None]).logits[0]
    model = load_model(model_dir, dtype=dtype, cache_experts=3)
    model.setup_kv_cache(64)
    assert torch.equal(model(ids, torch.arange(48)).logits, want)
