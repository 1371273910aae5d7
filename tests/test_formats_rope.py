"""RoPE variants against ``transformers``' own rotary embedding, in both config spellings."""

from __future__ import annotations

import copy
import re

import pytest
import torch

from specfit.errors import SpecFitError
from specfit.runtime.rope import Rotary, parse_rope

pytest.importorskip("transformers")

MAX_POS = 128
VARIANTS = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32},
    "yarn-mscale": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 16, "mscale": 0.707,
                    "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
}


def _reference(parameters: dict):
    """transformers' rotary embedding of a Qwen3-MoE config with these RoPE parameters."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

    config = Qwen3MoeConfig(hidden_size=64, num_attention_heads=4, head_dim=32, max_position_embeddings=MAX_POS,
                            rope_parameters={"rope_theta": 5000.0, **parameters})
    return Qwen3MoeRotaryEmbedding(config)


def _ours(parameters: dict) -> Rotary:
    spec = parse_rope({"rope_parameters": {"rope_theta": 5000.0, **parameters}}, "config.json", MAX_POS)
    return Rotary(spec, 32, MAX_POS)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_frequencies_and_attention_factor_equal_transformers(variant):
    reference, ours = _reference(VARIANTS[variant]), _ours(VARIANTS[variant])
    assert torch.equal(ours.inv_freq, reference.inv_freq)
    assert ours.attention_scaling == pytest.approx(reference.attention_scaling, rel=1e-12)
    positions = torch.arange(0, 100, 7)
    want_cos, want_sin = reference(torch.zeros(1, dtype=torch.float32), positions[None])
    cos, sin = ours.cos_sin(positions, torch.float32)
    assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])


def test_dynamic_ntk_grows_beyond_the_original_length_and_resets_like_transformers():
    reference, ours = _reference(VARIANTS["dynamic"]), _ours(VARIANTS["dynamic"])
    # a pass inside the original length, two growing past it, then one back inside
    for positions in (torch.arange(0, 40), torch.arange(150, 170), torch.arange(100, 110), torch.arange(0, 20)):
        want_cos, want_sin = reference(torch.zeros(1), positions[None])
        cos, sin = ours.cos_sin(positions, torch.float32)
        assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0]), positions[0].item()
        assert torch.equal(ours.inv_freq, reference.inv_freq)
    assert not torch.equal(_ours(VARIANTS["dynamic"]).cos_sin(torch.arange(150, 151), torch.float32)[0],
                           _ours(VARIANTS["default"]).cos_sin(torch.arange(150, 151), torch.float32)[0])


def test_hub_and_transformers5_spellings_give_the_same_rope():
    five = {"rope_parameters": {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0,
                                "original_max_position_embeddings": 32768}}
    hub = {"rope_theta": 1e6, "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    assert parse_rope(five, "a", 131072) == parse_rope(hub, "b", 131072)
    # a rope_scaling block takes precedence and inherits the top-level theta, as in transformers
    mixed = {"rope_theta": 1e6, "rope_parameters": {"rope_theta": 1.0, "rope_type": "default"},
             "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    spec = parse_rope(mixed, "c", 4096)
    assert (spec.rope_type, spec.factor, spec.theta) == ("linear", 2.0, 1e6)
    # yarn without original_max_position_embeddings: the model's length, as transformers defaults it
    assert parse_rope({"rope_theta": 10.0, "rope_scaling": {"type": "yarn", "factor": 2.0}}, "d", 4096) \
        .original_max_position_embeddings == 4096


@pytest.mark.parametrize("raw,message", [
    ({"rope_theta": 1e4, "rope_scaling": {"type": "longrope", "factor": 2.0}}, "rope_type 'longrope'"),
    ({"rope_theta": 1e4, "rope_scaling": {"type": "dynamic"}}, "'rope_scaling.factor' is required"),
    ({"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": "x"}}, "'rope_scaling.factor' must be a number"),
    ({"rope_theta": 1e4, "rope_scaling": {"type": "llama3", "factor": 8.0}}, "misses \\['low_freq_factor'"),
    ({"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ({}, "missing key 'rope_theta'"),
    # a factor of 0 or less, an original length below 1, llama3's blend over an empty or reversed band:
    # a ValueError (log of a negative length) or ZeroDivisionError, or frequencies of inf / NaN
    ({"rope_theta": 1e4, "rope_scaling": {"type": "yarn", "factor": 0.0}}, "'rope_scaling.factor' must be a finite number > 0, got 0.0"),
    ({"rope_theta": 1e4, "rope_scaling": {"type": "yarn", "factor": -2.0, "original_max_position_embeddings": 64}},
     "'rope_scaling.factor' must be a finite number > 0, got -2.0"),
    ({"rope_theta": 1e4, "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": -64}},
     "'rope_scaling.original_max_position_embeddings' must be at least 1, got -64"),
    ({"rope_theta": 1e4, "original_max_position_embeddings": -8, "rope_scaling": {"type": "yarn", "factor": 4.0}},
     "key 'original_max_position_embeddings' must be at least 1, got -8"),
    ({"rope_theta": 1e4, "rope_scaling": {"type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64,
                                          "low_freq_factor": 0.0, "high_freq_factor": 4.0}}, "must satisfy 0 < low < high, got 0.0 and 4.0"),
    ({"rope_theta": 1e4, "rope_scaling": {"type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64,
                                          "low_freq_factor": 4.0, "high_freq_factor": 4.0}}, "must satisfy 0 < low < high, got 4.0 and 4.0"),
    ({"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": float("inf")}},
     "'rope_scaling.factor' must be a finite number > 0, got inf"),
    ({"rope_theta": 1e4, "rope_scaling": {"type": "llama3", "factor": 8.0, "original_max_position_embeddings": 0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
     "'rope_scaling.original_max_position_embeddings' must be at least 1, got 0"),
    # the top-level key overrides yarn's and llama3's only: dynamic's own is the one named
    ({"rope_theta": 1e4, "original_max_position_embeddings": 64,
      "rope_scaling": {"type": "dynamic", "factor": 2.0, "original_max_position_embeddings": -4}},
     "key 'rope_scaling.original_max_position_embeddings' must be at least 1, got -4"),
])
def test_bad_rope_is_one_error(raw, message):
    with pytest.raises(SpecFitError, match=message):
        parse_rope(raw, "config.json", 4096)


# against a regression in rope.py (RoPE values converted loosely: "false" read as true, "2" or true as a
# factor, a null partial_rotary_factor a raw TypeError): read strictly, as config_value reads the rest
@pytest.mark.parametrize("block,message", [
    ({"rope_type": "yarn", "factor": 4.0, "truncate": "false"}, "key 'rope_scaling.truncate' must be true or false"),
    ({"rope_type": "linear", "factor": "2"}, "key 'rope_scaling.factor' must be a number, got '2'"),
    ({"rope_type": "linear", "factor": True}, "key 'rope_scaling.factor' must be a number, got true"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024.5},
     "key 'rope_scaling.original_max_position_embeddings' must be an integer"),
])
def test_a_rope_value_of_the_wrong_kind_is_one_error(block, message):
    with pytest.raises(SpecFitError, match=re.escape(message)):
        parse_rope({"rope_theta": 1e4, "rope_scaling": block}, "config.json", 4096)
    with pytest.raises(SpecFitError, match=re.escape("key 'rope_theta' must be a number, got '1e4'")):
        parse_rope({"rope_theta": "1e4"}, "config.json", 4096)


def test_a_null_rope_value_is_absent():
    spec = parse_rope({"rope_theta": 1e4, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "truncate": None,
                                                           "partial_rotary_factor": None, "beta_fast": None}},
                      "config.json", 4096)
    assert spec.truncate is True and spec.beta_fast == 32.0
    # a null rope_type gives way to the older "type" key
    spec = parse_rope({"rope_theta": 1e4, "rope_scaling": {"rope_type": None, "type": "linear", "factor": 2.0}},
                      "config.json", 4096)
    assert spec.rope_type == "linear" and spec.factor == 2.0


# against a regression in rope.py (reset when the pass reaches exactly max_position_embeddings)
def test_dynamic_ntk_keeps_grown_frequencies_for_a_pass_ending_exactly_at_the_original_length():
    """transformers resets dynamic NTK frequencies only for a pass strictly inside the original
    length (seq_len < max_position_embeddings): a pass whose last position is max_pos - 1 keeps the
    grown ones."""
    parameters = {"rope_type": "dynamic", "factor": 2.0}
    reference, ours = _reference(parameters), _ours(parameters)
    for positions in (torch.arange(150, 170), torch.arange(MAX_POS - 8, MAX_POS)):
        want_cos, want_sin = reference(torch.zeros(1), positions[None])
        cos, sin = ours.cos_sin(positions, torch.float32)
        assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0]), int(positions[-1])
        assert torch.equal(ours.inv_freq, reference.inv_freq)


# against a regression in rope.py (DeepSeek-V3-style yarn without 'factor')
def test_yarn_without_factor_uses_the_ratio_of_the_lengths_like_transformers():
    parameters = {"rope_type": "yarn", "original_max_position_embeddings": 32}
    spec = parse_rope({"rope_parameters": {"rope_theta": 5000.0, **parameters}}, "config.json", MAX_POS)
    assert spec.factor == MAX_POS / 32
    reference = _reference({**parameters, "factor": None})
    ours = Rotary(spec, 32, MAX_POS)
    assert torch.equal(ours.inv_freq, reference.inv_freq)
    assert ours.attention_scaling == pytest.approx(reference.attention_scaling, rel=1e-12)


# against a regression in rope.py (the factor >= 1 check of linear / dynamic removed)
@pytest.mark.parametrize("kind", ["linear", "dynamic"])
def test_linear_or_dynamic_factor_below_one_is_one_error(kind):
    with pytest.raises(SpecFitError, match="factor' must be >= 1"):
        parse_rope({"rope_theta": 1e4, "rope_scaling": {"type": kind, "factor": 0.5}}, "config.json", 4096)


# rope.py: a theta inside the RoPE block wins over a top-level one, as
# transformers' standardize_rope_params does (setdefault)
def test_theta_inside_the_rope_block_wins_over_the_top_level_one_like_transformers():
    from transformers import Qwen3MoeConfig

    raw = {"rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    assert Qwen3MoeConfig(**raw).rope_parameters["rope_theta"] == 5e5
    assert parse_rope(raw, "config.json", 4096).theta == 5e5


# against a regression in rope.py (the attention factor applied after the cast to the compute dtype)
@pytest.mark.parametrize("variant", ["yarn", "yarn-mscale"])
def test_bfloat16_cos_sin_carry_the_attention_factor_rounded_once_like_transformers(variant):
    parameters = {"yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32},
                  "yarn-mscale": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 16,
                                  "mscale": 0.707, "mscale_all_dim": 0.5}}[variant]
    reference, ours = _reference(parameters), _ours(parameters)
    assert ours.attention_scaling != 1.0
    positions = torch.arange(0, 100, 3)
    want_cos, want_sin = reference(torch.zeros(1, dtype=torch.bfloat16), positions[None])
    cos, sin = ours.cos_sin(positions, torch.bfloat16)
    assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])


# against a regression in rope.py (a top-level original_max_position_embeddings ignored: yarn and llama3
# computed for the block's length, another model than transformers builds; logits off by units)
@pytest.mark.parametrize("raw", [
    {"rope_parameters": {"rope_theta": 5000.0, **VARIANTS["yarn"]}},
    {"rope_theta": 5000.0, "rope_scaling": {"type": "yarn", "factor": 8.0}},
    {"rope_parameters": {"rope_theta": 5000.0, **VARIANTS["llama3"]}},
], ids=["yarn", "yarn-hub-spelling", "llama3"])
def test_a_top_level_original_length_overrides_the_rope_blocks_like_transformers(raw):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

    raw = {**raw, "original_max_position_embeddings": 16}
    # a copy: transformers writes the length into the block it is given
    config = Qwen3MoeConfig(hidden_size=64, num_attention_heads=4, head_dim=32, max_position_embeddings=MAX_POS,
                            **copy.deepcopy(raw))
    reference = Qwen3MoeRotaryEmbedding(config)     # its RoPE functions standardize again: the top-level key wins
    assert config.rope_parameters["original_max_position_embeddings"] == 16
    spec = parse_rope(raw, "config.json", MAX_POS)
    assert spec.original_max_position_embeddings == 16
    ours = Rotary(spec, 32, MAX_POS)
    assert torch.equal(ours.inv_freq, reference.inv_freq)
    assert ours.attention_scaling == pytest.approx(reference.attention_scaling, rel=1e-12)
