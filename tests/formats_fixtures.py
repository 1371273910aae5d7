"""Tiny random checkpoints of the families and RoPE variants of issue 16, saved by ``transformers``
itself (``save_pretrained``), optionally with ``config.json`` rewritten in the hub's
``transformers`` 4.x spelling. Nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from runtime_fixtures import HIDDEN, N_EXPERTS, TOP_K, VOCAB, tiny_config

COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=4, num_experts_per_tok=TOP_K,
              max_position_embeddings=256, eos_token_id=None, bos_token_id=None, pad_token_id=None)


def family_config(family: str, **overrides):
    """A tiny ``transformers`` config of ``family`` (the runtime families plus ``qwen2_moe`` and
    ``deepseek_v2``), with ``overrides``."""
    from transformers import DeepseekV2Config, Qwen2MoeConfig

    if family == "qwen2_moe":
        # Qwen1.5-MoE layout: a gated shared expert wider than a routed one, q/k/v biases
        kwargs = dict(COMMON, num_hidden_layers=3, num_key_value_heads=2, num_experts=N_EXPERTS,
                      moe_intermediate_size=32, shared_expert_intermediate_size=48, intermediate_size=80)
        kwargs.update(overrides)
        return Qwen2MoeConfig(**kwargs)
    if family == "deepseek_v2":
        # DeepSeek-V2-Lite layout: MLA without a query low-rank, one dense layer, two shared
        # experts, YaRN with mscale == mscale_all_dim
        kwargs = dict(COMMON, num_hidden_layers=3, num_key_value_heads=4, n_routed_experts=N_EXPERTS,
                      moe_intermediate_size=16, n_shared_experts=2, intermediate_size=80, first_k_dense_replace=1,
                      kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                      topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0,
                      rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                    "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707})
        kwargs.update(overrides)
        return DeepseekV2Config(**kwargs)
    kwargs = dict(overrides)
    rope = kwargs.pop("rope_scaling", None)
    config = tiny_config(family, **kwargs)
    if rope is not None:
        config.rope_parameters = {**config.rope_parameters, **rope}
        config.standardize_rope_params()
    return config


def make_family_model(family: str, model_dir: Path, seed: int = 0, hub_spelling: bool = False, **overrides) -> Path:
    """A random ``family`` model saved to ``model_dir`` by ``save_pretrained``; weights scaled up
    from the tiny default init so that routing and logits are not degenerate."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family, **overrides), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.8, 1.2)
            else:
                param.normal_(0.0, 0.15)
    model_dir = Path(model_dir)
    model.save_pretrained(model_dir)
    if hub_spelling:
        path = model_dir / "config.json"
        path.write_text(json.dumps(as_hub_spelling(json.loads(path.read_text())), indent=2))
    return model_dir


def as_hub_spelling(raw: dict) -> dict:
    """A ``transformers`` 5.x ``config.json`` in the spelling of the hub's 4.x-era files:
    ``rope_theta`` at the top level with a ``rope_scaling`` block (its kind under ``type``),
    ``torch_dtype`` instead of ``dtype``, ``num_experts`` instead of ``num_local_experts``."""
    raw = dict(raw)
    rope = dict(raw.pop("rope_parameters", None) or {})
    raw["rope_theta"] = rope.pop("rope_theta", 10000.0)
    kind = rope.pop("rope_type", "default")
    rope.pop("type", None)
    raw["rope_scaling"] = None if kind == "default" else {"type": kind, **rope}
    raw["torch_dtype"] = raw.pop("dtype", "float32")
    if "num_local_experts" in raw and raw.get("model_type") != "mixtral":
        raw["num_experts"] = raw.pop("num_local_experts")
    raw.pop("layer_types", None)
    raw["transformers_version"] = "4.44.0"
    return raw
