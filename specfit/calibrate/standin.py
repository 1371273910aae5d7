"""Random-weight stand-ins of named model shapes, so a machine can be calibrated before a
checkpoint is downloaded (``specfit calibrate --shape qwen3-30b-a3b --layers 4``).

A stand-in has the real layer shapes (hidden size, heads, experts, expert width, vocabulary) and
fewer layers; its per-layer costs are the real ones, and the cost model's per-pass terms grow by
the timed cost of the layers it lacks (:func:`~specfit.calibrate.calibrate_job.scale_to_depth`). Routing of random weights is near-uniform, which is
what the probes want: many distinct experts per pass, so hits and misses both vary.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..errors import SpecFitError
from ..runtime.config import ModelConfig
from ..runtime.model import MoETransformer, weight_dtype
from ..runtime.offload import ExpertOffload, HostExperts

__all__ = ["SHAPE_CONFIGS", "shape_config", "random_model", "random_drafter", "drafter_config"]

# Hugging Face config.json fields of the supported public shapes (plus a tiny one for tests).
SHAPE_CONFIGS = {
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
        norm_topk_prob=True, tie_word_embeddings=False),
    "olmoe-1b-7b": dict(
        architectures=["OlmoeForCausalLM"], vocab_size=50304, hidden_size=2048, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
        intermediate_size=1024, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
        norm_topk_prob=False, tie_word_embeddings=False),
    "mixtral-8x7b": dict(
        architectures=["MixtralForCausalLM"], vocab_size=32000, hidden_size=4096, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        intermediate_size=14336, rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=32768,
        tie_word_embeddings=False),
    "qwen1.5-moe-a2.7b": dict(
        architectures=["Qwen2MoeForCausalLM"], vocab_size=151936, hidden_size=2048, num_hidden_layers=24,
        num_attention_heads=16, num_key_value_heads=16, num_experts=60, num_experts_per_tok=4,
        moe_intermediate_size=1408, shared_expert_intermediate_size=5632, intermediate_size=5632,
        rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=8192, norm_topk_prob=False,
        tie_word_embeddings=False),
    "deepseek-v2-lite": dict(
        architectures=["DeepseekV2ForCausalLM"], vocab_size=102400, hidden_size=2048, num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64, num_experts_per_tok=6,
        moe_intermediate_size=1408, n_shared_experts=2, intermediate_size=10944, first_k_dense_replace=1,
        kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        topk_method="greedy", routed_scaling_factor=1.0, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
        max_position_embeddings=163840, norm_topk_prob=False, tie_word_embeddings=False),
    "tiny": dict(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=512, hidden_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=128, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=2048,
        norm_topk_prob=True, tie_word_embeddings=False),
}


def shape_config(name: str, n_layers: int | None = None) -> ModelConfig:
    """The :class:`ModelConfig` of a named shape, optionally with fewer layers."""
    if name not in SHAPE_CONFIGS:
        raise SpecFitError(f"--shape {name!r}: expected one of {', '.join(SHAPE_CONFIGS)}")
    raw = dict(SHAPE_CONFIGS[name])
    if n_layers is not None:
        if not 1 <= n_layers <= raw["num_hidden_layers"]:
            raise SpecFitError(f"--layers: expected 1..{raw['num_hidden_layers']} for {name}, got {n_layers}")
        raw["num_hidden_layers"] = n_layers
    return ModelConfig.from_dict(raw, source=f"shape {name}")


def standin_bytes(config: ModelConfig, dtype: torch.dtype) -> dict[str, int]:
    """Host bytes a stand-in of ``config`` holds: its experts and its dense weights."""
    with torch.device("meta"):
        model = MoETransformer(config)
    dense = sum(t.numel() * torch.empty(0, dtype=weight_dtype(name, config, dtype)).element_size()
                for name, t in model.state_dict().items())
    return {"experts": config.n_moe_layers * config.n_experts * config.expert_bytes(dtype), "dense": dense}


@torch.inference_mode()
def random_model(config: ModelConfig, device: torch.device, dtype: torch.dtype, cache_experts: int = 0,
                 seed: int = 0, progress: Callable[[str], None] | None = None) -> MoETransformer:
    """A :class:`MoETransformer` of ``config`` with random weights: dense weights on ``device``,
    experts in (pinned, on CUDA) host memory behind an expert cache, as the loader builds it.

    Weights are uniform with the variance of ``1 / fan_in`` (timing does not depend on their
    distribution). On the CPU they are filled in place, so building needs no temporary copy of a
    layer's experts; on an accelerator they are drawn there (the CPU's generator is serial: seconds
    per Qwen3-30B-A3B layer, ``benchmarks/RESULTS.md``, "The GPU run (issue 17): one NVIDIA H200")
    and the experts copied to host memory a block at a time.
    ``progress`` hears of each expert layer."""
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        model = MoETransformer(config)
    state = {}
    for name, param in model.state_dict(keep_vars=True).items():
        # held in the loader's dtypes (a float32 router), so the stand-in times what the model runs
        held = weight_dtype(name, config, dtype)
        if name.endswith("norm.weight"):
            state[name] = torch.ones(param.shape, dtype=held, device=device)
        else:
            state[name] = _fill(torch.empty(param.shape, dtype=held, device=device), gen)
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False).eval()
    model.init_rope()
    host = HostExperts(config.n_moe_layers, config.n_experts, config.hidden_size, config.expert_intermediate_size,
                       dtype, pin_memory=device.type == "cuda")
    for layer in range(config.n_moe_layers):
        if progress is not None:
            progress(f"random expert weights, layer {layer + 1}/{config.n_moe_layers}")
        for tensor in (host.gate_up[layer], host.down[layer]):
            _fill_host(tensor, gen)
    model.attach_offload(ExpertOffload(host, cache_experts, device=device))
    return model


def _fill(tensor: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Uniform in +-sqrt(3 / fan_in) (variance 1 / fan_in), in place, in the tensor's dtype."""
    bound = (3.0 / tensor.shape[-1]) ** 0.5
    return tensor.uniform_(-bound, bound, generator=gen)


def _fill_host(tensor: torch.Tensor, gen: torch.Generator, block_bytes: int = 1 << 28,
               blocks: bool | None = None) -> torch.Tensor:
    """:func:`_fill` of a host tensor [E, rows, cols] from ``gen``'s device: in place when that is
    the tensor's, else (or with ``blocks``) drawn there a block of whole experts (about
    ``block_bytes``) at a time and copied in."""
    if not (gen.device != tensor.device if blocks is None else blocks):
        return _fill(tensor, gen)
    per_block = max(1, block_bytes // max(tensor[0].nbytes, 1))
    for part in tensor.split(per_block):
        part.copy_(_fill(torch.empty(part.shape, dtype=part.dtype, device=gen.device), gen))
    return tensor


def random_drafter(model: MoETransformer, draft_vocab_size: int = 32000, seed: int = 0):
    """An EAGLE-3 head shaped like the published ones for this target (its width, heads and
    head_dim, a 32k draft vocabulary), random weights, sharing the target's embedding: what a
    stand-in's draft levels are timed with, and the drafter of ``benchmarks/gpu_check.py``."""
    from ..runtime.eagle3 import Eagle3Drafter

    config = drafter_config(model.config, model.dtype, draft_vocab_size, capture_layers=model.capture_layers)
    drafter = Eagle3Drafter(config, target_embed=model.embed_tokens.weight)
    drafter.init_weights(seed)
    return drafter.to(device=model.device, dtype=model.dtype).eval()


def drafter_config(config: ModelConfig, dtype: torch.dtype, draft_vocab_size: int = 32000,
                   capture_layers: tuple[int, ...] | None = None):
    """The :class:`~specfit.runtime.eagle3.Eagle3Config` of :func:`random_drafter` for a target of
    ``config`` (what ``specfit plan`` counts for a drafting policy)."""
    from ..runtime.eagle3 import Eagle3Config
    from ..runtime.config import default_capture_layers

    c = config
    # an EAGLE-3 head attends like a Llama layer; MLA's head_dim is only its rotary part (64 of
    # DeepSeek-V2-Lite's 128), which would make the drafter's attention half as wide
    head_dim = c.hidden_size // c.n_heads if c.mla else c.head_dim
    layers = default_capture_layers(c.n_layers) if capture_layers is None else capture_layers
    return Eagle3Config(hidden_size=c.hidden_size, target_hidden_size=c.hidden_size, vocab_size=c.vocab_size,
                        draft_vocab_size=min(draft_vocab_size, c.vocab_size), num_attention_heads=c.n_heads,
                        num_key_value_heads=c.n_kv_heads, head_dim=head_dim, intermediate_size=3 * c.hidden_size,
                        aux_hidden_state_layer_ids=tuple(layers), dtype=str(dtype).removeprefix("torch."))
