"""Calibration of the families with shared experts and dense layers: the profile's shape counts
MoE layers and routed experts, and records the resident shared expert apart."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from formats_fixtures import make_family_model
from runtime_fixtures import N_EXPERTS, TOP_K
from runtime_fixtures import torch_single_thread  # noqa: F401  (autouse: one intra-op thread)
from specfit.calibrate.profile import ModelShape, load_profile
from specfit.calibrate.standin import random_model, shape_config
from specfit.cli import app
from specfit.runtime.config import ModelConfig
from specfit.runtime.model import causal_mask

pytest.importorskip("transformers")


def test_stand_in_shapes_of_qwen15_moe_and_deepseek_v2_lite():
    qwen = shape_config("qwen1.5-moe-a2.7b")
    assert (qwen.n_layers, qwen.n_moe_layers, qwen.n_experts, qwen.top_k) == (24, 24, 60, 4)
    assert qwen.shared_expert_gated and qwen.shared_expert_intermediate_size == 5632
    deepseek = shape_config("deepseek-v2-lite")
    assert (deepseek.n_layers, deepseek.n_moe_layers, deepseek.moe_layers[0]) == (27, 26, 1)
    assert deepseek.mla.kv_lora_rank == 512 and deepseek.rope.rope_type == "yarn"
    shape = ModelShape.from_config(deepseek, torch.bfloat16, "deepseek-v2-lite")
    assert shape.n_layers == 26                                     # the dense first layer has nothing to move
    assert shape.expert_bytes == 3 * 1408 * 2048 * 2                # one routed expert
    assert shape.shared_expert_bytes == 3 * 2 * 1408 * 2048 * 2     # two shared experts, resident


def test_a_stand_in_with_shared_experts_and_dense_layers_runs():
    config = ModelConfig.from_dict(_small(), source="small")
    model = random_model(config, torch.device("cpu"), torch.float32, cache_experts=2)
    model.setup_kv_cache(8)
    out = model([1, 2, 3], torch.arange(3), causal_mask(0, 3))
    assert out.expert_ids.shape == (3, 1, config.top_k) and model.offload.host.n_layers == 1
    assert torch.isfinite(out.logits).all()


def _small() -> dict:
    """A small DeepSeek-V2 config.json with the stand-in's structure (dense first layer, MLA)."""
    return dict(architectures=["DeepseekV2ForCausalLM"], vocab_size=64, hidden_size=32, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2, n_routed_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=16, n_shared_experts=2, intermediate_size=48, first_k_dense_replace=1,
                kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64)


def test_calibrate_a_deepseek_checkpoint_profiles_routed_experts_of_moe_layers(tmp_path):
    model_dir = make_family_model("deepseek_v2", tmp_path / "model", seed=3)
    out = tmp_path / "profile.json"
    result = CliRunner().invoke(app, ["calibrate", "--model", str(model_dir), "--quick", "--device", "cpu",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    profile = load_profile(out)
    config = ModelConfig.from_dir(model_dir)
    assert profile.shape.n_layers == config.n_moe_layers == 2 and profile.shape.n_experts == N_EXPERTS
    assert profile.shape.top_k == TOP_K and profile.shape.expert_bytes == config.expert_bytes(torch.float32)
    assert profile.shape.shared_expert_bytes == config.shared_expert_bytes(torch.float32) > 0
    assert profile.cost.expert_bytes == config.expert_bytes(torch.float32)
    again = load_profile(out).shape                                  # the JSON round trip keeps it
    assert again == profile.shape


def test_the_preset_shapes_are_the_shapes_of_the_public_configs_in_bf16():
    """The presets' shapes are typed in (the CLI starts without torch); the stand-in's configs are
    the public ones: both must describe the same model."""
    import torch

    from specfit.calibrate.presets import SHAPES
    from specfit.calibrate.standin import shape_config

    for name, shape in SHAPES.items():
        assert ModelShape.from_config(shape_config(name), torch.bfloat16, name) == shape, name
