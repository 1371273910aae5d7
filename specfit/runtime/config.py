"""The target model's shape, read once from a Hugging Face ``config.json``.

One :class:`ModelConfig` serves every supported family; the few places where the families differ
(q/k normalisation, where the expert width lives, whether the top-k weights are renormalised, the
dtype of the routing weights) are fields of the config, so the forward pass has no family
branches beyond reading them.

Both spellings of the keys are accepted: the hub's (``num_experts``, ``rope_theta``,
``torch_dtype``) and what ``transformers`` 5.x writes (``num_local_experts``,
``rope_parameters: {rope_theta, rope_type}``, ``dtype``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..errors import SpecFitError

__all__ = ["ModelConfig", "SUPPORTED_ARCHITECTURES", "DTYPES", "default_capture_layers"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class _Family:
    model_type: str
    qk_norm: str | None            # "per_head" (Qwen3), "full" (OLMoE: over the whole projection) or None
    expert_width_keys: tuple        # where the expert's intermediate size is stored
    always_renormalise: bool        # Mixtral renormalises the top-k weights whatever the config says
    routing_weights_float32: bool   # Mixtral multiplies expert outputs by float32 weights


_FAMILIES = {
    "Qwen3MoeForCausalLM": _Family("qwen3_moe", "per_head", ("moe_intermediate_size",), False, False),
    "OlmoeForCausalLM": _Family("olmoe", "full", ("intermediate_size",), False, False),
    "MixtralForCausalLM": _Family("mixtral", None, ("intermediate_size",), True, True),
}
_BY_MODEL_TYPE = {family.model_type: arch for arch, family in _FAMILIES.items()}
SUPPORTED_ARCHITECTURES = tuple(_FAMILIES)

_REQUIRED = object()


def default_capture_layers(n_layers: int) -> tuple[int, ...]:
    """EAGLE-3's feature layers: the inputs of decoder layers 2, L/2 and L-3, clipped to the
    layers a tiny model has (so a 2-layer test model still yields three H-wide features)."""
    return tuple(min(max(layer, 0), n_layers - 1) for layer in (2, n_layers // 2, n_layers - 3))


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
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
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

    # ------------------------------------------------------------- derived sizes
    @property
    def kv_groups(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.n_heads // self.n_kv_heads

    @property
    def expert_params(self) -> int:
        """Parameters of one expert: gate and up [I, H], down [H, I]."""
        return 3 * self.expert_intermediate_size * self.hidden_size

    def expert_bytes(self, dtype: torch.dtype) -> int:
        return self.expert_params * torch.empty((), dtype=dtype).element_size()

    # ------------------------------------------------------------- construction
    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        """Read ``config.json`` (and the EOS ids of ``generation_config.json``) from a model directory."""
        model_dir = Path(model_dir)
        config = cls.from_file(model_dir / "config.json")
        generation_path = model_dir / "generation_config.json"
        if generation_path.is_file():
            generation = _read_json(generation_path)
            if generation.get("eos_token_id") is not None:
                eos = _eos_ids(generation["eos_token_id"], generation_path)
                config = replace(config, eos_token_ids=eos)
        return config

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if not path.is_file():
            raise SpecFitError(f"{path}: no such file; expected a Hugging Face config.json")
        return cls.from_dict(_read_json(path), source=str(path))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        architecture = _architecture(raw, source)
        family = _FAMILIES[architecture]

        def get(*keys, default=_REQUIRED, kind=int):
            for key in keys:
                if raw.get(key) is not None:
                    try:
                        return kind(raw[key])
                    except (TypeError, ValueError):
                        raise SpecFitError(f"{source}: key {key!r} must be {kind.__name__}, got {raw[key]!r}") from None
            if default is _REQUIRED:
                spelled = " or ".join(repr(k) for k in keys)
                raise SpecFitError(f"{source}: missing key {spelled} ({architecture})")
            return default

        hidden_size = get("hidden_size")
        n_heads = get("num_attention_heads")
        n_kv_heads = get("num_key_value_heads", default=n_heads)
        if n_heads % n_kv_heads:
            raise SpecFitError(f"{source}: num_attention_heads ({n_heads}) must be a multiple of num_key_value_heads ({n_kv_heads})")
        head_dim = get("head_dim", default=hidden_size // n_heads)
        if raw.get("hidden_act", "silu") != "silu":
            raise SpecFitError(f"{source}: key 'hidden_act' must be 'silu', got {raw['hidden_act']!r}")
        if raw.get("attention_bias"):
            raise SpecFitError(f"{source}: key 'attention_bias' is true; attention biases are not supported")
        _check_all_layers_moe(raw, source)

        sliding_window = get("sliding_window", default=None)
        if family.model_type == "qwen3_moe" and not raw.get("use_sliding_window", False):
            sliding_window = None  # Qwen3 ignores the window unless use_sliding_window is set
        return cls(
            architecture=architecture,
            model_type=family.model_type,
            vocab_size=get("vocab_size"),
            hidden_size=hidden_size,
            n_layers=get("num_hidden_layers"),
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            n_experts=get("num_local_experts", "num_experts"),
            top_k=get("num_experts_per_tok"),
            expert_intermediate_size=get(*family.expert_width_keys),
            rms_norm_eps=get("rms_norm_eps", kind=float),
            rope_theta=_rope_theta(raw, source),
            max_position_embeddings=get("max_position_embeddings"),
            norm_topk_prob=family.always_renormalise or get("norm_topk_prob", default=False, kind=bool),
            qk_norm=family.qk_norm,
            routing_weights_float32=family.routing_weights_float32,
            tie_word_embeddings=get("tie_word_embeddings", default=False, kind=bool),
            clip_qkv=get("clip_qkv", default=None, kind=float),
            sliding_window=sliding_window,
            checkpoint_dtype=_dtype_name(raw, source),
            eos_token_ids=_eos_ids(raw.get("eos_token_id"), source),
        )


# ----------------------------------------------------------------- helpers
def _read_json(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecFitError(f"{path}: not a readable JSON file ({exc})") from None
    if not isinstance(raw, dict):
        raise SpecFitError(f"{path}: expected a JSON object at the top level")
    return raw


def _architecture(raw: dict, source: str) -> str:
    names = raw.get("architectures") or []
    if isinstance(names, str):
        names = [names]
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


def _check_all_layers_moe(raw: dict, source: str) -> None:
    # Qwen3-MoE can interleave dense MLP layers; every released checkpoint is all-MoE and the
    # runtime's per-layer expert cache assumes it.
    if raw.get("mlp_only_layers"):
        raise SpecFitError(f"{source}: key 'mlp_only_layers' is not empty; dense MLP layers are not supported")
    if int(raw.get("decoder_sparse_step", 1) or 1) != 1:
        raise SpecFitError(f"{source}: key 'decoder_sparse_step' must be 1 (every layer MoE), got {raw['decoder_sparse_step']}")


def _rope_theta(raw: dict, source: str) -> float:
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    for key, block in (("rope_parameters", params), ("rope_scaling", scaling)):
        if isinstance(block, dict):
            rope_type = block.get("rope_type", block.get("type", "default"))
            if rope_type != "default":
                raise SpecFitError(f"{source}: key {key!r} has rope_type {rope_type!r}; only the default RoPE is supported")
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    if raw.get("rope_theta") is not None:
        return float(raw["rope_theta"])
    raise SpecFitError(f"{source}: missing key 'rope_theta' (or 'rope_parameters.rope_theta')")


def _dtype_name(raw: dict, source: str) -> str | None:
    name = raw.get("dtype") or raw.get("torch_dtype")
    if name is None:
        return None
    name = str(name).removeprefix("torch.")
    if name not in DTYPES:
        raise SpecFitError(f"{source}: key 'dtype' must be one of {', '.join(DTYPES)}, got {name!r}")
    return name


def _eos_ids(value, source) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, (list, tuple)) else [value]
    try:
        return tuple(int(v) for v in values)
    except (TypeError, ValueError):
        raise SpecFitError(f"{source}: key 'eos_token_id' must be an integer or a list of integers, got {value!r}") from None

