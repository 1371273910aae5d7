"""Config parsing and checkpoint loading: key variants, layouts, and one-line errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime_fixtures import make_tiny_model
from runtime_fixtures import torch_single_thread  # noqa: F401  (autouse: one intra-op thread)
from specfit.errors import SpecFitError
from specfit.runtime.config import ModelConfig
from specfit.runtime.loader import Checkpoint, load_model, load_tokenizer

pytest.importorskip("transformers")

# Qwen3-30B-A3B's config.json as published on the hub (hub key spellings)
HUB_QWEN3 = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "intermediate_size": 6144,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None, "max_position_embeddings": 40960,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "vocab_size": 151936, "eos_token_id": 151645, "use_sliding_window": False,
    "sliding_window": None, "hidden_act": "silu", "attention_bias": False,
}


def _as_transformers_5(raw: dict) -> dict:
    """The same config with the key spellings transformers 5.x writes."""
    raw = dict(raw)
    raw["num_local_experts"] = raw.pop("num_experts")
    raw["rope_parameters"] = {"rope_theta": raw.pop("rope_theta"), "rope_type": "default"}
    raw.pop("rope_scaling")
    raw["dtype"] = raw.pop("torch_dtype")
    return raw


def test_hub_and_transformers5_keys_give_the_same_config():
    hub = ModelConfig.from_dict(HUB_QWEN3)
    assert hub == ModelConfig.from_dict(_as_transformers_5(HUB_QWEN3))
    assert (hub.n_experts, hub.top_k, hub.head_dim, hub.rope_theta) == (128, 8, 128, 1e6)
    assert hub.checkpoint_dtype == "bfloat16" and hub.norm_topk_prob and hub.qk_norm == "per_head"
    assert hub.expert_bytes(torch.bfloat16) == 3 * 768 * 2048 * 2     # 9.44 MB, as REFERENCE.md says


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "mixtral"])
def test_saved_configs_parse(tmp_path, family):
    from runtime_fixtures import tiny_config

    tiny_config(family).save_pretrained(tmp_path)
    config = ModelConfig.from_dir(tmp_path)
    assert config.model_type == family and config.n_experts == 8 and config.top_k == 2
    assert config.norm_topk_prob == (family != "olmoe")        # Mixtral always renormalises


def test_generation_config_eos_ids_take_precedence(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(HUB_QWEN3))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (151645, 151643)


@pytest.mark.parametrize("change,message", [
    ({"num_experts": None}, "missing key 'num_local_experts' or 'num_experts'"),
    ({"hidden_size": None}, "missing key 'hidden_size'"),
    ({"rope_theta": None}, "missing key 'rope_theta'"),
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "unsupported architecture \\(LlamaForCausalLM\\)"),
    ({"mlp_only_layers": list(range(48))}, "no decoder layer has routed experts"),
    ({"mlp_only_layers": "0,1"}, "'mlp_only_layers' must be a list"),
    ({"mlp_only_layers": [3, 48]}, "'mlp_only_layers' must be a list of layer indices in \\[0, 48\\), got \\[3, 48\\]"),
    ({"eos_token_id": 151936}, "'eos_token_id' must be a token id .* in \\[0, vocab_size 151936\\)\\), got 151936"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope_type 'longrope'; supported"),
    ({"rope_scaling": {"rope_type": "linear"}}, "'rope_scaling.factor' is required"),
    ({"num_experts_per_tok": "eight"}, "'num_experts_per_tok' must be an integer, got 'eight'"),
    ({"hidden_size": "2048"}, "'hidden_size' must be an integer, got '2048'"),
    ({"num_hidden_layers": 4.5}, "'num_hidden_layers' must be an integer, got 4.5"),
    ({"num_hidden_layers": True}, "'num_hidden_layers' must be an integer, got true \\(a boolean\\)"),
    ({"num_hidden_layers": float("inf")}, "'num_hidden_layers' must be an integer, got inf"),
    ({"rms_norm_eps": "1e-6"}, "'rms_norm_eps' must be a number, got '1e-6'"),
    ({"norm_topk_prob": "false"}, "'norm_topk_prob' must be true or false, got 'false'"),
    # checked for >= 1 before it divides the heads
    ({"num_key_value_heads": 0}, "'num_key_value_heads' must be at least 1, got 0"),
    ({"architectures": 5}, "'architectures' must be a list of class names, got 5"),
    ({"architectures": [{"name": "Qwen3MoeForCausalLM"}]}, "'architectures' must be a list of class names, got a list"),
    ({"architectures": None, "model_type": ["qwen3_moe"]}, "'model_type' must be a string, got a list"),
])
def test_bad_config_is_one_error_naming_file_and_key(tmp_path, change, message):
    raw = {k: v for k, v in {**HUB_QWEN3, **change}.items() if v is not None}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(SpecFitError, match=message) as info:
        ModelConfig.from_file(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("eos", [float("inf"), 2.5, "151645", [151645, None], -1, [151645, 151936]])
def test_a_generation_config_eos_that_is_no_token_id_is_one_error(tmp_path, eos):
    (tmp_path / "config.json").write_text(json.dumps(HUB_QWEN3))
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"eos_token_id": eos}))
    with pytest.raises(SpecFitError, match="key 'eos_token_id' must be a token id or a list of token ids") as info:
        ModelConfig.from_dir(tmp_path)
    assert str(path) in str(info.value)


def test_missing_or_unreadable_config(tmp_path):
    with pytest.raises(SpecFitError, match="no such file"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SpecFitError, match="not a readable JSON file"):
        ModelConfig.from_dir(tmp_path)


@pytest.fixture()
def qwen_dir(tmp_path):
    return make_tiny_model("qwen3_moe", tmp_path / "qwen")


def _rewrite(model_dir, edit):
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_missing_expert_tensor_is_named_with_its_shape(qwen_dir):
    _rewrite(qwen_dir, lambda t: t.pop("model.layers.1.mlp.experts.5.up_proj.weight"))
    with pytest.raises(SpecFitError, match=r"missing tensor 'model.layers.1.mlp.experts.5.up_proj.weight' \(expected shape \[32, 64\]\)"):
        load_model(qwen_dir)


def test_misshaped_tensor_is_named_with_both_shapes(qwen_dir):
    def edit(tensors):
        tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    _rewrite(qwen_dir, edit)
    with pytest.raises(SpecFitError, match=r"tensor 'model.layers.0.self_attn.q_norm.weight' has shape \[16\], expected \[32\]"):
        load_model(qwen_dir)


def test_a_tensor_the_config_does_not_describe_is_refused_not_dropped(qwen_dir):
    """Shared-expert weights in a Qwen3-MoE checkpoint (an architecture without them) would be left
    out of every forward pass without a word."""
    def edit(tensors):
        for name in ("gate_proj", "up_proj"):
            tensors[f"model.layers.1.mlp.shared_expert.{name}.weight"] = torch.zeros(32, 64)
    _rewrite(qwen_dir, edit)
    with pytest.raises(SpecFitError, match=r"tensor 'model.layers.1.mlp.shared_expert.gate_proj.weight' \(and 1 "
                                           r"more\) is no weight of a Qwen3MoeForCausalLM model of 2 layers"):
        load_model(qwen_dir)


def test_a_rope_buffer_saved_by_an_older_export_is_no_weight(qwen_dir):
    _rewrite(qwen_dir, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    assert load_model(qwen_dir).config.n_layers == 2


def test_integer_weights_are_named_with_their_stored_type(qwen_dir):
    name = "model.layers.1.mlp.experts.2.down_proj.weight"

    def edit(tensors):
        tensors[name] = tensors[name].to(torch.int32)
    _rewrite(qwen_dir, edit)
    with pytest.raises(SpecFitError, match=rf"tensor '{name}' is stored as I32, expected floating-point weights"):
        load_model(qwen_dir)


# against a regression in loader.py (any stored type starting with F taken for a weight): 8-bit floats are
# quantized weights whose scales live elsewhere, read plainly they would be other numbers
def test_fp8_weights_are_named_with_their_stored_type(qwen_dir):
    name = "model.layers.0.self_attn.q_proj.weight"
    _rewrite(qwen_dir, lambda t: t.update({name: t[name].to(torch.float8_e4m3fn)}))
    with pytest.raises(SpecFitError, match=rf"tensor '{name}' is stored as F8_E4M3, expected floating-point weights"):
        load_model(qwen_dir)


# against a regression in config.py (quantization_config ignored: a late error about scale tensors, or
# quantized weights read as plain floats)
@pytest.mark.parametrize("quantization, method", [({"quant_method": "fp8", "weight_block_size": [128, 128]}, "fp8"),
                                                  ("gptq", "no quant_method")])
def test_a_quantized_checkpoint_is_refused_by_its_config(quantization, method, qwen_dir):
    """Its weights are refused before any is read; its shape (all a routing import or a plan
    needs, and routing logs from quantized deployments are common) is read as any other."""
    from specfit.traces.importers import model_from_config

    config_path = qwen_dir / "config.json"
    raw = json.loads(config_path.read_text())
    plain = model_from_config(config_path)
    config_path.write_text(json.dumps({**raw, "quantization_config": quantization}))
    assert model_from_config(config_path) == plain
    assert ModelConfig.from_dict({**HUB_QWEN3, "quantization_config": quantization}).quantization == method
    with pytest.raises(SpecFitError, match=re.escape(f"config.json: key 'quantization_config' ({method}): quantized "
                                                     f"checkpoints are not supported; expected")):
        load_model(qwen_dir)


def test_misshaped_fused_experts_are_rejected(tmp_path):
    model_dir = make_tiny_model("olmoe", tmp_path / "fused", fused_experts=True)

    def edit(tensors):
        name = "model.layers.0.mlp.experts.gate_up_proj"
        tensors[name] = tensors[name][:, :-1].contiguous()
    _rewrite(model_dir, edit)
    with pytest.raises(SpecFitError, match=r"gate_up_proj' has shape \[8, 95, 64\], expected \[8, 96, 64\]"):
        load_model(model_dir)


def test_no_safetensors_is_one_error(tmp_path, qwen_dir):
    (qwen_dir / "model.safetensors").rename(qwen_dir / "pytorch_model.bin")
    with pytest.raises(SpecFitError, match="no model.safetensors or model.safetensors.index.json"):
        Checkpoint(qwen_dir)


def test_sharded_index_with_a_missing_shard(qwen_dir):
    (qwen_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": "gone.safetensors"}}))
    with pytest.raises(SpecFitError, match="shard gone.safetensors is listed but missing"):
        Checkpoint(qwen_dir)


@pytest.mark.parametrize("content, message", [
    (json.dumps({"weight_map": ["model.safetensors"]}), "key 'weight_map' must be an object of tensor name -> shard"),
    (json.dumps({"weight_map": {"lm_head.weight": 5}}), "key 'weight_map' must be an object of tensor name -> shard"),
    (json.dumps({"metadata": {}}), "key 'weight_map' must be an object .*, got null"),
    (b"\xff\xfe{}", "not a readable JSON file"),
])
def test_a_damaged_shard_index_is_one_error(qwen_dir, content, message):
    path = qwen_dir / "model.safetensors.index.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(SpecFitError, match=message) as info:
        Checkpoint(qwen_dir)
    assert str(path) in str(info.value)


def test_tied_embeddings_load_without_lm_head(tmp_path):
    model_dir = make_tiny_model("qwen3_moe", tmp_path / "tied", tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(str(model_dir / "model.safetensors"))
    model = load_model(model_dir)
    assert torch.equal(model.lm_head.weight, model.embed_tokens.weight)
    # what plan reserves for the dense weights is what the model holds: the tied tensor once
    from specfit.simulate.plan import dense_weight_params

    held = {t.data_ptr(): t.numel() for t in model.state_dict().values()}
    assert dense_weight_params(model.config) == sum(held.values())


def test_tokenizer_is_optional(tmp_path, qwen_dir):
    from tokenizers import Tokenizer, models, pre_tokenizers

    assert load_tokenizer(qwen_dir) is None
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(qwen_dir / "tokenizer.json"))
    assert load_tokenizer(qwen_dir).encode("hello world").ids == [1, 2]
    (qwen_dir / "tokenizer.json").write_text("{}")
    with pytest.raises(SpecFitError, match="not a readable tokenizer file"):
        load_tokenizer(qwen_dir)


def test_load_uses_the_requested_dtype(qwen_dir):
    model = load_model(qwen_dir, dtype="bfloat16", cache_experts=2)
    assert model.dtype == torch.bfloat16
    assert model.offload.host.dtype == torch.bfloat16 and model.offload.slot_gate_up.dtype == torch.bfloat16
    with pytest.raises(SpecFitError, match="dtype"):
        load_model(qwen_dir, dtype="int8")


def test_decode_start_up_imports_neither_torch_dynamo_nor_what_only_fitting_needs():
    """Loading the target and the drafter on the meta device skips their random init and the
    arithmetic whose meta kernels import ``torch._dynamo``; scikit-learn and ``scipy.stats`` are
    imported by the fits that use them. Together ~2 s of every ``specfit decode``'s start-up."""
    from specfit.assets import tiny_moe_dir, tiny_moe_eagle3_dir

    code = ("import sys; import specfit.cli, specfit.runtime.decode_job, specfit.runtime.decoder, "
            "specfit.calibrate.calibrate_job, specfit.calibrate.probes; "
            "from specfit.runtime.loader import drafter_capture_layers, load_drafter, load_model; "
            "from specfit.runtime.config import ModelConfig; "
            f"target, drafter = {str(tiny_moe_dir())!r}, {str(tiny_moe_eagle3_dir())!r}; "
            "layers = drafter_capture_layers(drafter, ModelConfig.from_dir(target)); "
            "m = load_model(target, capture_layers=layers); d = load_drafter(drafter, m); "
            "assert m.embed_tokens.weight.abs().sum() > 0 and d.fc.weight.abs().sum() > 0; "
            "print(sorted(k for k in ('torch._dynamo', 'sklearn', 'scipy.stats') if k in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# modelled on Qwen1.5-MoE-A2.7B's hub config.json (4.x era: no 'qkv_bias' key, the biases are
# always there; a window value that use_sliding_window: false leaves off)
HUB_QWEN2_MOE = {
    "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 2048,
    "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 60,
    "num_experts_per_tok": 4, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
    "intermediate_size": 5632, "decoder_sparse_step": 1, "norm_topk_prob": False, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "max_position_embeddings": 8192, "max_window_layers": 21, "sliding_window": 32768,
    "use_sliding_window": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 151936,
    "hidden_act": "silu", "bos_token_id": 151643, "eos_token_id": 151643,
}


# against a regression in config.py (a missing 'qkv_bias' read as false: the checkpoint's q/k/v biases
# would be silently dropped)
def test_qwen2_moe_hub_config_without_qkv_bias_has_the_attention_biases():
    from transformers import Qwen2MoeConfig

    assert Qwen2MoeConfig(**HUB_QWEN2_MOE).qkv_bias is True          # transformers' default
    assert ModelConfig.from_dict(HUB_QWEN2_MOE).attention_bias is True
    assert ModelConfig.from_dict({**HUB_QWEN2_MOE, "qkv_bias": False}).attention_bias is False


# against a regression in config.py (the window applied / refused without use_sliding_window)
@pytest.mark.parametrize("raw", [HUB_QWEN2_MOE, {**HUB_QWEN3, "sliding_window": 4096}], ids=["qwen2_moe", "qwen3_moe"])
def test_a_qwen_window_without_use_sliding_window_is_ignored(raw):
    assert ModelConfig.from_dict(raw).sliding_window is None


# a config without 'num_key_value_heads' gets what transformers' config class gives it: the class
# default for Qwen3-MoE (4), Qwen2-MoE (16) and Mixtral (8), one KV head per query head for OLMoE
# and DeepSeek-V2 (found by mutation round s52: SpecFit gave every family one per query head)
@pytest.mark.parametrize("family", ["Qwen3Moe", "Qwen2Moe", "Mixtral", "Olmoe", "DeepseekV2"])
def test_missing_num_key_value_heads_is_what_transformers_config_class_gives(family):
    import transformers

    config_class = getattr(transformers, f"{family}Config")
    raw = config_class(num_attention_heads=16, hidden_size=2048, num_experts_per_tok=2).to_dict() | {
        "architectures": [f"{family}ForCausalLM"]}
    raw.pop("num_key_value_heads")
    assert ModelConfig.from_dict(raw).n_kv_heads == config_class(**raw).num_key_value_heads
    if family == "Qwen2Moe":        # a default that does not divide the heads: the key is asked for
        with pytest.raises(SpecFitError, match=r"num_key_value_heads \(16, the default of Qwen2MoeForCausalLM's "
                                               r"transformers config class where the key is missing: add the key\)"):
            ModelConfig.from_dict({**raw, "num_attention_heads": 4})


# config.py: shape checks of the config
@pytest.mark.parametrize("change,message", [
    ({"num_experts_per_tok": 129}, "'num_experts_per_tok' is 129, more than the 128 experts"),
    ({"num_key_value_heads": 5}, "must be a multiple of num_key_value_heads \\(5\\)"),
])
def test_inconsistent_head_or_expert_counts_are_one_error(change, message):
    with pytest.raises(SpecFitError, match=message):
        ModelConfig.from_dict({**HUB_QWEN3, **change}, source="config.json")


# against a regression in loader.py (tie_word_embeddings read as "always use the embedding"): a checkpoint
# that says tied but stores its own, different lm_head.weight runs that head, as transformers does
def test_a_tied_config_with_a_stored_lm_head_uses_the_stored_head_like_transformers(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    from runtime_fixtures import load_reference, make_tiny_model
    from specfit.runtime.loader import load_model

    model_dir = make_tiny_model("qwen3_moe", tmp_path, tie_word_embeddings=True)
    tensors = load_file(str(model_dir / "model.safetensors"))
    tensors["lm_head.weight"] = torch.randn(tensors["model.embed_tokens.weight"].shape,
                                            generator=torch.Generator().manual_seed(0))
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    reference = load_reference(model_dir)
    model = load_model(model_dir, cache_experts=3)
    model.setup_kv_cache(16)
    ids = torch.arange(8) * 7 % 96
    with torch.no_grad():
        want = reference(ids[None]).logits[0]
    torch.testing.assert_close(model(ids, torch.arange(8)).logits, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"])


# against a regression in loader.py (load_router without the post-attention norm folded into the routers):
# the replay's router predictor reads the checkpoint as the live one reads the loaded model
def test_load_router_predicts_like_the_live_router_predictor_of_the_loaded_model(tmp_path):
    import numpy as np

    from runtime_fixtures import make_tiny_model
    from specfit.experts.predictor_base import NodeBatch
    from specfit.experts.router import RouterPredictor
    from specfit.runtime.loader import load_model, load_router

    model_dir = make_tiny_model("qwen3_moe", tmp_path)      # norms drawn in [0.8, 1.2], not ones
    live = RouterPredictor(load_model(model_dir, cache_experts=8), adapt=False)
    replay = load_router(model_dir)
    tokens = np.arange(96)
    batch = NodeBatch(tokens=tokens, last_known=np.full((96, 2, 2), -1, dtype=np.int64))
    assert replay.layers_experts == live.layers_experts == (2, 8)
    assert np.array_equal(replay.predict(batch), live.predict(batch))
