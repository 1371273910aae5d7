"""The target model's shape, read once from a Hugging Face ``config.json``.

One :class:`ModelConfig` serves every supported family; the places where the families differ
(q/k normalisation, attention biases, where the expert width lives, how the router picks and
weighs experts, shared experts, dense MLP layers between MoE layers, MLA attention) are fields of
the config, so the forward pass has no family branches beyond reading them.

Layers: ``n_layers`` counts decoder layers (``num_hidden_layers``); ``moe_layers`` lists the ones
with routed experts (Qwen2/Qwen3-MoE: not in ``mlp_only_layers`` and ``(i + 1) %
decoder_sparse_step == 0``; DeepSeek-V2: ``i >= first_k_dense_replace``), the others run a dense
MLP. Everything about experts — the expert ids of a pass, the host experts, the expert cache, its
counters, traces and the cost model — is indexed by MoE layer (0 .. ``n_moe_layers`` - 1), so a
dense layer costs nothing there; a shared expert is a dense, always-resident weight too.

Both spellings of the keys are accepted: the hub's / ``transformers`` 4.x (``num_experts``,
``rope_theta`` + ``rope_scaling``, ``torch_dtype``) and what ``transformers`` 5.x writes
(``num_local_experts``, ``rope_parameters: {rope_theta, rope_type, ...}``, ``dtype``); RoPE
scaling variants are read by :mod:`specfit.runtime.rope`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..errors import SpecFitError
from ..io import config_value, json_text, not_readable_as, optional_file, read_json_object
from .rope import RopeSpec, parse_rope

__all__ = ["ModelConfig", "MLAShape", "SUPPORTED_ARCHITECTURES", "DTYPES", "default_capture_layers", "layer_order", "norm_eps"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_LAYERS = 32768       # decoder layers a config may have (a damaged count is refused before any list of them)


@dataclass(frozen=True)
class _Family:
    model_type: str
    qk_norm: str | None            # "per_head" (Qwen3), "full" (OLMoE: over the whole projection) or None
    expert_width_keys: tuple        # where the expert's intermediate size is stored
    always_renormalise: bool        # Mixtral renormalises the top-k weights whatever the config says
    routing_weights_float32: bool   # Mixtral / DeepSeek multiply expert outputs by float32 weights
    expert_count_keys: tuple = ("num_local_experts", "num_experts")
    dense_layers: str | None = None  # "sparse_step" (Qwen), "first_k" (DeepSeek) or None (all MoE)
    shared_expert: str | None = None  # "gated" (Qwen2-MoE) or "plain" (DeepSeek) or None
    # without 'num_key_value_heads' in the config: transformers' class default (None: one KV head
    # per query head)
    kv_heads_default: int | None = None


_FAMILIES = {
    "Qwen3MoeForCausalLM": _Family("qwen3_moe", "per_head", ("moe_intermediate_size",), False, False,
                                   dense_layers="sparse_step", kv_heads_default=4),
    "OlmoeForCausalLM": _Family("olmoe", "full", ("intermediate_size",), False, False),
    "MixtralForCausalLM": _Family("mixtral", None, ("intermediate_size",), True, True, kv_heads_default=8),
    "Qwen2MoeForCausalLM": _Family("qwen2_moe", None, ("moe_intermediate_size",), False, False,
                                   dense_layers="sparse_step", shared_expert="gated", kv_heads_default=16),
    "DeepseekV2ForCausalLM": _Family("deepseek_v2", None, ("moe_intermediate_size",), False, True,
                                     expert_count_keys=("n_routed_experts", "num_local_experts", "num_experts"),
                                     dense_layers="first_k", shared_expert="plain"),
}
_BY_MODEL_TYPE = {family.model_type: arch for arch, family in _FAMILIES.items()}
SUPPORTED_ARCHITECTURES = tuple(_FAMILIES)

_REQUIRED = object()


def default_capture_layers(n_layers: int) -> tuple[int, ...]:
    """EAGLE-3's feature layers: the inputs of decoder layers 2, L/2 and L-3, clipped to the
    layers a tiny model has (so a 2-layer test model still yields three H-wide features), in
    :func:`layer_order`."""
    return layer_order(tuple(min(max(layer, 0), n_layers - 1) for layer in (2, n_layers // 2, n_layers - 3)))


def layer_order(ids: tuple[int, ...]) -> tuple[int, ...]:
    """Feature layers in the order the features are concatenated: vLLM and SGLang capture them in
    their loop over the layers, whatever order a drafter's config names them in. Ids with a repeat,
    which they cannot load (each layer is captured once) and only the clipped default of a model
    of a few layers has, keep the order they were built with."""
    return tuple(sorted(ids)) if len(set(ids)) == len(ids) else tuple(ids)


@dataclass(frozen=True)
class MLAShape:
    """DeepSeek-V2's multi-head latent attention: queries through an optional low-rank
    ``q_lora_rank``, keys and values from a shared ``kv_lora_rank`` latent plus a
    ``qk_rope_head_dim`` rotary key shared by all heads."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelConfig:
    """The shape and numerics of one MoE checkpoint.

    ``eos_token_ids`` are the ids that end generation; :meth:`from_dir` takes them from
    ``generation_config.json`` when present, as ``transformers``' ``generate`` does.
    """

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    n_layers: int                   # decoder layers
    n_heads: int
    n_kv_heads: int
    head_dim: int                   # the rotary width (MLA: qk_rope_head_dim)
    n_experts: int                  # routed experts per MoE layer
    top_k: int
    expert_intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    norm_topk_prob: bool
    qk_norm: str | None
    routing_weights_float32: bool
    tie_word_embeddings: bool = False
    clip_qkv: float | None = None
    sliding_window: int | None = None
    checkpoint_dtype: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe_layers: tuple[int, ...] | None = None      # decoder layers with routed experts (None: all)
    dense_intermediate_size: int | None = None     # width of the dense MLP layers
    shared_expert_intermediate_size: int = 0       # 0: no shared expert
    shared_expert_gated: bool = False              # Qwen2-MoE: sigmoid(shared_expert_gate(x)) * shared(x)
    attention_bias: bool = False                   # biases on q/k/v (Qwen2-MoE)
    router: str = "softmax_topk"                   # or "group_limited_topk" (DeepSeek)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    router_float32: bool = False                   # DeepSeek keeps the router weight and logits in float32
    rope: RopeSpec | None = None                   # None: default RoPE with rope_theta
    mla: MLAShape | None = None
    quantization: str | None = None                # quantization_config's quant_method: weights no loader reads

    def __post_init__(self):
        if self.moe_layers is None:
            object.__setattr__(self, "moe_layers", tuple(range(self.n_layers)))
        if self.rope is None:
            object.__setattr__(self, "rope", RopeSpec(theta=self.rope_theta))

    # ------------------------------------------------------------- derived sizes
    @property
    def n_moe_layers(self) -> int:
        """Layers with routed experts: the layer axis of expert ids, caches, counters and traces."""
        return len(self.moe_layers)

    def moe_index(self, layer: int) -> int | None:
        """The MoE-layer index of decoder layer ``layer`` (None for a dense layer)."""
        try:
            return self.moe_layers.index(layer)
        except ValueError:
            return None

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert: gate and up [I, H], down [H, I]."""
        return 3 * self.expert_intermediate_size * self.hidden_size

    def expert_bytes(self, dtype: torch.dtype) -> int:
        return self.expert_params * torch.empty((), dtype=dtype).element_size()

    def shared_expert_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one MoE layer's shared expert(s): resident with the dense weights, never cached."""
        params = 3 * self.shared_expert_intermediate_size * self.hidden_size
        params += self.hidden_size if self.shared_expert_gated else 0
        return params * torch.empty((), dtype=dtype).element_size()

    # ------------------------------------------------------------- construction
    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        """Read ``config.json`` (and the EOS ids of ``generation_config.json``) from a model directory."""
        model_dir = Path(model_dir)
        config = cls.from_file(model_dir / "config.json")
        generation_path = model_dir / "generation_config.json"
        if optional_file(generation_path, "a generation_config.json"):
            generation = read_json_object(generation_path)
            if generation.get("eos_token_id") is not None:
                eos = _eos_ids(generation["eos_token_id"], generation_path, config.vocab_size)
                config = replace(config, eos_token_ids=eos)
        return config

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if not path.is_file():
            raise SpecFitError(f"{path}: " + not_readable_as(path, "a Hugging Face config.json",
                                                             "no such file; expected a Hugging Face config.json"))
        return cls.from_dict(read_json_object(path), source=str(path))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        architecture = _architecture(raw, source)
        family = _FAMILIES[architecture]
        quantization = raw.get("quantization_config")
        if quantization is not None:
            # kept: a loader refuses the weights (read plainly, without their scales); the shape is
            # all a routing import or a plan needs
            method = quantization.get("quant_method") if isinstance(quantization, dict) else None
            quantization = str(method or "no quant_method")

        def get(*keys, default=_REQUIRED, kind=int):
            for key in keys:
                value = raw.get(key)
                if value is not None:
                    return config_value(value, key, source, kind)
            if default is _REQUIRED:
                spelled = " or ".join(repr(k) for k in keys)
                raise SpecFitError(f"{source}: missing key {spelled} ({architecture})")
            return default

        hidden_size = get("hidden_size")
        n_layers = get("num_hidden_layers")
        n_heads = get("num_attention_heads")
        n_kv_heads = get("num_key_value_heads", default=family.kv_heads_default or n_heads)
        if raw.get("hidden_act", "silu") != "silu":
            raise SpecFitError(f"{source}: key 'hidden_act' must be 'silu', got {raw['hidden_act']!r}")
        if family.model_type == "deepseek_v2" and raw.get("mlp_bias"):
            # transformers' DeepSeek-V2 then has biases on its dense and shared-expert MLPs
            raise SpecFitError(f"{source}: key 'mlp_bias' is true; DeepSeek-V2 MLPs without biases only")
        n_experts = get(*family.expert_count_keys)
        top_k = get("num_experts_per_tok")
        def at_least_one(*pairs) -> None:
            for name, value in pairs:
                if value < 1:
                    raise SpecFitError(f"{source}: key {name!r} must be at least 1, got {value}")

        at_least_one(("hidden_size", hidden_size), ("num_hidden_layers", n_layers), ("num_attention_heads", n_heads),
                     ("num_key_value_heads", n_kv_heads), (family.expert_count_keys[0], n_experts),
                     ("num_experts_per_tok", top_k))
        if n_layers > MAX_LAYERS:
            # models have tens of layers; the layer lists below would take minutes and gigabytes first
            raise SpecFitError(f"{source}: key 'num_hidden_layers' must be at most {MAX_LAYERS}, got {n_layers}")
        if n_heads % n_kv_heads:
            given = "" if raw.get("num_key_value_heads") is not None else (
                f", the default of {architecture}'s transformers config class where the key is missing: add the key")
            raise SpecFitError(f"{source}: num_attention_heads ({n_heads}) must be a multiple of num_key_value_heads "
                               f"({n_kv_heads}{given})")
        if top_k > n_experts:
            raise SpecFitError(f"{source}: key 'num_experts_per_tok' is {top_k}, more than the {n_experts} experts "
                               f"per layer ({' / '.join(family.expert_count_keys)})")
        max_positions = get("max_position_embeddings")
        mla = _mla_shape(source, raw, get, n_heads, n_kv_heads) if family.model_type == "deepseek_v2" else None
        head_dim = mla.qk_rope_head_dim if mla else get("head_dim", default=hidden_size // n_heads)
        vocab_size = get("vocab_size")
        expert_width = get(*family.expert_width_keys)
        # sizes a later step takes as they are: a vocabulary the eos check, a context the prompt check,
        # widths the host buffers allocated before any expert is read
        at_least_one(("vocab_size", vocab_size), ("max_position_embeddings", max_positions), ("head_dim", head_dim),
                     (family.expert_width_keys[0], expert_width))
        rms_norm_eps = norm_eps(get("rms_norm_eps", kind=float), source)
        moe_layers = _moe_layers(raw, source, family, n_layers, n_experts)
        dense_width = get("intermediate_size") if len(moe_layers) < n_layers else None
        shared = _shared_expert_width(family, raw, get, source)
        if dense_width is not None:
            at_least_one(("intermediate_size", dense_width))
        routing = _routing(raw, source, family, get, n_experts)

        sliding_window = get("sliding_window", default=None)
        if family.model_type in ("olmoe", "deepseek_v2"):
            sliding_window = None  # transformers' OLMoE and DeepSeek-V2 mask plainly causally whatever the key says
        elif family.model_type in ("qwen3_moe", "qwen2_moe") and not raw.get("use_sliding_window", False):
            sliding_window = None  # Qwen ignores the window unless use_sliding_window is set
        elif family.model_type == "qwen2_moe" and sliding_window:
            raise SpecFitError(f"{source}: key 'use_sliding_window' is true; Qwen2-MoE's per-layer sliding "
                               f"windows are not supported")
        if sliding_window == 0:
            sliding_window = None
        return cls(
            architecture=architecture,
            model_type=family.model_type,
            quantization=quantization,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            n_experts=n_experts,
            top_k=top_k,
            expert_intermediate_size=expert_width,
            rms_norm_eps=rms_norm_eps,
            rope_theta=0.0,      # filled from the RoPE spec below
            max_position_embeddings=max_positions,
            norm_topk_prob=family.always_renormalise or get("norm_topk_prob", default=False, kind=bool),
            qk_norm=family.qk_norm,
            routing_weights_float32=family.routing_weights_float32,
            tie_word_embeddings=get("tie_word_embeddings", default=False, kind=bool),
            clip_qkv=get("clip_qkv", default=None, kind=float),
            sliding_window=sliding_window,
            checkpoint_dtype=_dtype_name(raw, source),
            eos_token_ids=_eos_ids(raw.get("eos_token_id"), source, vocab_size),
            moe_layers=moe_layers,
            dense_intermediate_size=dense_width,
            shared_expert_intermediate_size=shared,
            shared_expert_gated=family.shared_expert == "gated",
            attention_bias=_attention_bias(raw, source, family),
            mla=mla,
            **routing,
        )._with_rope(parse_rope(raw, source, max_positions))

    def _with_rope(self, rope: RopeSpec) -> "ModelConfig":
        return replace(self, rope=rope, rope_theta=rope.theta)


# ----------------------------------------------------------------- helpers
def check_unquantized(config: ModelConfig, source) -> None:
    """Refuse to read the weights of a quantized checkpoint (its weights would be read as plain
    floats without their scales), before any is read."""
    if config.quantization is not None:
        raise SpecFitError(f"{source}: key 'quantization_config' ({config.quantization}): quantized checkpoints are not "
                           f"supported; expected float32, float16 or bfloat16 weights (a checkpoint without "
                           f"quantization_config)")


def norm_eps(value: float, source: str) -> float:
    """A config's ``rms_norm_eps``: below 0 every norm is NaN, infinite every norm 0 (an output
    that is silently no model's)."""
    if not (math.isfinite(value) and value >= 0):
        raise SpecFitError(f"{source}: key 'rms_norm_eps' must be a finite number >= 0, got {value}")
    return value


def _architecture(raw: dict, source: str) -> str:
    names = raw.get("architectures") or []
    if isinstance(names, str):
        names = [names]
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise SpecFitError(f"{source}: key 'architectures' must be a list of class names, got {json_text(names)}")
    if not isinstance(raw.get("model_type", ""), str):
        raise SpecFitError(f"{source}: key 'model_type' must be a string, got {json_text(raw['model_type'])}")
    for name in names:
        if name in _FAMILIES:
            return name
    if not names and raw.get("model_type") in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[raw["model_type"]]
    found = ", ".join(map(str, names)) or f"model_type {raw.get('model_type')!r}"
    raise SpecFitError(
        f"{source}: unsupported architecture ({found}); key 'architectures' must name one of "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _moe_layers(raw: dict, source: str, family: _Family, n_layers: int, n_experts: int) -> tuple[int, ...]:
    """The decoder layers with routed experts, as ``transformers`` decides them per family."""
    if n_experts <= 0:
        raise SpecFitError(f"{source}: the model has no routed experts (expert count {n_experts}); "
                           f"SpecFit needs an MoE model")
    if family.dense_layers == "sparse_step":
        mlp_only = raw.get("mlp_only_layers") or []
        if not isinstance(mlp_only, list) or not all(isinstance(i, int) and 0 <= i < n_layers for i in mlp_only):
            raise SpecFitError(f"{source}: key 'mlp_only_layers' must be a list of layer indices in [0, {n_layers}), "
                               f"got {mlp_only!r}")
        step = raw.get("decoder_sparse_step", 1) or 1
        if not isinstance(step, int) or step < 1:
            raise SpecFitError(f"{source}: key 'decoder_sparse_step' must be a positive integer, got {step!r}")
        layers = tuple(i for i in range(n_layers) if i not in mlp_only and (i + 1) % step == 0)
    elif family.dense_layers == "first_k":
        first_k = config_value(raw.get("first_k_dense_replace", 0) or 0, "first_k_dense_replace", source)
        if first_k < 0:
            raise SpecFitError(f"{source}: key 'first_k_dense_replace' must be a non-negative integer, got {first_k}")
        if raw.get("moe_layer_freq", 1) not in (None, 1):
            # the original DeepSeek code also skips layers by moe_layer_freq; transformers ignores it
            raise SpecFitError(f"{source}: key 'moe_layer_freq' must be 1, got {json_text(raw['moe_layer_freq'])}")
        layers = tuple(range(first_k, n_layers))
    else:
        for key, neutral in (("mlp_only_layers", []), ("decoder_sparse_step", 1), ("first_k_dense_replace", 0)):
            if raw.get(key) not in (None, neutral):
                raise SpecFitError(f"{source}: key {key!r} is {raw[key]!r}; {family.model_type} has no dense layers")
        layers = tuple(range(n_layers))
    if not layers:
        raise SpecFitError(f"{source}: no decoder layer has routed experts (keys 'mlp_only_layers', "
                           f"'decoder_sparse_step', 'first_k_dense_replace')")
    return layers


def _absent_as(raw: dict, key: str, default, get):
    """``key``'s value, or transformers' class default where the config leaves the key out (a
    key given as null stays None)."""
    return default if key not in raw else get(key, default=None)


def _shared_expert_width(family: _Family, raw: dict, get, source: str) -> int:
    # a config without the key gets transformers' class default, as the model it builds would
    if family.shared_expert is None:
        return 0
    key, default = (("shared_expert_intermediate_size", 5632) if family.shared_expert == "gated"
                    else ("n_shared_experts", 2))
    # null: none (DeepSeek's own code for n_shared_experts; transformers cannot build that model at all)
    value = _absent_as(raw, key, default, get) or 0
    if value < 0:
        raise SpecFitError(f"{source}: key {key!r} must be 0 (no shared expert) or more, got {value}")
    return value if family.shared_expert == "gated" else get("moe_intermediate_size") * value


def _routing(raw: dict, source: str, family: _Family, get, n_experts: int) -> dict:
    """How the router picks experts; DeepSeek-V2's greedy or group-limited top-k."""
    if family.model_type != "deepseek_v2":
        return {}
    scoring = raw.get("scoring_func", "softmax")
    if scoring != "softmax":
        raise SpecFitError(f"{source}: key 'scoring_func' must be 'softmax' for DeepSeek-V2, got {scoring!r}")
    if raw.get("norm_topk_prob"):
        # transformers' DeepSeek-V2 router ignores this flag: there is no reference to be lossless against
        raise SpecFitError(f"{source}: key 'norm_topk_prob' is true; transformers' DeepSeek-V2 router never "
                           f"renormalises, so only false is supported")
    method = raw.get("topk_method") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise SpecFitError(f"{source}: key 'topk_method' must be 'greedy' or 'group_limited_greedy', got {method!r}")
    routing = dict(router="softmax_topk", routed_scaling_factor=get("routed_scaling_factor", default=1.0, kind=float),
                   router_float32=True)
    if method == "group_limited_greedy":
        n_group, topk_group = get("n_group"), get("topk_group")
        if n_group < 1 or n_experts % n_group or not 1 <= topk_group <= n_group:
            raise SpecFitError(f"{source}: keys 'n_group' ({n_group}) and 'topk_group' ({topk_group}) must split "
                               f"the {n_experts} experts into equal groups and pick 1..n_group of them")
        routing.update(router="group_limited_topk", n_group=n_group, topk_group=topk_group)
    return routing


def _attention_bias(raw: dict, source: str, family: _Family) -> bool:
    if family.model_type == "qwen2_moe":
        return bool(raw.get("qkv_bias", True))   # 4.x configs have no key: the biases are always there
    if raw.get("attention_bias"):
        raise SpecFitError(f"{source}: key 'attention_bias' is true; attention biases are supported for "
                           f"Qwen2-MoE's q/k/v only")
    return False


def _mla_shape(source: str, raw: dict, get, n_heads: int, n_kv_heads: int) -> MLAShape:
    if n_kv_heads != n_heads:
        raise SpecFitError(f"{source}: DeepSeek-V2 attention needs num_key_value_heads == num_attention_heads "
                           f"({n_kv_heads} != {n_heads})")
    return MLAShape(q_lora_rank=_absent_as(raw, "q_lora_rank", 1536, get), kv_lora_rank=get("kv_lora_rank"),
                    qk_nope_head_dim=get("qk_nope_head_dim"), qk_rope_head_dim=get("qk_rope_head_dim"),
                    v_head_dim=get("v_head_dim"))


def _dtype_name(raw: dict, source: str) -> str | None:
    name = raw.get("dtype") or raw.get("torch_dtype")
    if name is None:
        return None
    name = str(name).removeprefix("torch.")
    if name not in DTYPES:
        raise SpecFitError(f"{source}: key 'dtype' must be one of {', '.join(DTYPES)}, got {name!r}")
    return name


def _eos_ids(value, source, vocab_size: int) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < vocab_size for v in values):
        raise SpecFitError(f"{source}: key 'eos_token_id' must be a token id or a list of token ids (integers in "
                           f"[0, vocab_size {vocab_size})), got {value!r}")
    return tuple(values)

