"""The EAGLE-3 drafter: checkpoint format, vocabulary mapping, errors, KV cache and tree masks."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from specfit.errors import SpecFitError
from specfit.experts.calibration import AcceptanceCalibrator
from specfit.policies import rerank
from specfit.runtime.drafting import DraftOutput, DrafterSession, TreeDraft
from specfit.runtime.eagle3 import Eagle3Config, Eagle3Drafter
from specfit.traces.format import Trace, read_trace

from trace_helpers import SAMPLE_OLMOE, hand_trace

VOCAB, DRAFT_VOCAB, TARGET_H = 64, 24, 40

CONFIG = Eagle3Config(
    hidden_size=TARGET_H, target_hidden_size=TARGET_H, vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,   # head_dim is not hidden / heads
    intermediate_size=56, rope_theta=500.0, aux_hidden_state_layer_ids=(1, 2, 3),
)
DRAFT_IDS = torch.arange(0, 3 * DRAFT_VOCAB, 3)[:DRAFT_VOCAB] % VOCAB   # every third target token


def random_drafter(seed: int = 0, target_embed: torch.Tensor | None = None) -> Eagle3Drafter:
    drafter = Eagle3Drafter(CONFIG, target_embed=target_embed)
    drafter.init_weights(seed, std=0.3)            # large enough that attention is far from uniform
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn(param.shape, generator=torch.Generator().manual_seed(seed)))
    drafter.set_draft_vocabulary(DRAFT_IDS)
    return drafter.eval()


def target_embedding(seed: int = 1) -> torch.Tensor:
    return torch.randn(VOCAB, TARGET_H, generator=torch.Generator().manual_seed(seed))


def features(n: int, seed: int = 2) -> torch.Tensor:
    return torch.randn(n, 3 * TARGET_H, generator=torch.Generator().manual_seed(seed))


def tokens(n: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def run(drafter: Eagle3Drafter, hidden, ids, positions=None, mask=None, slots: int = 64):
    if drafter.max_seq_len < slots:
        drafter.setup_kv_cache(slots)
    positions = torch.arange(len(ids)) if positions is None else torch.as_tensor(positions)
    return drafter(hidden, ids, positions, mask)


# ----------------------------------------------------------------- the math
def reference_forward(drafter: Eagle3Drafter, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """EAGLE-3's layer written out from the published description, causal over T tokens."""
    sd = {name: t.detach() for name, t in drafter.state_dict().items()}
    embed = drafter.embed(ids)

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + CONFIG.rms_norm_eps))

    h = hidden @ sd["fc.weight"].T
    x = torch.cat([rms(embed, sd["midlayer.input_layernorm.weight"]), rms(h, sd["midlayer.hidden_norm.weight"])], -1)
    T, hd = len(ids), CONFIG.head_dim
    q = (x @ sd["midlayer.self_attn.q_proj.weight"].T).view(T, 4, hd)
    k = (x @ sd["midlayer.self_attn.k_proj.weight"].T).view(T, 2, hd)
    v = (x @ sd["midlayer.self_attn.v_proj.weight"].T).view(T, 2, hd)
    inv_freq = 1.0 / CONFIG.rope_theta ** (torch.arange(0, hd, 2).float() / hd)
    angles = torch.arange(T).float()[:, None] * inv_freq
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]

    def rope(t):
        return t * cos + torch.cat([-t[..., hd // 2:], t[..., : hd // 2]], -1) * sin

    q, k = rope(q), rope(k)
    out = torch.empty(T, 4, hd)
    for head in range(4):
        kv = head // 2                                  # KV head j serves query heads 2j, 2j+1
        scores = q[:, head] @ k[:, kv].T / hd ** 0.5
        scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        out[:, head] = scores.softmax(-1) @ v[:, kv]
    h = h + out.reshape(T, -1) @ sd["midlayer.self_attn.o_proj.weight"].T
    y = rms(h, sd["midlayer.post_attention_layernorm.weight"])
    mlp = (F.silu(y @ sd["midlayer.mlp.gate_proj.weight"].T) * (y @ sd["midlayer.mlp.up_proj.weight"].T))
    h = h + mlp @ sd["midlayer.mlp.down_proj.weight"].T
    return rms(h, sd["norm.weight"]) @ sd["lm_head.weight"].T


def test_forward_matches_the_published_layer_written_out():
    drafter = random_drafter()
    hidden, ids = features(9), tokens(9)
    out = run(drafter, hidden, ids)
    torch.testing.assert_close(out.logits, reference_forward(drafter, hidden, ids), rtol=1e-4, atol=1e-4)
    assert out.logits.shape == (9, DRAFT_VOCAB) and out.hidden.shape == (9, TARGET_H)


def test_fed_back_hidden_state_skips_fc():
    drafter = random_drafter()
    own = torch.randn(5, TARGET_H)
    a = run(drafter, own, tokens(5))
    with torch.no_grad():
        drafter.fc.weight.zero_()                       # fc must not touch an H-wide input
    b = run(drafter, own, tokens(5))
    torch.testing.assert_close(a.logits, b.logits)


# ----------------------------------------------------------------- checkpoint format
@pytest.mark.parametrize("layer_prefix", ["midlayer.", "layers.0."])
@pytest.mark.parametrize("own_embedding", [True, False])
def test_save_load_round_trip(tmp_path, layer_prefix, own_embedding):
    embed = None if own_embedding else target_embedding()
    drafter = random_drafter(target_embed=embed)
    drafter.save_pretrained(tmp_path, layer_prefix=layer_prefix)

    names = set(load_file(tmp_path / "model.safetensors"))
    assert f"{layer_prefix}self_attn.q_proj.weight" in names and {"fc.weight", "d2t", "t2d", "lm_head.weight"} <= names
    assert ("embed_tokens.weight" in names) == own_embedding
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["head_dim"] == 16 and config["draft_vocab_size"] == DRAFT_VOCAB
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]

    loaded = Eagle3Drafter.from_pretrained(tmp_path, target_embed=embed)
    assert loaded.config == drafter.config
    hidden, ids = features(7), tokens(7)
    torch.testing.assert_close(run(loaded, hidden, ids).logits, run(drafter, hidden, ids).logits, rtol=0, atol=0)


def test_a_loaded_drafter_owns_its_weights_in_the_asked_dtype_with_float32_rope(tmp_path):
    """Built on the meta device and given the checkpoint's tensors: they are copies (a write into
    the file afterwards changes nothing), cast to ``dtype``, and the RoPE frequencies float32."""
    drafter = random_drafter(target_embed=target_embedding())
    drafter.save_pretrained(tmp_path)
    loaded = Eagle3Drafter.from_pretrained(tmp_path, target_embed=target_embedding())
    half = Eagle3Drafter.from_pretrained(tmp_path, target_embed=target_embedding(), dtype=torch.bfloat16)
    before = {name: t.clone() for name, t in loaded.state_dict().items()}
    path = tmp_path / "model.safetensors"
    header = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    with open(path, "r+b") as f:                      # in place: a memory map of the file would see it
        f.seek(header)
        f.write(bytes(path.stat().st_size - header))
    for name, t in loaded.state_dict().items():
        assert torch.equal(t, before[name]), name
        assert not t.is_meta
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert half.inv_freq.dtype == torch.float32 and torch.equal(half.inv_freq, drafter.inv_freq)
    assert not any(p.requires_grad for p in half.parameters()) and not half.training
    hidden, ids = features(7), tokens(7)
    torch.testing.assert_close(run(loaded, hidden, ids).logits, run(drafter, hidden, ids).logits, rtol=0, atol=0)


def test_checkpoint_without_lm_head_uses_the_targets_draft_rows(tmp_path):
    drafter = random_drafter(target_embed=target_embedding())
    drafter.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    target_lm_head = torch.randn(VOCAB, TARGET_H)
    del tensors["lm_head.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    loaded = Eagle3Drafter.from_pretrained(tmp_path, target_embed=target_embedding(), target_lm_head=target_lm_head)
    torch.testing.assert_close(loaded.lm_head.weight, target_lm_head[DRAFT_IDS])


def test_d2t_maps_draft_tokens_to_target_ids(tmp_path):
    drafter = random_drafter()
    drafter.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert torch.equal(torch.arange(DRAFT_VOCAB) + tensors["d2t"], DRAFT_IDS)      # target_id = i + d2t[i]
    assert torch.equal(tensors["t2d"].nonzero().flatten(), DRAFT_IDS.sort().values)
    loaded = Eagle3Drafter.from_pretrained(tmp_path)
    assert torch.equal(loaded.to_target_ids(torch.tensor([0, 5, DRAFT_VOCAB - 1])), DRAFT_IDS[[0, 5, DRAFT_VOCAB - 1]])


# ----------------------------------------------------------------- bad checkpoints
def write_and_corrupt(tmp_path, change) -> None:
    random_drafter().save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    change(tensors, config)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("change, message", [
    (lambda t, c: t.pop("midlayer.mlp.up_proj.weight"), "missing tensor 'midlayer.mlp.up_proj.weight'"),
    (lambda t, c: t.pop("d2t"), "missing tensor 'd2t'"),
    (lambda t, c: t.update(d2t=t["d2t"][:-1].clone()), "tensor 'd2t'"),
    (lambda t, c: t.update(d2t=t["d2t"] + VOCAB), "outside the target vocabulary"),
    (lambda t, c: t.update(t2d=torch.ones(VOCAB + 1, dtype=torch.bool)), "tensor 't2d' has shape"),
    (lambda t, c: t.update(t2d=torch.ones(VOCAB, dtype=torch.bool)), "disagree"),
    (lambda t, c: c.update(target_hidden_size=TARGET_H * 2), "target with hidden size 40"),
    (lambda t, c: t.update({"midlayer.self_attn.q_proj.weight": torch.zeros(64, TARGET_H)}), "q_proj.weight' has shape"),
    (lambda t, c: c.update(num_hidden_layers=2), "num_hidden_layers"),
    (lambda t, c: c.pop("intermediate_size"), "missing key 'intermediate_size'"),
])
def test_bad_checkpoint_is_one_clear_error(tmp_path, change, message):
    write_and_corrupt(tmp_path, change)
    with pytest.raises(SpecFitError, match=message.replace("(", r"\(")):
        Eagle3Drafter.from_pretrained(tmp_path)


def test_target_with_another_hidden_size_or_vocabulary_is_rejected(tmp_path):
    drafter = random_drafter(target_embed=target_embedding())
    drafter.save_pretrained(tmp_path)
    with pytest.raises(SpecFitError, match=r"target_embed.*\[64, 48\].*\[64, 40\]"):
        Eagle3Drafter.from_pretrained(tmp_path, target_embed=torch.zeros(VOCAB, 48))
    with pytest.raises(SpecFitError, match="no tensor 'embed_tokens.weight'"):
        Eagle3Drafter.from_pretrained(tmp_path)
    with pytest.raises(SpecFitError, match="hidden_size 48"):
        drafter.check_target(vocab_size=VOCAB, hidden_size=48)
    with pytest.raises(SpecFitError, match="vocab_size 65"):
        drafter.check_target(vocab_size=VOCAB + 1, hidden_size=TARGET_H)
    # before any weight is read, the message names the drafter's config file
    from types import SimpleNamespace

    from specfit.runtime.loader import drafter_capture_layers

    with pytest.raises(SpecFitError, match=re.escape(f"{tmp_path / 'config.json'}: config key 'vocab_size' is {VOCAB}, "
                                                     f"but the target model has vocab_size {VOCAB + 1}")):
        drafter_capture_layers(tmp_path, SimpleNamespace(vocab_size=VOCAB + 1, hidden_size=TARGET_H, n_layers=4))
    with pytest.raises(SpecFitError, match="hidden width 100"):
        run(drafter, torch.zeros(2, 100), tokens(2))


def test_only_safetensors_checkpoints_load(tmp_path):
    random_drafter().save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(SpecFitError, match="only safetensors"):
        Eagle3Drafter.from_pretrained(tmp_path)


# ----------------------------------------------------------------- KV cache and trees
def test_incremental_forward_equals_full_forward():
    drafter = random_drafter()
    hidden, ids = features(12), tokens(12)
    full = run(drafter, hidden, ids)
    parts = [run(drafter, hidden[a:b], ids[a:b], positions=range(a, b)) for a, b in ((0, 5), (5, 6), (6, 12))]
    torch.testing.assert_close(torch.cat([p.logits for p in parts]), full.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([p.hidden for p in parts]), full.hidden, rtol=1e-5, atol=1e-5)


def test_tree_masked_forward_equals_linear_sequences():
    """Prefix of 6 committed entries, then one call over a tree: a <- root, b <- root, c <- a,
    d <- a. Each node must equal running its own path as a plain sequence."""
    drafter = random_drafter()
    prefix_hidden, prefix_ids = features(6), tokens(6)
    node_hidden = torch.randn(4, TARGET_H, generator=torch.Generator().manual_seed(9))   # fed-back states
    node_ids = tokens(4, seed=10)
    parents = [-1, -1, 0, 0]                            # within the new nodes; -1 = the committed prefix
    depth = [1, 1, 2, 2]
    mask = torch.zeros(4, 6 + 4, dtype=torch.bool)
    mask[:, :6] = True
    for i, parent in enumerate(parents):
        mask[i, 6 + i] = True
        if parent >= 0:
            mask[i, 6 + parent] = True
    run(drafter, prefix_hidden, prefix_ids)
    tree = run(drafter, node_hidden, node_ids, positions=[5 + d for d in depth], mask=mask)

    for i in range(4):
        path = [parents[i], i] if parents[i] >= 0 else [i]
        run(drafter, prefix_hidden, prefix_ids)
        linear = run(drafter, node_hidden[path], node_ids[path], positions=range(6, 6 + len(path)))
        torch.testing.assert_close(linear.logits[-1], tree.logits[i], rtol=1e-5, atol=1e-5)


def test_compact_kv_keeps_the_accepted_path():
    drafter = random_drafter()
    prefix_hidden, prefix_ids = features(5), tokens(5)
    node_hidden, node_ids = torch.randn(3, TARGET_H), tokens(3, seed=11)
    run(drafter, prefix_hidden, prefix_ids)
    mask = torch.ones(3, 8, dtype=torch.bool)
    mask[1, 5] = False                                  # node 1 is a sibling of node 0; node 2 child of 1
    mask[0, 6:] = False
    mask[1, 7] = False
    mask[2, 5] = False
    run(drafter, node_hidden, node_ids, positions=[5, 5, 6], mask=mask)
    drafter.compact_kv(5, [1, 2])                       # accept node 1 then node 2
    after = run(drafter, features(1, seed=12), tokens(1, seed=13), positions=[7])

    run(drafter, prefix_hidden, prefix_ids)
    run(drafter, node_hidden[[1, 2]], node_ids[[1, 2]], positions=[5, 6])
    expected = run(drafter, features(1, seed=12), tokens(1, seed=13), positions=[7])
    torch.testing.assert_close(after.logits, expected.logits, rtol=1e-5, atol=1e-5)


def test_chain_drafting_equals_step_by_step_greedy():
    drafter = random_drafter()
    session = DrafterSession(drafter, max_entries=32)
    prefix_hidden, prefix_ids = features(6), tokens(6)
    root = session.commit(prefix_hidden, prefix_ids)
    chain = TreeDraft(session, int(prefix_ids[-1]), lambda: root, top_k=1, max_levels=4)
    for _ in range(4):
        chain.grow()
    tree = chain.tree()
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3]

    run(drafter, prefix_hidden, prefix_ids)
    out, expected = root, []
    for step in range(4):
        token = int(drafter.to_target_ids(out.logits[-1].argmax()))
        expected.append(token)
        out = run(drafter, out.hidden[-1:], torch.tensor([token]), positions=[6 + step])
    assert tree.tokens[1:].tolist() == expected


def test_dynamic_tree_is_connected_with_non_increasing_path_probs():
    drafter = random_drafter()
    session = DrafterSession(drafter, max_entries=64)
    root = session.commit(features(6), tokens(6))
    drafting = TreeDraft(session, 7, lambda: root, top_k=3, max_levels=4)
    for level in range(4):
        added = drafting.grow()
        assert added.size == (3 if level == 0 else 9) and len(drafting.frontier) == 3
        assert np.all(drafting.depth[drafting.frontier] == level + 1)
    full = drafting.tree()
    tree = full.subtree(rerank(full, 10))
    assert tree.n_nodes == 10 and tree.max_depth <= 4
    assert np.all(tree.path_probs[1:] <= tree.path_probs[tree.parents[1:]])
    assert set(tree.tokens[1:].tolist()) <= set(DRAFT_IDS.tolist())


def test_dynamic_tree_levels_equal_a_plain_reference_of_eagle_expansion():
    """Each drafted level equals EAGLE-2/3's expansion written out plainly here (log-softmax, the
    top-k children of every frontier node, the next frontier the top-k new nodes by cumulative
    log-probability, ties to the earlier node), and each drafter call over a frontier gets the
    inputs the reference gives it (each row sees the committed entries, its ancestors' and itself)."""
    drafter = random_drafter(seed=5)
    session = DrafterSession(drafter, max_entries=64)
    root = session.commit(features(6), tokens(6))
    calls = []
    forward = drafter.forward

    def recorded(hidden, input_ids, positions, mask=None):
        calls.append(((input_ids, positions, mask), forward(hidden, input_ids, positions, mask)))
        return calls[-1][1]

    drafter.forward = recorded
    k = 3
    drafting = TreeDraft(session, 7, lambda: root, top_k=k, max_levels=4)
    parents, tok, cum, depth, slot = [-1], [7], [0.0], [0], {}
    frontier, committed, n_slots = [0], session.n_committed, 0
    for level in range(4):
        added = drafting.grow()
        out = root
        if level:
            (input_ids, positions, mask), out = calls[-1]
            cache_len = committed + n_slots
            expected = np.zeros((len(frontier), cache_len + len(frontier)), dtype=bool)
            for i, v in enumerate(frontier):
                expected[i, :committed] = True
                expected[i, cache_len + i] = True
                u = parents[v]
                while u > 0:
                    expected[i, slot[u]] = True
                    u = parents[u]
                slot[v] = cache_len + i
            n_slots += len(frontier)
            assert mask.numpy().tolist() == expected.tolist()
            assert input_ids.tolist() == [tok[v] for v in frontier]
            assert positions.tolist() == [committed - 1 + depth[v] for v in frontier]
        assert len(calls) == level
        top_lp, top_ids = F.log_softmax(out.logits.float(), dim=-1).topk(k, dim=-1)
        first = len(tok)
        for row, parent in enumerate(frontier):
            for j in range(k):
                parents.append(parent)
                tok.append(int(drafter.to_target_ids(top_ids[row, j])))
                cum.append(cum[parent] + float(top_lp[row, j]))
                depth.append(depth[parent] + 1)
        new = list(range(first, len(tok)))
        frontier = sorted(sorted(new, key=lambda v: (-cum[v], v))[:k])
        assert added.first == first and added.tokens.tolist() == tok[first:]
        assert added.parents.tolist() == parents[first:]
        # a child's context is its parent's drafter output
        torch.testing.assert_close(added.context, out.hidden[torch.arange(len(new)) // k])
        assert drafting.frontier.tolist() == frontier
    tree = drafting.tree()
    assert tree.parents.tolist() == parents and tree.tokens.tolist() == tok and tree.depth.tolist() == depth
    np.testing.assert_allclose(drafting.cum_logprob[: len(cum)], cum, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(tree.path_probs, np.exp(cum), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("calibrated", [False, True])
def test_nan_drafter_logits_are_one_clear_error_at_the_level_they_reach(calibrated):
    """A drafter whose logits hold NaN (a broken checkpoint) stops the tree with one error naming
    the level, raw or calibrated, instead of NaN path probabilities reaching the search."""
    session = DrafterSession(random_drafter(), max_entries=64)
    root = session.commit(features(6), tokens(6))
    calibrator = AcceptanceCalibrator().fit(read_trace(SAMPLE_OLMOE)) if calibrated else None
    drafting = TreeDraft(session, 7, lambda: root, top_k=3, max_levels=4, acceptance=calibrator)
    drafting.grow()
    forward = session.drafter.forward

    def broken(*args, **kwargs):
        out = forward(*args, **kwargs)
        logits = out.logits.clone()
        logits[0, 5] = float("nan")
        return DraftOutput(logits=logits, hidden=out.hidden)

    session.drafter.forward = broken
    with pytest.raises(SpecFitError, match=r"drafter: NaN probabilities at draft level 2 \(its logits hold NaN\)"):
        drafting.grow()


def test_a_calibrated_live_tree_has_the_path_probabilities_the_calibrator_gives_its_trace():
    """Live and replay apply one calibration: a tree drafted with the calibrator carries the path
    probabilities that calibrator gives the same tree recorded as a trace."""
    calibrator = AcceptanceCalibrator().fit(read_trace(SAMPLE_OLMOE))
    assert calibrator.edge_coef_ is not None and calibrator.coef_ is not None     # every step in use
    session = DrafterSession(random_drafter(), max_entries=64)
    root = session.commit(features(6), tokens(6))
    drafting = TreeDraft(session, 7, lambda: root, top_k=3, max_levels=4, acceptance=calibrator)
    for _ in range(4):
        drafting.grow()
    tree = drafting.tree()
    n = tree.n_nodes
    trace = Trace(meta=hand_trace().meta, offsets=np.array([0, n]), sequence=np.zeros(1, dtype=np.int32),
                  position=np.zeros(1, dtype=np.int32), parent=tree.parents.astype(np.int16),
                  depth=tree.depth.astype(np.int16), token=tree.tokens.astype(np.int32),
                  draft_logprob=drafting.edge_logprob.astype(np.float32), path_prob=np.ones(n),
                  verdict=np.full(n, -1, dtype=np.int32), true_experts=np.zeros((n, 1, 1), dtype=np.int16))
    np.testing.assert_allclose(tree.path_probs, calibrator.path_probs(trace), rtol=1e-6)
    own = np.exp(drafting.cum_logprob[:n])
    assert not np.allclose(tree.path_probs, own)                              # the calibration did act


def test_a_pass_computes_only_the_logits_rows_it_is_asked_for():
    """``logits_rows=[-1]`` (a pass over committed entries, whose newest alone drafts) gives the
    last row of the full pass's logits and every row's hidden state; the session asks for it."""
    drafter = random_drafter()
    hidden, ids = features(6), tokens(6)
    full = run(drafter, hidden, ids)
    drafter.setup_kv_cache(64)
    last = drafter(hidden, ids, torch.arange(6), logits_rows=[-1])
    assert last.logits.shape == (1, DRAFT_VOCAB) and last.hidden.shape == full.hidden.shape
    torch.testing.assert_close(last.logits, full.logits[-1:])
    torch.testing.assert_close(last.hidden, full.hidden)
    seen = []
    forward = drafter.forward
    drafter.forward = lambda *args, **options: seen.append(options.get("logits_rows")) or forward(*args, **options)
    session = DrafterSession(drafter, 64)
    out = session.commit(hidden, ids)
    assert seen == [[-1]]
    torch.testing.assert_close(out.logits, full.logits[-1:])


BASE = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 40, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 56, "vocab_size": 64, "draft_vocab_size": 24,
        "rope_theta": 500.0, "max_position_embeddings": 4096, "num_hidden_layers": 1}
SCALED = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 16.0,
             "beta_slow": 2.0},
    # against a regression in eagle3_config.py (truncate not written: reloaded as true, other frequencies)
    "yarn-untruncated": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                         "truncate": False},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
               "original_max_position_embeddings": 1024},
}


# eagle3_config.py: SpecFit's own export of a drafter
# with scaled RoPE must keep every parameter of it
@pytest.mark.parametrize("variant", list(SCALED))
def test_save_load_round_trip_keeps_a_scaled_rope(tmp_path, variant):
    config = Eagle3Config.from_dict({**BASE, "rope_scaling": SCALED[variant]})
    drafter = Eagle3Drafter(config, target_embed=None)
    drafter.init_weights(0)
    drafter.set_draft_vocabulary(torch.arange(0, 48, 2))    # a reduced vocabulary with a real mapping
    drafter.save_pretrained(tmp_path)
    loaded = Eagle3Drafter.from_pretrained(tmp_path)
    assert loaded.config.rope == config.rope
    assert torch.equal(loaded.inv_freq, drafter.inv_freq) and loaded.rope_scale == drafter.rope_scale


# ----------------------------------------------------------------- bad draft vocabularies
def _last_to(target_id):
    def change(t, c):
        d2t = t["d2t"].clone()
        d2t[-1] = target_id - (DRAFT_VOCAB - 1)
        t.update(d2t=d2t)
        t.pop("t2d")
    return change


def _duplicate(t, c):
    d2t = t["d2t"].clone()
    d2t[1] = int(DRAFT_IDS[0]) - 1          # draft token 1 -> the target id of draft token 0
    t.update(d2t=d2t)
    t.pop("t2d")                            # optional: d2t alone must be checked


def _bool_offsets(t, c):
    t.update(d2t=torch.ones(DRAFT_VOCAB, dtype=torch.bool))    # read as offsets 1: ids 1..24, in range
    t.pop("t2d")


# against a regression in eagle3_checkpoint.py (id == vocab_size let through: an IndexError instead of the
# one clear error), K04 (:118, duplicate target ids accepted), K08 (:109, a bool d2t accepted),
# K10 (:90, a mis-shaped embed_tokens reaching load_state_dict)
@pytest.mark.parametrize("change, message", [
    (_last_to(VOCAB), "maps draft token 23 to target id 64, outside the target vocabulary"),
    (_duplicate, "several draft tokens to the same target id"),
    (_bool_offsets, "expected integer offsets"),
    (lambda t, c: t.update({"embed_tokens.weight": torch.zeros(VOCAB, TARGET_H + 1)}),
     "tensor 'embed_tokens.weight' has shape [64, 41], expected [64, 40]"),
])
def test_bad_draft_vocabulary_or_embedding_is_one_clear_error(tmp_path, change, message):
    write_and_corrupt(tmp_path, change)
    with pytest.raises(SpecFitError, match=message.replace("(", r"\(").replace("[", r"\[")):
        Eagle3Drafter.from_pretrained(tmp_path)


def _second_layer(t, c):
    t.update({name.replace("midlayer.", "layers.1."): w.clone() for name, w in list(t.items())
              if name.startswith("midlayer.")})


# against a regression in eagle3_checkpoint.py: an integer or bool weight reached load_state_dict (a raw
# RuntimeError); a tensor the config does not describe (a q_norm, a second layer, a layers.0.* set beside
# midlayer.*) was dropped and the drafter ran without it
@pytest.mark.parametrize("change, message", [
    (lambda t, c: t.update({"fc.weight": t["fc.weight"].to(torch.int32)}),
     "tensor 'fc.weight' is stored as int32, expected floating-point weights"),
    (lambda t, c: t.update({"norm.weight": t["norm.weight"] > 0}), "tensor 'norm.weight' is stored as bool"),
    (lambda t, c: t.update({"embed_tokens.weight": t["embed_tokens.weight"].long()}),
     "tensor 'embed_tokens.weight' is stored as int64"),
    (lambda t, c: t.update({"midlayer.self_attn.q_norm.weight": torch.ones(16)}),
     "tensor 'midlayer.self_attn.q_norm.weight' is no weight of the EAGLE-3 drafter"),
    (_second_layer, "tensor 'layers.1.hidden_norm.weight' (and 9 more) is no weight"),
    (lambda t, c: t.update({name.replace("midlayer.", "layers.0."): w * 2 for name, w in list(t.items())
                            if name.startswith("midlayer.")}), "has both midlayer.* and layers.0.* tensors"),
])
def test_a_non_float_or_undescribed_tensor_is_one_clear_error(tmp_path, change, message):
    write_and_corrupt(tmp_path, change)
    with pytest.raises(SpecFitError, match=re.escape(message)):
        Eagle3Drafter.from_pretrained(tmp_path)


def test_integer_vocabulary_maps_and_rope_buffers_are_no_unexpected_tensors(tmp_path):
    write_and_corrupt(tmp_path, lambda t, c: t.update({"midlayer.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    loaded = Eagle3Drafter.from_pretrained(tmp_path)
    assert loaded.d2t.dtype == torch.int64 and loaded.fc.weight.dtype == torch.float32


# drafting.py: a tree top-k wider than the draft vocabulary takes every draft token
def test_tree_top_k_wider_than_the_draft_vocabulary_drafts_every_draft_token():
    drafter = random_drafter()
    session = DrafterSession(drafter, max_entries=128)
    root = session.commit(features(6), tokens(6))
    drafting = TreeDraft(session, 7, lambda: root, top_k=DRAFT_VOCAB + 6, max_levels=2)
    level = drafting.grow()
    assert level.size == DRAFT_VOCAB and sorted(level.tokens.tolist()) == DRAFT_IDS.sort().values.tolist()
    assert drafting.grow().size == DRAFT_VOCAB * DRAFT_VOCAB
