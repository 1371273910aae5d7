"""Target families of issue 16 against ``transformers`` on tiny random models it saved itself:
Qwen2-MoE (gated shared expert, q/k/v biases, dense layers between MoE layers), DeepSeek-V2 (MLA,
shared experts, greedy and group-limited routing, dense first layers, YaRN), RoPE scaling on the
other families, both config spellings, offload counters per MoE layer, and ``specfit decode``."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from formats_fixtures import as_hub_spelling, make_family_model
from runtime_fixtures import N_EXPERTS, TOP_K, VOCAB, load_reference
from runtime_fixtures import torch_single_thread  # noqa: F401  (autouse: one intra-op thread)
from speculative_fixtures import make_drafter
from specfit.cli import app
from specfit.errors import SpecFitError
from specfit.runtime.config import ModelConfig
from specfit.runtime.loader import load_model
from specfit.runtime.routers import route

pytest.importorskip("transformers")

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
CASES = {
    "qwen2_moe": ("qwen2_moe", {}),
    "qwen2_moe-mlp_only_layers": ("qwen2_moe", {"mlp_only_layers": [1]}),
    "qwen2_moe-sparse_step_2": ("qwen2_moe", {"decoder_sparse_step": 2, "num_hidden_layers": 4}),
    "deepseek_v2-lite": ("deepseek_v2", {}),
    "deepseek_v2-grouped": ("deepseek_v2", {"q_lora_rank": 16, "topk_method": "group_limited_greedy", "n_group": 4,
                                            "topk_group": 2, "routed_scaling_factor": 2.5, "rope_scaling": None}),
    "qwen3_moe-yarn": ("qwen3_moe", {"rope_scaling": YARN}),
    "qwen3_moe-mlp_only_layers": ("qwen3_moe", {"mlp_only_layers": [0]}),
    "mixtral-linear": ("mixtral", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "olmoe-dynamic": ("olmoe", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
}
SEQ = 12


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    cache = {}

    def get(case, hub_spelling=False):
        if (case, hub_spelling) not in cache:
            family, overrides = CASES[case]
            root = tmp_path_factory.mktemp(case)
            cache[case, hub_spelling] = make_family_model(family, root, seed=3, hub_spelling=hub_spelling, **overrides)
        return cache[case, hub_spelling]

    return get


def _tokens(n=SEQ, seed=1):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _ours(model_dir, cache_experts=3, max_seq_len=64, **kwargs):
    model = load_model(model_dir, cache_experts=cache_experts, **kwargs)
    model.setup_kv_cache(max_seq_len)
    return model


# ----------------------------------------------------------------------------- configs
@pytest.mark.parametrize("case", ["qwen2_moe-mlp_only_layers", "deepseek_v2-lite", "qwen3_moe-yarn", "mixtral-linear"])
def test_transformers_4_and_5_config_spellings_give_the_same_config(model_dirs, case):
    saved = json.loads((model_dirs(case) / "config.json").read_text())
    assert "rope_parameters" in saved and "dtype" in saved          # what transformers 5.x writes
    hub = as_hub_spelling(saved)
    assert "rope_parameters" not in hub and "torch_dtype" in hub
    assert ModelConfig.from_dict(saved) == ModelConfig.from_dict(hub)


def test_dense_and_moe_layers_follow_each_familys_keys():
    def layers(case, **extra):
        family, overrides = CASES[case]
        from formats_fixtures import family_config

        raw = family_config(family, **{**overrides, **extra}).to_dict()
        return ModelConfig.from_dict(raw).moe_layers

    assert layers("qwen2_moe") == (0, 1, 2)
    assert layers("qwen2_moe-mlp_only_layers") == (0, 2)
    assert layers("qwen2_moe-sparse_step_2") == (1, 3)            # (i + 1) % step == 0
    assert layers("deepseek_v2-lite") == (1, 2)                   # i >= first_k_dense_replace
    assert layers("deepseek_v2-lite", first_k_dense_replace=0) == (0, 1, 2)


@pytest.mark.parametrize("shape, changes, needle", [
    ("qwen1.5-moe-a2.7b", {"shared_expert_intermediate_size": -4},
     "key 'shared_expert_intermediate_size' must be 0 (no shared expert) or more, got -4"),
    ("deepseek-v2-lite", {"n_shared_experts": -1}, "key 'n_shared_experts' must be 0 (no shared expert) or more, got -1"),
    ("deepseek-v2-lite", {"intermediate_size": 0}, "key 'intermediate_size' must be at least 1, got 0"),
    ("qwen1.5-moe-a2.7b", {"mlp_only_layers": [0], "intermediate_size": -8}, "key 'intermediate_size' must be at least 1"),
])
def test_a_dense_or_shared_width_out_of_range_is_blamed_on_the_config(shape, changes, needle):
    """Refused where the config is read, as the routed experts' width is (a dense width of 0 or less
    was refused only as a tensor of shape [-8, H]; a negative shared width was taken)."""
    from specfit.calibrate.standin import SHAPE_CONFIGS

    with pytest.raises(SpecFitError, match=re.escape(needle)):
        ModelConfig.from_dict({**SHAPE_CONFIGS[shape], **changes})
    assert ModelConfig.from_dict({**SHAPE_CONFIGS["deepseek-v2-lite"], "n_shared_experts": 0}).shared_expert_intermediate_size == 0


@pytest.mark.parametrize("shape, key", [("qwen1.5-moe-a2.7b", "shared_expert_intermediate_size"),
                                        ("deepseek-v2-lite", "n_shared_experts"), ("deepseek-v2-lite", "q_lora_rank")])
def test_a_key_left_out_of_a_config_gets_transformers_class_default(shape, key):
    """The model transformers builds from such a config has the default's shared expert or
    query projection: so must ours (plan and import-routing read no weights to notice)."""
    import transformers

    from specfit.calibrate.standin import SHAPE_CONFIGS

    raw = {k: v for k, v in SHAPE_CONFIGS[shape].items() if k != key}
    ours = ModelConfig.from_dict(raw)
    cls = transformers.Qwen2MoeConfig if shape.startswith("qwen") else transformers.DeepseekV2Config
    theirs = cls(**{k: v for k, v in raw.items() if k != "architectures"})
    if key == "q_lora_rank":
        assert ours.mla.q_lora_rank == theirs.q_lora_rank == 1536
        # given as null, there is no query compression (DeepSeek-V2-Lite's config)
        assert ModelConfig.from_dict({**raw, key: None}).mla.q_lora_rank is None
    elif key == "n_shared_experts":
        assert ours.shared_expert_intermediate_size == theirs.moe_intermediate_size * theirs.n_shared_experts > 0
    else:
        assert ours.shared_expert_intermediate_size == theirs.shared_expert_intermediate_size > 0


def test_qwen2_moe_shared_expert_is_resident_and_only_routed_experts_are_offloaded(model_dirs):
    model = _ours(model_dirs("qwen2_moe-mlp_only_layers"), cache_experts=N_EXPERTS)
    c = model.config
    assert c.moe_layers == (0, 2) and c.shared_expert_gated and c.attention_bias
    host = model.offload.host
    assert host.n_layers == 2 and host.expert_bytes == c.expert_bytes(torch.float32)
    assert host.nbytes == 2 * N_EXPERTS * 3 * 32 * 64 * 4                    # routed experts only
    shared = model.layers[0].shared_expert
    assert shared.gate.weight.shape == (1, 64) and shared.gate_proj.weight.shape == (48, 64)
    assert model.layers[1].moe is None and model.layers[1].shared_expert is None
    assert model.layers[1].mlp.gate_proj.weight.shape == (80, 64)            # the dense layer's MLP
    assert c.shared_expert_bytes(torch.float32) == (3 * 48 * 64 + 64) * 4


# ----------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_float32(model_dirs, case):
    ids = _tokens()
    for hub_spelling in (False, True):
        model_dir = model_dirs(case, hub_spelling)
        with torch.no_grad():
            expected = load_reference(model_dir)(ids[None]).logits[0]
        out = _ours(model_dir)(ids, torch.arange(SEQ))
        assert (out.logits - expected).abs().max().item() <= 1e-5, f"hub spelling: {hub_spelling}"


# against a regression in config.py (a sliding_window key applied to every family): transformers' DeepSeek-V2,
# like its OLMoE, masks plainly causally whatever the key says
def test_a_deepseek_v2_sliding_window_key_is_ignored_like_transformers(tmp_path):
    model_dir = make_family_model("deepseek_v2", tmp_path, seed=3, sliding_window=4)
    assert json.loads((model_dir / "config.json").read_text())["sliding_window"] == 4
    ids = _tokens()
    with torch.no_grad():
        expected = load_reference(model_dir)(ids[None]).logits[0]
    assert (_ours(model_dir)(ids, torch.arange(SEQ)).logits - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("case", ["qwen2_moe-mlp_only_layers", "deepseek_v2-lite", "deepseek_v2-grouped"])
def test_bfloat16_matches_transformers_with_deepseeks_router_in_float32(model_dirs, case):
    model_dir = model_dirs(case)
    ids = _tokens()
    with torch.no_grad():
        expected = load_reference(model_dir, torch.bfloat16)(ids[None]).logits[0]
    model = _ours(model_dir, dtype="bfloat16")
    out = model(ids, torch.arange(SEQ))
    assert out.logits.dtype == torch.bfloat16 and torch.equal(out.logits.argmax(-1), expected.argmax(-1))
    torch.testing.assert_close(out.logits.float(), expected.float(), rtol=0, atol=0.05)
    router_dtype = model.moe_blocks()[0].gate.weight.dtype
    assert router_dtype == (torch.float32 if case.startswith("deepseek") else torch.bfloat16)


@pytest.mark.parametrize("case", ["qwen2_moe", "deepseek_v2-lite", "qwen3_moe-yarn", "mixtral-linear",
                                  "olmoe-dynamic"])
def test_a_calibration_stand_in_holds_each_weight_in_the_loaders_dtype(model_dirs, case):
    """The stand-in calibration times held DeepSeek's router in bfloat16 where the loader keeps it
    in float32: it timed another router than the model runs."""
    from specfit.calibrate.standin import random_model, standin_bytes

    model_dir = model_dirs(case)
    loaded = {name: t.dtype for name, t in load_model(model_dir, dtype="bfloat16").state_dict().items()}
    stand_in = random_model(ModelConfig.from_dir(model_dir), torch.device("cpu"), torch.bfloat16).state_dict()
    assert {name: t.dtype for name, t in stand_in.items()} == loaded
    assert standin_bytes(ModelConfig.from_dir(model_dir), torch.bfloat16)["dense"] == sum(
        t.numel() * t.element_size() for t in stand_in.values())


def test_bfloat16_mla_decode_steps_keep_the_expanded_form_and_match_transformers(model_dirs):
    """In float32 decode steps over a cached prompt absorb kv_b_proj (test above); in bfloat16 the
    absorbed form's rounding would differ from ``transformers``' by a few bfloat16 steps (enough
    to flip a near tie, as on these tokens), so bfloat16 keeps the expanded form: the same logits."""
    from specfit.runtime.model import causal_mask

    model_dir = model_dirs("deepseek_v2-lite")
    reference = load_reference(model_dir, torch.bfloat16)
    model = _ours(model_dir, dtype="bfloat16")
    assert not model.layers[0].self_attn._absorbs(1, 13)          # float32 weights would absorb
    ids = _tokens(20, seed=1)
    model(ids[:12], torch.arange(12), causal_mask(0, 12))
    for t in range(12, 20):
        ours = model(ids[t:t + 1], torch.tensor([t]), causal_mask(t, 1)).logits[-1].float()
        with torch.no_grad():
            expected = reference(ids[None, :t + 1]).logits[0, -1].float()
        torch.testing.assert_close(ours, expected, rtol=0, atol=0)


def _reference_topk(logits: torch.Tensor, config: ModelConfig) -> list[set]:
    """Each token's experts, written from the routing rule: softmax, DeepSeek's group limit
    (a group scores its best expert, the topk_group best groups stay), top-k."""
    probs = torch.softmax(logits.double(), dim=-1)
    chosen = []
    for row in probs:
        if config.router == "group_limited_topk":
            size = config.n_experts // config.n_group
            group_best = [max(row[g * size:(g + 1) * size]) for g in range(config.n_group)]
            keep = sorted(range(config.n_group), key=lambda g: -group_best[g])[: config.topk_group]
            row = torch.tensor([p if e // size in keep else 0.0 for e, p in enumerate(row.tolist())])
        chosen.append(set(torch.argsort(row, descending=True)[: config.top_k].tolist()))
    return chosen


@pytest.mark.parametrize("case", ["qwen2_moe-mlp_only_layers", "qwen2_moe-sparse_step_2", "deepseek_v2-lite",
                                  "deepseek_v2-grouped"])
def test_routing_of_each_moe_layer_matches_transformers_router(model_dirs, case):
    model_dir = model_dirs(case)
    ids = _tokens()
    with torch.no_grad():
        reference = load_reference(model_dir)(ids[None], output_router_logits=True)
    model = _ours(model_dir)
    out = model(ids, torch.arange(SEQ))
    assert out.expert_ids.shape == (SEQ, model.config.n_moe_layers, TOP_K)
    assert len(reference.router_logits) == model.config.n_moe_layers       # transformers: MoE layers only
    for moe_layer, logits in enumerate(reference.router_logits):
        got = [set(row.tolist()) for row in out.expert_ids[:, moe_layer]]
        assert got == _reference_topk(logits.reshape(SEQ, -1), model.config), f"MoE layer {moe_layer}"


def _greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens through the KV cache, one pass per token, and each pass's misses per MoE layer."""
    model.setup_kv_cache(len(prompt) + new_tokens + 1)
    out = model(prompt, torch.arange(len(prompt)), logits_rows=[-1])
    tokens, misses = [int(out.logits[-1].argmax())], [out.offload.misses.copy()]
    for position in range(len(prompt), len(prompt) + new_tokens - 1):
        out = model([tokens[-1]], [position])
        tokens.append(int(out.logits[-1].argmax()))
        misses.append(out.offload.misses.copy())
    return tokens, misses


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_output_equals_generate_and_counters_are_per_moe_layer(model_dirs, case):
    model_dir = model_dirs(case)
    reference = load_reference(model_dir)
    model = load_model(model_dir, cache_experts=N_EXPERTS)       # every expert resident after its first use
    for prompt in ([5], _tokens(7, seed=2).tolist()):
        want = reference.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):]
        model.offload.reset()
        tokens, misses = _greedy(model, prompt, 16)
        assert tokens == want.tolist()
        per_layer = np.stack(misses)
        assert per_layer.shape[1] == model.config.n_moe_layers
        # an expert is missed once, the first time it is used: at most E per MoE layer
        assert (per_layer.sum(axis=0) <= N_EXPERTS).all() and (per_layer.sum(axis=0) >= TOP_K).all()


def test_counters_count_the_union_of_routed_experts_per_moe_layer(model_dirs):
    model = _ours(model_dirs("deepseek_v2-lite"), cache_experts=N_EXPERTS)
    out = model(_tokens(), torch.arange(SEQ))
    union = [np.unique(out.expert_ids[:, layer]).size for layer in range(model.config.n_moe_layers)]
    assert out.offload.misses.tolist() == union and out.offload.hits.tolist() == [0, 0]
    again = model(_tokens(3, seed=5), torch.arange(SEQ, SEQ + 3))
    fresh = [np.setdiff1d(again.expert_ids[:, layer], out.expert_ids[:, layer]).size for layer in range(2)]
    assert again.offload.misses.tolist() == fresh
    assert (again.offload.hits + again.offload.misses).tolist() == [np.unique(again.expert_ids[:, i]).size
                                                                   for i in range(2)]
    bytes_per_expert = model.offload.host.expert_bytes
    assert again.offload.bytes_h2d.tolist() == [n * bytes_per_expert for n in fresh]


def test_mla_absorbed_attention_equals_the_expanded_form_and_is_chosen_for_few_queries(model_dirs, monkeypatch):
    """A tree pass over a cached prompt: the absorbed form (kv_b_proj folded into the queries and
    the output) gives the expanded form's logits, and which one a pass takes follows the arithmetic
    (few queries over many latents absorb; a prompt expands)."""
    from specfit.runtime.mla import MLAttention
    from specfit.runtime.model import causal_mask

    model = _ours(model_dirs("deepseek_v2-lite"), cache_experts=N_EXPERTS)
    attention = model.layers[0].self_attn
    assert isinstance(attention, MLAttention)
    ids = _tokens(24, seed=4)
    tree_parents = [-1, 0, 0, 1, 1, 2]                      # a root, two children, three grandchildren
    depth = [0, 1, 1, 2, 2, 2]
    mask = torch.zeros(6, 6, dtype=torch.bool)
    for v, p in enumerate(tree_parents):
        mask[v, v] = True
        while p >= 0:
            mask[v, p] = True
            p = tree_parents[p]
    full = torch.cat((torch.ones(6, 18, dtype=torch.bool), mask), dim=1)
    logits = {}
    for absorbs in (True, False):
        model.setup_kv_cache(64)
        # the tree's pass in the form under test; the prompt's (T == S) expanded in both
        monkeypatch.setattr(MLAttention, "_absorbs", lambda self, T, S, a=absorbs: a if T == 6 else False)
        model(ids[:18], torch.arange(18), causal_mask(0, 18))
        logits[absorbs] = model(ids[18:], torch.tensor([18 + d for d in depth]), full).logits
        monkeypatch.undo()
    torch.testing.assert_close(logits[True], logits[False], rtol=0, atol=1e-5)
    # DeepSeek-V2-Lite's shapes: kv_lora_rank 512, 128 + 64 query dims, 128 value dims
    from types import SimpleNamespace

    lite = SimpleNamespace(mla=SimpleNamespace(kv_lora_rank=512, qk_nope_head_dim=128, v_head_dim=128,
                                               qk_rope_head_dim=64, qk_head_dim=192),
                           kv_b_proj=SimpleNamespace(weight=torch.zeros(1)))
    assert MLAttention._absorbs(lite, 1, 10) and MLAttention._absorbs(lite, 64, 2048)
    assert not MLAttention._absorbs(lite, 2048, 2048) and not MLAttention._absorbs(lite, 300, 4096)
    lite.kv_b_proj.weight = torch.zeros(1, dtype=torch.bfloat16)          # 16-bit weights: expanded
    assert not MLAttention._absorbs(lite, 1, 10)


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("change,message", [
    ({"topk_method": "noaux_tc"}, "'topk_method' must be 'greedy' or 'group_limited_greedy'"),
    ({"norm_topk_prob": True}, "'norm_topk_prob' is true"),
    ({"scoring_func": "sigmoid"}, "'scoring_func' must be 'softmax'"),
    ({"moe_layer_freq": 2}, "'moe_layer_freq' must be 1"),
    # against a regression in config.py (accepted, then the loader's unread-tensor error named a bias, not the key)
    ({"mlp_bias": True}, "'mlp_bias' is true"),
    ({"moe_layer_freq": "1"}, "'moe_layer_freq' must be 1, got '1'"),
    ({"first_k_dense_replace": "1"}, "'first_k_dense_replace' must be an integer, got '1'"),
    ({"first_k_dense_replace": -1}, "'first_k_dense_replace' must be a non-negative integer, got -1"),
    ({"num_key_value_heads": 2}, "num_key_value_heads == num_attention_heads"),
    ({"topk_method": "group_limited_greedy", "n_group": 3, "topk_group": 2}, "'n_group' \\(3\\)"),
])
def test_unsupported_deepseek_variants_are_one_error(tmp_path, model_dirs, change, message):
    raw = json.loads((model_dirs("deepseek_v2-lite", True) / "config.json").read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**raw, **change}))
    with pytest.raises(SpecFitError, match=message) as info:
        ModelConfig.from_file(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_qwen2_moe_sliding_window_is_refused(tmp_path, model_dirs):
    raw = json.loads((model_dirs("qwen2_moe") / "config.json").read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**raw, "use_sliding_window": True, "sliding_window": 8}))
    with pytest.raises(SpecFitError, match="'use_sliding_window' is true"):
        ModelConfig.from_file(path)


# ----------------------------------------------------------------------------- specfit decode
runner = CliRunner()
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6]]
NEW_TOKENS = 10


@pytest.mark.parametrize("case,overrides", [("qwen2_moe", {}), ("deepseek_v2-lite", {"first_k_dense_replace": 0})],
                         ids=["qwen2_moe", "deepseek_v2-all-moe"])
def test_specfit_decode_runs_the_family_lossless_against_generate(tmp_path, monkeypatch, case, overrides):
    monkeypatch.chdir(tmp_path)       # the quick calibration's profile goes to ./calibrate
    family, base = CASES[case]
    model_dir = make_family_model(family, tmp_path / "model", seed=7, hub_spelling=True, **{**base, **overrides})
    drafter_dir = make_drafter(model_dir, tmp_path / "drafter", fit_prompts=PROMPTS, new_tokens=NEW_TOKENS)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    result = runner.invoke(app, ["decode", "--model", str(model_dir), "--drafter", str(drafter_dir), "--prompts",
                                 str(prompts), "--cache-experts", "3", "--device", "cpu", "--max-new-tokens",
                                 str(NEW_TOKENS), "--ignore-eos", "--policies", "ar,eagle3:8:3", "--profile", "pcie4",
                                 "--json"])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.stdout.splitlines()]
    reference = load_reference(model_dir)
    for record in records:
        prompt = PROMPTS[record["index"]]
        want = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):]
        assert record["output_ids"] == want.tolist(), record["policy"]
    assert {r["policy"] for r in records} == {"ar", "eagle3:8:3"}


def test_specfit_decode_runs_a_model_with_dense_layers(tmp_path, monkeypatch):
    from specfit.runtime.decode_job import DecodePlan, run_decode

    monkeypatch.chdir(tmp_path)
    model_dir = make_family_model("deepseek_v2", tmp_path / "model", seed=7)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": PROMPTS[0]}) + "\n")
    # ar+usage: the cache advisor learns each pass's union, one row per MoE layer (the dense first
    # layer has none; sizing it by every layer broke it)
    run = run_decode(DecodePlan(model_dir=model_dir, prompts_path=prompts, cache_experts=3, policies=["ar", "ar+usage"],
                                profile="pcie4", max_new_tokens=NEW_TOKENS, device="cpu", ignore_eos=True))
    want = load_reference(model_dir).generate(torch.tensor([PROMPTS[0]]), max_new_tokens=NEW_TOKENS, do_sample=False)
    assert [r["output_ids"] for r in run.records] == [want[0, len(PROMPTS[0]):].tolist()] * 2


def _deepseek_router(**overrides):
    """transformers' DeepSeek-V2 router with random weights and the same config as ours."""
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    kwargs = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                  n_routed_experts=8, moe_intermediate_size=16, n_shared_experts=0, intermediate_size=80,
                  first_k_dense_replace=0, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
                  v_head_dim=16, max_position_embeddings=256, routed_scaling_factor=1.0)
    kwargs.update(overrides)
    reference_config = DeepseekV2Config(**kwargs)
    router = DeepseekV2TopkRouter(reference_config)
    with torch.no_grad():
        router.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(0))
    raw = reference_config.to_dict() | {"architectures": ["DeepseekV2ForCausalLM"]}
    return router, ModelConfig.from_dict(raw)


# against a regression in routers.py (topk_group + 1 groups kept): the family fixture's grouped case has
# top_k (2) <= topk_group (2), where the group limit can never change the top-k
@pytest.mark.parametrize("n_group,topk_group,top_k", [(2, 1, 3), (4, 2, 3)])
def test_group_limited_routing_keeps_only_the_best_groups_like_transformers(n_group, topk_group, top_k):
    router, config = _deepseek_router(topk_method="group_limited_greedy", n_group=n_group, topk_group=topk_group,
                                      num_experts_per_tok=top_k, routed_scaling_factor=2.5)
    assert config.router == "group_limited_topk" and (config.n_group, config.topk_group) == (n_group, topk_group)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    _, want_weights, want_ids = router(x)
    weights, ids = route(x, router.weight, config)
    # transformers' top-k is unsorted: compare each token's (expert, weight) pairs by expert id
    order, want_order = ids.argsort(dim=-1), want_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    assert torch.equal(weights.gather(1, order), want_weights.gather(1, want_order))
    # and the limit matters here: routing over every group picks other experts for some tokens
    _, free_ids = torch.topk(torch.softmax(x @ router.weight.T, -1), top_k, dim=-1)
    assert not torch.equal(free_ids.sort(-1).values, ids.sort(-1).values)
