"""Drafter formats of issue 16: EAGLE-3 heads as SpecForge exports them (including EAGLE-3.1's
``fc_norm`` / ``norm_output``, nested or top-level feature layers, with or without
``embed_tokens``), vLLM speculators' ``Eagle3Speculator``, the two feature-layer conventions,
and draft vocabularies whose mapping was lost.

Fixtures are written here in the published layouts (config keys and tensor names as the trainers
write them), not by SpecFit's own exporter; the reference forward is written out from the
published descriptions."""

from __future__ import annotations

import json
import warnings
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from typer.testing import CliRunner

from runtime_fixtures import HIDDEN, VOCAB, load_reference, make_tiny_model
from runtime_fixtures import torch_single_thread  # noqa: F401  (autouse: one intra-op thread)
from specfit.cli import app
from specfit.errors import SpecFitError
from specfit.runtime.eagle3 import DrafterVocabularyWarning, Eagle3Config, Eagle3Drafter
from specfit.runtime.loader import drafter_capture_layers, is_eagle3, load_drafter, load_model

pytest.importorskip("transformers")

H, HEADS, KV_HEADS, HEAD_DIM, INTER, DRAFT_VOCAB, EPS, THETA = HIDDEN, 4, 2, 32, 96, 40, 1e-6, 10000.0
TARGET_LAYERS = 6
DRAFT_IDS = torch.arange(VOCAB)[torch.randperm(VOCAB, generator=torch.Generator().manual_seed(4))[:DRAFT_VOCAB]].sort().values


# ----------------------------------------------------------------------------- published layouts
def published_tensors(layer_prefix: str, fc_norm=False, norm_before_fc=False, embed_tokens=True, seed=0) -> dict:
    """Random weights under the trainers' tensor names."""
    gen = torch.Generator().manual_seed(seed)

    def w(*shape, std=0.2):
        return torch.randn(*shape, generator=gen) * std

    def norm(n):
        return 1 + 0.2 * torch.randn(n, generator=gen)

    tensors = {"fc.weight": w(H, 3 * H, std=0.1), "norm.weight": norm(H), "lm_head.weight": w(DRAFT_VOCAB, H, std=0.5),
               "d2t": DRAFT_IDS - torch.arange(DRAFT_VOCAB),
               "t2d": torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, DRAFT_IDS, True)}
    layer = {"self_attn.q_proj.weight": w(HEADS * HEAD_DIM, 2 * H), "self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, 2 * H),
             "self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, 2 * H), "self_attn.o_proj.weight": w(H, HEADS * HEAD_DIM),
             "mlp.gate_proj.weight": w(INTER, H), "mlp.up_proj.weight": w(INTER, H), "mlp.down_proj.weight": w(H, INTER),
             "hidden_norm.weight": norm(H), "input_layernorm.weight": norm(H), "post_attention_layernorm.weight": norm(H)}
    tensors.update({layer_prefix + name: t for name, t in layer.items()})
    if fc_norm:
        tensors.update({f"fc_norm.{i}.weight": norm(H) for i in range(3)})
    if norm_before_fc:
        tensors["input_norm.weight"] = norm(3 * H)
    if embed_tokens:
        tensors["embed_tokens.weight"] = w(VOCAB, H, std=1.0)
    return tensors


def llama_layer_config() -> dict:
    return {"hidden_size": H, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
            "intermediate_size": INTER, "hidden_act": "silu", "rms_norm_eps": EPS, "rope_theta": THETA,
            "rope_scaling": None, "max_position_embeddings": 2048, "vocab_size": VOCAB, "num_hidden_layers": 1,
            "model_type": "llama", "attention_bias": False, "tie_word_embeddings": False}


def specforge_config(eagle31=False, nested_ids=None, top_ids=None) -> dict:
    """SpecForge's draft config (configs/qwen3-30B-A3B-eagle3[.1].json, shapes scaled down)."""
    raw = {"architectures": ["LlamaForCausalLMEagle3"], **llama_layer_config(), "draft_vocab_size": DRAFT_VOCAB,
           "torch_dtype": "bfloat16", "transformers_version": "4.53.2", "use_cache": True, "sliding_window": None}
    if eagle31:
        raw.update(fc_norm=True, norm_output=True)
    if nested_ids is not None:
        raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": nested_ids, "use_aux_hidden_state": True}
    if top_ids is not None:
        raw["eagle_aux_hidden_state_layer_ids"] = top_ids
    return raw


def speculators_config(ids=None, norm_before_residual=True, norm_before_fc=False) -> dict:
    """vLLM speculators' Eagle3Speculator config."""
    raw = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.3.0",
           "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                  "verifier": {"name_or_path": "tiny-target", "architectures": ["Qwen3MoeForCausalLM"]}},
           "transformer_layer_config": llama_layer_config(), "draft_vocab_size": DRAFT_VOCAB,
           "norm_before_residual": norm_before_residual, "norm_before_fc": norm_before_fc, "target_hidden_size": None,
           "embed_requires_grad": False, "torch_dtype": "float32"}
    if ids is not None:
        raw["eagle_aux_hidden_state_layer_ids"] = ids
    return raw


def write(directory, config: dict, tensors: dict):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


# ----------------------------------------------------------------------------- reference forward
def rms(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def reference_step(t: dict, prefix: str, flags: dict, hidden, embeds, positions, mask):
    """One drafter pass over T entries attending by ``mask`` [T, T] (no cache), written from
    the published descriptions. ``hidden`` is [T, 3H] target features or [T, H] fed back.
    Returns (logits, state fed to the next level)."""
    if hidden.shape[-1] == 3 * H:
        if flags.get("norm_before_fc"):                        # speculators (gpt-oss): one norm over 3H
            hidden = rms(hidden, t["input_norm.weight"])
        if flags.get("fc_norm"):                               # EAGLE-3.1: one norm per feature
            hidden = torch.cat([rms(part, t[f"fc_norm.{i}.weight"]) for i, part in enumerate(hidden.chunk(3, -1))], -1)
        hidden = hidden @ t["fc.weight"].T
    normed_hidden = rms(hidden, t[prefix + "hidden_norm.weight"])
    x = torch.cat([rms(embeds, t[prefix + "input_layernorm.weight"]), normed_hidden], -1)
    T = x.shape[0]
    q = (x @ t[prefix + "self_attn.q_proj.weight"].T).view(T, HEADS, HEAD_DIM)
    k = (x @ t[prefix + "self_attn.k_proj.weight"].T).view(T, KV_HEADS, HEAD_DIM)
    v = (x @ t[prefix + "self_attn.v_proj.weight"].T).view(T, KV_HEADS, HEAD_DIM)
    inv_freq = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    angles = positions.float()[:, None] * inv_freq
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]

    def rope(a):
        return a * cos + torch.cat([-a[..., HEAD_DIM // 2:], a[..., : HEAD_DIM // 2]], -1) * sin

    q, k = rope(q), rope(k)
    out = torch.empty(T, HEADS, HEAD_DIM)
    for head in range(HEADS):
        kv = head // (HEADS // KV_HEADS)
        scores = (q[:, head] @ k[:, kv].T / HEAD_DIM ** 0.5).masked_fill(~mask, float("-inf"))
        out[:, head] = scores.softmax(-1) @ v[:, kv]
    residual = normed_hidden if flags.get("norm_before_residual") else hidden
    h = residual + out.reshape(T, -1) @ t[prefix + "self_attn.o_proj.weight"].T
    y = rms(h, t[prefix + "post_attention_layernorm.weight"])
    h = h + (F.silu(y @ t[prefix + "mlp.gate_proj.weight"].T) * (y @ t[prefix + "mlp.up_proj.weight"].T)) \
        @ t[prefix + "mlp.down_proj.weight"].T
    final = rms(h, t["norm.weight"])
    return final @ t["lm_head.weight"].T, (final if flags.get("norm_output") else h)


def two_levels(drafter: Eagle3Drafter, features, ids):
    """Level 1 over T committed entries (causal), then a level-2 entry per entry fed its output,
    seeing the committed prefix up to its parent and itself — as a draft tree's second level."""
    T = ids.numel()
    drafter.setup_kv_cache(2 * T)
    first = drafter(features, ids, torch.arange(T))
    mask = torch.zeros(T, 2 * T, dtype=torch.bool)
    mask[:, :T] = torch.ones(T, T, dtype=torch.bool).tril()
    mask[torch.arange(T), T + torch.arange(T)] = True
    second = drafter(first.hidden, ids.roll(-1), torch.arange(1, T + 1), mask)
    return first, second


def reference_two_levels(t, prefix, flags, features, ids, embedding):
    T = ids.numel()
    logits1, state = reference_step(t, prefix, flags, features, embedding[ids], torch.arange(T),
                                    torch.ones(T, T, dtype=torch.bool).tril())
    # level 2: entry i is (state_i, ids[i + 1]) at position i + 1 over [level-1 entries 0..i, itself]
    logits2 = torch.stack([_level2_entry(t, prefix, flags, features[: i + 1], ids[: i + 1], state[i], ids.roll(-1)[i],
                                         i + 1, embedding) for i in range(T)])
    return logits1, logits2


def _level2_entry(t, prefix, flags, features, ids, state, token, position, embedding):
    """The logits of one level-2 entry: attention over the level-1 entries' keys/values and its own."""
    n = ids.numel()
    hidden = torch.cat([_fused(t, flags, features), state[None]])       # H-wide streams of all n + 1 entries
    embeds = torch.cat([embedding[ids], embedding[token][None]])
    positions = torch.cat([torch.arange(n), torch.tensor([position])])
    mask = torch.ones(n + 1, n + 1, dtype=torch.bool).tril()
    logits, _ = reference_step(t, prefix, flags, hidden, embeds, positions, mask)
    return logits[-1]


def _fused(t, flags, features):
    hidden = features
    if flags.get("norm_before_fc"):
        hidden = rms(hidden, t["input_norm.weight"])
    if flags.get("fc_norm"):
        hidden = torch.cat([rms(part, t[f"fc_norm.{i}.weight"]) for i, part in enumerate(hidden.chunk(3, -1))], -1)
    return hidden @ t["fc.weight"].T


def _inputs(T=7, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(T, 3 * H, generator=gen), torch.randint(0, VOCAB, (T,), generator=gen)


VARIANTS = {
    "specforge-eagle3": ("midlayer.", dict(), lambda: specforge_config()),
    "specforge-eagle3.1": ("midlayer.", dict(fc_norm=True, norm_output=True), lambda: specforge_config(eagle31=True)),
    "speculators": ("layers.0.", dict(norm_before_residual=True), lambda: speculators_config()),
    "speculators-norm_before_fc": ("layers.0.", dict(norm_before_residual=True, norm_before_fc=True),
                                   lambda: speculators_config(norm_before_fc=True)),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_published_layout_matches_the_forward_written_out(tmp_path, variant):
    prefix, flags, config = VARIANTS[variant]
    tensors = published_tensors(prefix, fc_norm=flags.get("fc_norm", False),
                                norm_before_fc=flags.get("norm_before_fc", False))
    directory = write(tmp_path / variant, config(), tensors)
    assert is_eagle3(directory)
    drafter = Eagle3Drafter.from_pretrained(directory, dtype=torch.float32)
    c = drafter.config
    assert (c.fc_norm, c.norm_output, c.norm_before_residual, c.norm_before_fc) == tuple(
        flags.get(k, False) for k in ("fc_norm", "norm_output", "norm_before_residual", "norm_before_fc"))
    assert c.checkpoint_format == ("speculators" if prefix == "layers.0." else "eagle3")
    features, ids = _inputs()
    first, second = two_levels(drafter, features, ids)
    want1, want2 = reference_two_levels(tensors, prefix, flags, features, ids, tensors["embed_tokens.weight"])
    torch.testing.assert_close(first.logits, want1, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(second.logits, want2, rtol=1e-4, atol=1e-4)
    assert torch.equal(drafter.draft_ids, DRAFT_IDS)


@pytest.mark.parametrize("variant", ["specforge-eagle3.1", "speculators-norm_before_fc"])
def test_a_variant_survives_specfits_own_export(tmp_path, variant):
    prefix, flags, config = VARIANTS[variant]
    tensors = published_tensors(prefix, fc_norm=flags.get("fc_norm", False), norm_before_fc=flags.get("norm_before_fc", False))
    drafter = Eagle3Drafter.from_pretrained(write(tmp_path / "in", config(), tensors), dtype=torch.float32)
    drafter.save_pretrained(tmp_path / "out")
    again = Eagle3Drafter.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert again.config == replace(drafter.config, dtype="float32")     # the export writes the weights' dtype
    features, ids = _inputs()
    for a, b in zip(two_levels(drafter, features, ids), two_levels(again, features, ids)):
        assert torch.equal(a.logits, b.logits) and torch.equal(a.hidden, b.hidden)


def test_the_variants_change_the_output(tmp_path):
    """Each flag matters: reading a 3.1 checkpoint as plain EAGLE-3 would give other drafts."""
    features, ids = _inputs()
    tensors = published_tensors("midlayer.", fc_norm=True)
    base = Eagle3Drafter.from_pretrained(write(tmp_path / "a", specforge_config(eagle31=True), tensors))
    plain = {k: v for k, v in tensors.items() if not k.startswith("fc_norm.")}
    other = Eagle3Drafter.from_pretrained(write(tmp_path / "b", specforge_config(), plain))
    a1, a2 = two_levels(base, features, ids)
    b1, b2 = two_levels(other, features, ids)
    assert not torch.allclose(a1.logits, b1.logits) and not torch.allclose(a2.logits, b2.logits)


def test_a_drafter_without_embed_tokens_uses_the_targets_embedding(tmp_path):
    tensors = published_tensors("midlayer.", embed_tokens=False)
    directory = write(tmp_path / "d", specforge_config(), tensors)
    with pytest.raises(SpecFitError, match="no tensor 'embed_tokens.weight'"):
        Eagle3Drafter.from_pretrained(directory)
    target_embed = torch.randn(VOCAB, H, generator=torch.Generator().manual_seed(9))
    drafter = Eagle3Drafter.from_pretrained(directory, target_embed=target_embed, dtype=torch.float32)
    assert not drafter.owns_embedding
    features, ids = _inputs()
    first, second = two_levels(drafter, features, ids)
    want1, want2 = reference_two_levels(tensors, "midlayer.", {}, features, ids, target_embed)
    torch.testing.assert_close(first.logits, want1, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(second.logits, want2, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- feature layers
@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_model("qwen3_moe", tmp_path_factory.mktemp("target6"), seed=2, num_hidden_layers=TARGET_LAYERS)


def _layer_outputs(model_dir, ids):
    """transformers' output of every decoder layer (before the final norm) and the embeddings."""
    reference = load_reference(model_dir)
    outputs = []
    hooks = [layer.register_forward_hook(lambda m, i, o: outputs.append(o[0] if isinstance(o, tuple) else o))
             for layer in reference.model.layers]
    with torch.no_grad():
        embeds = reference.model.embed_tokens(ids[None])[0]
        reference(ids[None])
    for hook in hooks:
        hook.remove()
    return embeds, [o.reshape(ids.numel(), -1) for o in outputs]


@pytest.mark.parametrize("convention", ["specforge-nested", "vllm-top-level", "speculators"])
def test_both_layer_conventions_feed_the_same_target_layers(tmp_path, target_dir, convention):
    outputs_of = [0, 2, 4]                      # SpecForge: "output of layer j"
    inputs_of = [j + 1 for j in outputs_of]     # vLLM: "id j = output of layer j - 1"
    if convention == "specforge-nested":
        config = specforge_config(nested_ids=outputs_of)
    elif convention == "vllm-top-level":
        config = specforge_config(top_ids=inputs_of)
    else:
        config = speculators_config(ids=inputs_of)
    prefix = "layers.0." if convention == "speculators" else "midlayer."
    directory = write(tmp_path / convention, config, published_tensors(prefix))
    from specfit.runtime.config import ModelConfig

    target = ModelConfig.from_dir(target_dir)
    assert drafter_capture_layers(directory, target) == (1, 3, 5)
    described = Eagle3Config.from_file(directory / "config.json").describe_feature_layers(TARGET_LAYERS)
    assert "inputs of target layers [1, 3, 5]" in described and "outputs of layers [0, 2, 4]" in described
    assert ("output of layer j" in described) == (convention == "specforge-nested")

    model = load_model(target_dir, cache_experts=8, capture_layers=drafter_capture_layers(directory, target))
    model.setup_kv_cache(16)
    ids = torch.arange(9) % VOCAB
    hidden = model(ids, torch.arange(9)).hidden
    _, outputs = _layer_outputs(target_dir, ids)
    want = torch.cat([outputs[j] for j in outputs_of], dim=-1)
    torch.testing.assert_close(hidden, want, rtol=0, atol=1e-6)
    drafter = load_drafter(directory, model)            # accepted: the target captures its layers
    assert drafter.config.aux_hidden_state_layer_ids == (1, 3, 5)


def test_vllm_id_zero_is_the_embeddings_and_id_L_the_last_layer_output(tmp_path, target_dir):
    directory = write(tmp_path / "edge", specforge_config(top_ids=[0, 3, TARGET_LAYERS]), published_tensors("midlayer."))
    from specfit.runtime.config import ModelConfig

    capture = drafter_capture_layers(directory, ModelConfig.from_dir(target_dir))
    assert capture == (0, 3, TARGET_LAYERS)
    model = load_model(target_dir, cache_experts=8, capture_layers=capture)
    model.setup_kv_cache(16)
    ids = torch.arange(5)
    hidden = model(ids, torch.arange(5)).hidden
    embeds, outputs = _layer_outputs(target_dir, ids)
    torch.testing.assert_close(hidden, torch.cat([embeds, outputs[2], outputs[-1]], -1), rtol=0, atol=1e-6)
    assert "outputs of layers [embeddings, 2, 5]" in Eagle3Config.from_file(directory / "config.json") \
        .describe_feature_layers(TARGET_LAYERS)


def test_default_feature_layers_are_described_as_the_default():
    config = Eagle3Config.from_dict(specforge_config())
    assert config.aux_hidden_state_layer_ids is None and config.feature_layers(48) == (2, 24, 45)
    assert config.describe_feature_layers(48).endswith("EAGLE-3 default: the config names none")


@pytest.mark.parametrize("raw,message", [
    (specforge_config(nested_ids=[0, 2, 4], top_ids=[1, 3, 4]), "name different target layers"),
    (specforge_config(nested_ids=[0, 2]), "must be a list of three non-negative layer indices"),
    ({**speculators_config(), "transformer_layer_config": {**llama_layer_config(), "model_type": "qwen3"}},
     "only Llama-style draft layers"),
    ({**speculators_config(), "transformer_layer_config": {**llama_layer_config(), "num_hidden_layers": 2}},
     "'num_hidden_layers' must be 1"),
    ({**speculators_config(), "speculators_model_type": "mlp"}, "only 'eagle3' speculators"),
    ({k: v for k, v in speculators_config().items() if k != "transformer_layer_config"}, "transformer_layer_config"),
    ({**specforge_config(), "fc_norm": "yes"}, "'fc_norm' must be true or false"),
    ({**specforge_config(), "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "not supported for drafters"),
    # a count of 0 is refused before it divides anything; JSON's Infinity and fractions are no counts
    ({**specforge_config(), "num_key_value_heads": 0}, "'num_key_value_heads' must be at least 1, got 0"),
    ({**specforge_config(), "intermediate_size": float("inf")}, "'intermediate_size' must be an integer, got inf"),
    ({**specforge_config(), "hidden_size": 64.5}, "'hidden_size' must be an integer, got 64.5"),
    ({**specforge_config(), "vocab_size": "4096"}, "'vocab_size' must be an integer, got '4096'"),
    # a norm's epsilon below 0 makes NaN, an infinite one zeros; a theta of 0 NaN frequencies
    ({**specforge_config(), "rms_norm_eps": -1e-6}, "'rms_norm_eps' must be a finite number >= 0, got -1e-06"),
    ({**specforge_config(), "rms_norm_eps": float("inf")}, "'rms_norm_eps' must be a finite number >= 0, got inf"),
    ({**specforge_config(), "rope_theta": 0}, "'rope_theta' must be a finite number > 0, got 0.0"),
    ({**specforge_config(), "eagle_config": [2, 3]}, "key 'eagle_config' must be an object, got \\[2, 3\\]"),
])
def test_bad_drafter_config_is_one_error(raw, message):
    with pytest.raises(SpecFitError, match=message):
        Eagle3Config.from_dict(raw, source="drafter/config.json")


def test_feature_layers_named_out_of_order_are_read_in_layer_order():
    # vLLM and SGLang concatenate the captured features in their loop over the layers
    nested = Eagle3Config.from_dict(specforge_config(nested_ids=[4, 0, 2]))
    assert nested.feature_layers(6) == (1, 3, 5) and nested.aux_layers_in_file == (4, 0, 2)
    assert "eagle_config.eagle_aux_hidden_state_layer_ids = [4, 0, 2]" in nested.describe_feature_layers(6)
    top = Eagle3Config.from_dict(specforge_config(top_ids=[5, 1, 3]))
    assert top.feature_layers(6) == (1, 3, 5) and top == nested
    assert top.aux_layers_in_file == (5, 1, 3)       # the file's ids as written, in what names them
    assert "eagle_aux_hidden_state_layer_ids = [5, 1, 3]" in top.describe_feature_layers(6)
    assert Eagle3Config.from_dict(specforge_config(nested_ids=[4, 0, 2], top_ids=[1, 5, 3])).feature_layers(6) == (1, 3, 5)
    # a repeat (the clipped default of a model of a few layers) keeps its order
    assert Eagle3Config.from_dict(specforge_config(top_ids=[1, 1, 0])).feature_layers(2) == (1, 1, 0)


@pytest.mark.parametrize("n_layers", range(1, 9))
def test_a_heads_default_feature_layers_read_back_as_written(n_layers):
    """SpecFit's default for a 3-layer target was (2, 1, 0): a head saved with it read back as
    (0, 1, 2), its features in another order than it was built with."""
    from dataclasses import replace

    from specfit.runtime.config import default_capture_layers

    layers = default_capture_layers(n_layers)
    written = replace(Eagle3Config.from_dict(specforge_config()), aux_hidden_state_layer_ids=layers)
    assert Eagle3Config.from_dict(written.to_dict()).feature_layers(n_layers) == layers
    assert default_capture_layers(3) == (0, 1, 2) and default_capture_layers(48) == (2, 24, 45)


def test_a_speculators_config_is_known_by_its_model_type_or_its_architecture():
    from specfit.runtime.eagle3_config import SPECULATORS_ARCHITECTURE, is_speculators

    assert is_speculators({"speculators_model_type": "eagle3"})
    assert is_speculators({"architectures": ["LlamaForCausalLM"], "speculators_model_type": "eagle3"})
    assert is_speculators({"architectures": [SPECULATORS_ARCHITECTURE]})
    assert is_speculators({"architectures": SPECULATORS_ARCHITECTURE})
    assert not is_speculators({"architectures": ["LlamaForCausalLMEagle3"]})
    assert not is_speculators({"architectures": 5})


def test_feature_layers_beyond_the_target_are_refused(tmp_path, target_dir):
    from specfit.runtime.config import ModelConfig

    directory = write(tmp_path / "far", specforge_config(nested_ids=[0, 2, TARGET_LAYERS]), published_tensors("midlayer."))
    with pytest.raises(SpecFitError, match=r"eagle_config.eagle_aux_hidden_state_layer_ids' is \[0, 2, 6\] "
                                           r"\(inputs of layers \[1, 3, 7\]\), but the target has 6 layers"):
        drafter_capture_layers(directory, ModelConfig.from_dir(target_dir))


def test_norm_tensors_without_their_flag_are_refused(tmp_path):
    directory = write(tmp_path / "x", specforge_config(), published_tensors("midlayer.", fc_norm=True))
    with pytest.raises(SpecFitError, match="has tensors fc_norm.\\*, but config.json does not set \"fc_norm\": true"):
        Eagle3Drafter.from_pretrained(directory)


# ----------------------------------------------------------------------------- draft vocabulary
def test_all_zero_d2t_of_an_untrained_mapping_is_an_error(tmp_path):
    tensors = published_tensors("midlayer.")
    # SpecForge initialises its buffers this way: t2d all ones, d2t all zeros
    tensors.update(d2t=torch.zeros(DRAFT_VOCAB, dtype=torch.int64), t2d=torch.ones(VOCAB, dtype=torch.bool))
    with pytest.raises(SpecFitError, match="'d2t' is all zeros \\('t2d' marks 96 tokens\\).*acceptance would collapse"):
        Eagle3Drafter.from_pretrained(write(tmp_path / "a", specforge_config(), tensors))
    del tensors["t2d"]
    with pytest.raises(SpecFitError, match="'d2t' is all zeros \\(no 't2d'\\)"):
        Eagle3Drafter.from_pretrained(write(tmp_path / "b", specforge_config(), tensors))


def test_all_zero_d2t_that_t2d_confirms_loads_with_a_warning(tmp_path):
    tensors = published_tensors("midlayer.")
    tensors.update(d2t=torch.zeros(DRAFT_VOCAB, dtype=torch.int64),
                   t2d=torch.arange(VOCAB) < DRAFT_VOCAB)
    with pytest.warns(DrafterVocabularyWarning, match="target ids 0..39"):
        drafter = Eagle3Drafter.from_pretrained(write(tmp_path / "a", specforge_config(), tensors))
    assert torch.equal(drafter.draft_ids, torch.arange(DRAFT_VOCAB))


def test_d2t_offsets_map_draft_ids_and_t2d_is_optional(tmp_path):
    tensors = published_tensors("layers.0.")
    del tensors["t2d"]                           # vLLM and SGLang never read it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        drafter = Eagle3Drafter.from_pretrained(write(tmp_path / "a", speculators_config(), tensors))
    draft = torch.tensor([0, 7, DRAFT_VOCAB - 1])
    assert torch.equal(drafter.to_target_ids(draft), draft + tensors["d2t"][draft])
    assert torch.equal(drafter.t2d.nonzero().flatten(), DRAFT_IDS)
    del tensors["d2t"]
    with pytest.raises(SpecFitError, match="missing tensor 'd2t'.*'t2d' alone does not give the order"):
        Eagle3Drafter.from_pretrained(write(tmp_path / "b", speculators_config(), tensors))


# ----------------------------------------------------------------------------- specfit decode
@pytest.mark.parametrize("variant", ["specforge-eagle3.1", "speculators"])
def test_specfit_decode_runs_the_drafter_format_lossless(tmp_path, monkeypatch, target_dir, variant):
    monkeypatch.chdir(tmp_path)
    prefix, flags, config = VARIANTS[variant]
    raw = config()
    if variant.startswith("specforge"):
        raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, 2, 4]}
    else:
        raw["eagle_aux_hidden_state_layer_ids"] = [1, 3, 5]
    directory = write(tmp_path / variant, raw, published_tensors(prefix, fc_norm=flags.get("fc_norm", False),
                                                                 embed_tokens=variant == "speculators"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": [3, 1, 4, 1, 5]}) + "\n" + json.dumps({"input_ids": [9, 2]}) + "\n")
    result = CliRunner().invoke(app, ["decode", "--model", str(target_dir), "--drafter", str(directory), "--prompts",
                                      str(prompts), "--cache-experts", "3", "--device", "cpu", "--max-new-tokens", "8",
                                      "--ignore-eos", "--policies", "ar,eagle3:8:3,specfit", "--profile", "pcie4",
                                      "--json"])
    assert result.exit_code == 0, result.output
    reference = load_reference(target_dir)
    for record in map(json.loads, result.stdout.splitlines()):
        prompt = [[3, 1, 4, 1, 5], [9, 2]][record["index"]]
        want = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):]
        assert record["output_ids"] == want.tolist(), record["policy"]


ROPES = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 512},
}


def _drafter_config(rope: dict) -> Eagle3Config:
    return Eagle3Config.from_dict({
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 96, "vocab_size": 96, "draft_vocab_size": 40,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048, "num_hidden_layers": 1,
        "rope_scaling": rope})


# against a regression in eagle3.py (the YaRN attention factor left off the drafter's cos/sin)
@pytest.mark.parametrize("variant", list(ROPES))
def test_drafter_rope_equals_transformers_llama_rotary_for_scaled_variants(variant):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = _drafter_config(ROPES[variant])
    drafter = Eagle3Drafter(config)
    reference = LlamaRotaryEmbedding(LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=32,
                                                 max_position_embeddings=2048,
                                                 rope_parameters={"rope_theta": 10000.0, **ROPES[variant]}))
    positions = torch.arange(0, 1500, 37)
    want_cos, want_sin = reference(torch.zeros(1), positions[None])
    cos, sin = drafter.rope(positions)
    torch.testing.assert_close(cos, want_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, want_sin[0], rtol=0, atol=1e-6)


# eagle3.py: a drafter cast to bfloat16 keeps float32 RoPE frequencies, so its
# angles at long positions are those of the float32 drafter
def test_a_drafter_cast_to_bfloat16_keeps_float32_rope_frequencies():
    config = _drafter_config(ROPES["llama3"])
    drafter = Eagle3Drafter(config)
    want = drafter.inv_freq.clone()
    angles = drafter.rope_angles(torch.tensor([1900]))
    drafter.to(dtype=torch.bfloat16)
    assert drafter.inv_freq.dtype == torch.float32 and torch.equal(drafter.inv_freq, want)
    assert torch.equal(drafter.rope_angles(torch.tensor([1900])), angles)


# loader.py: a target that captures other layers than the drafter reads is refused
def test_a_target_capturing_other_layers_than_the_drafter_reads_is_refused(tmp_path):
    from speculative_fixtures import make_drafter
    from specfit.runtime.loader import load_drafter, load_model

    model_dir = make_tiny_model("qwen3_moe", tmp_path / "target")
    drafter_dir = make_drafter(model_dir, tmp_path / "drafter")        # reads the default layers (1, 1, 0)
    assert Eagle3Config.from_file(drafter_dir / "config.json").aux_hidden_state_layer_ids == (1, 1, 0)
    model = load_model(model_dir, cache_experts=8, capture_layers=(0, 1, 2))
    with pytest.raises(SpecFitError, match="load the target with the drafter's feature layers"):
        load_drafter(drafter_dir, model)
    load_drafter(drafter_dir, load_model(model_dir, cache_experts=8))   # the default capture: accepted
