"""Tiny random MoE checkpoints built and saved by ``transformers`` itself, for the runtime tests.

Nothing is downloaded: the configs are constructed in code and ``save_pretrained`` writes them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

FAMILIES = ("qwen3_moe", "olmoe", "mixtral")
N_LAYERS, N_EXPERTS, TOP_K, HIDDEN, VOCAB = 2, 8, 2, 64, 96


@pytest.fixture(scope="module", autouse=True)
def torch_single_thread():
    """Run each runtime test module on one intra-op thread: the tiny models' kernels are too
    small to gain from threads, and on a shared 2-core machine thread wake-ups made every
    operation 5-10x slower. Import this fixture into a test module to apply it there."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def tiny_config(family: str, **overrides):
    """A 2-layer, 8-expert, top-2 config of ``family`` (a ``transformers`` config object)."""
    from transformers import MixtralConfig, OlmoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=N_LAYERS, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=TOP_K, max_position_embeddings=256,
                  eos_token_id=None, bos_token_id=None, pad_token_id=None)
    if family == "qwen3_moe":
        # head_dim 32 != hidden / heads (16), as in Qwen3-30B-A3B; renormalised top-k
        kwargs = dict(common, num_experts=N_EXPERTS, moe_intermediate_size=32, intermediate_size=96, head_dim=32,
                      norm_topk_prob=True)
        cls = Qwen3MoeConfig
    elif family == "olmoe":
        kwargs = dict(common, num_experts=N_EXPERTS, intermediate_size=48, norm_topk_prob=False)
        cls = OlmoeConfig
    elif family == "mixtral":
        kwargs = dict(common, num_local_experts=N_EXPERTS, intermediate_size=48)
        cls = MixtralConfig
    else:
        raise ValueError(family)
    kwargs.update(overrides)
    return cls(**kwargs)


def make_tiny_model(family: str, model_dir: Path, seed: int = 0, fused_experts: bool = False, **overrides) -> Path:
    """Build a random ``family`` model with ``transformers``, save it to ``model_dir``.

    ``fused_experts`` writes the in-memory (fused) tensor names, ``mlp.experts.gate_up_proj``
    [E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I], instead of ``save_pretrained``'s
    per-expert names. Weights are scaled up from the tiny default init so that routing and
    logits are not degenerate (near-uniform logits would make greedy ties likely).
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.15)
            else:
                param.uniform_(0.8, 1.2)
    model_dir = Path(model_dir)
    model.save_pretrained(model_dir)
    if fused_experts:
        (model_dir / "model.safetensors").unlink()
        state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
        save_file(state, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    return model_dir


def load_reference(model_dir: Path, dtype=torch.float32):
    """The same checkpoint in ``transformers``, with the eager (exactly reproducible) paths."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation="eager", experts_implementation="eager").eval()


def shard_checkpoint(model_dir: Path, n_shards: int = 2) -> None:
    """Split ``model.safetensors`` into ``n_shards`` files with a ``model.safetensors.index.json``."""
    from safetensors.torch import load_file

    single = model_dir / "model.safetensors"
    tensors = load_file(str(single))
    single.unlink()
    names = sorted(tensors)
    weight_map = {}
    for shard in range(n_shards):
        file = f"model-{shard + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {name: tensors[name] for name in names[shard::n_shards]}
        save_file(part, str(model_dir / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in part})
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
