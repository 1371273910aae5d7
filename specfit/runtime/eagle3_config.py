"""An EAGLE-3 drafter's ``config.json``, in the layouts its trainers publish.

Two checkpoint layouts (one :class:`Eagle3Config` for both):

- **EAGLE-3 / SpecForge** (``architectures: ["LlamaForCausalLMEagle3"]``): a Llama-style config
  with ``num_hidden_layers: 1``, ``draft_vocab_size``, optional ``target_hidden_size`` and the
  feature layers either at the top level (``eagle_aux_hidden_state_layer_ids``) or nested
  (``eagle_config: {eagle_aux_hidden_state_layer_ids: [...]}``). The **EAGLE-3.1** variant adds
  ``"fc_norm": true`` (an RMSNorm per target feature before ``fc``, weights
  ``fc_norm.{0,1,2}.weight``) and ``"norm_output": true`` (the next draft level reads the
  normalised output ``norm(h)`` instead of ``h``, as SGLang serves it; logits are
  ``lm_head(norm(h))`` either way).
- **vLLM speculators** (``architectures: ["Eagle3Speculator"]``, ``speculators_model_type:
  "eagle3"``): the layer's Llama config under ``transformer_layer_config``, ``draft_vocab_size``,
  ``norm_before_residual`` (the attention residual is ``hidden_norm(h)`` instead of ``h``),
  ``norm_before_fc`` (an RMSNorm over the concatenated 3·H features, ``input_norm.weight``),
  ``target_hidden_size``, the verifier under ``speculators_config.verifier`` and the feature
  layers at the top level; weights under ``layers.0.``.

Feature-layer conventions (what the file says decides which one applies):

- vLLM (and SpecFit's own export) write ids into the target's hidden-state list: id ``j`` is the
  *input* of decoder layer ``j`` (the output of layer ``j - 1``), 0 is the embeddings and ``L``
  the last layer's output; that is the top-level ``eagle_aux_hidden_state_layer_ids``.
- SpecForge / SGLang trainers write "the output of layer ``j``" (SGLang captures the input of layer
  ``j + 1``); that is the nested ``eagle_config.eagle_aux_hidden_state_layer_ids``.

:attr:`Eagle3Config.aux_hidden_state_layer_ids` is always in the first convention (the layers
whose inputs the target captures), in layer order as vLLM and SGLang concatenate the features
(:func:`~specfit.runtime.config.layer_order`: three different ids sorted; a repeat, in the clipped
default of a model of a few layers, keeps its order); :meth:`Eagle3Config.describe_feature_layers` states both.
Without ids the EAGLE-3 default applies: inputs of layers 2, L/2 and L-3.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SpecFitError
from .config import config_value, default_capture_layers, layer_order, norm_eps
from .rope import RopeSpec, parse_rope

__all__ = ["Eagle3Config", "EAGLE3_ARCHITECTURE", "SPECULATORS_ARCHITECTURE", "DRAFTER_DTYPES"]

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
DRAFTER_DTYPES = ("float32", "bfloat16", "float16")
NESTED_KEY = "eagle_config.eagle_aux_hidden_state_layer_ids"
TOP_KEY = "eagle_aux_hidden_state_layer_ids"


@dataclass(frozen=True)
class Eagle3Config:
    """The drafter's shape, read from / written to its ``config.json``."""

    hidden_size: int
    target_hidden_size: int
    vocab_size: int                  # the target's vocabulary
    draft_vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    aux_hidden_state_layer_ids: tuple[int, ...] | None = None   # target layers whose inputs are the features
    dtype: str = "float32"
    fc_norm: bool = False                # EAGLE-3.1: RMSNorm per target feature before fc
    norm_output: bool = False            # EAGLE-3.1: the next level reads norm(h)
    norm_before_residual: bool = False   # speculators: residual = hidden_norm(h)
    norm_before_fc: bool = False         # speculators: RMSNorm over the 3·H features before fc
    rope: RopeSpec | None = None         # None: default RoPE with rope_theta
    # where it came from (not part of equality: two files describing the same drafter are equal)
    checkpoint_format: str = field(default="eagle3", compare=False)   # "eagle3" or "speculators"
    aux_layers_key: str | None = field(default=None, compare=False)   # the ids' key (None: the default)
    aux_layers_in_file: tuple[int, ...] | None = field(default=None, compare=False)   # the ids as written

    def __post_init__(self):
        if self.rope is None:
            object.__setattr__(self, "rope", RopeSpec(theta=self.rope_theta))

    def check_target(self, vocab_size: int, hidden_size: int, source: str = "target") -> None:
        """One clear error if this drafter was not built for a target of this shape (checked
        before any weight is read)."""
        if hidden_size != self.target_hidden_size:
            raise SpecFitError(f"drafter: fc.weight expects 3 x target_hidden_size = 3 x {self.target_hidden_size} "
                               f"features, but the {source} has hidden_size {hidden_size}")
        if vocab_size != self.vocab_size:
            raise SpecFitError(f"drafter: config key 'vocab_size' is {self.vocab_size}, but the {source} has "
                               f"vocab_size {vocab_size}")

    # ------------------------------------------------------------------ feature layers
    def feature_layers(self, n_target_layers: int) -> tuple[int, ...]:
        """The decoder layers whose inputs feed the drafter (``n_target_layers``: the output of
        the last layer)."""
        if self.aux_hidden_state_layer_ids is not None:
            return tuple(self.aux_hidden_state_layer_ids)
        return default_capture_layers(n_target_layers)

    def describe_feature_layers(self, n_target_layers: int) -> str:
        """Which target layers feed the drafter, in both conventions and with the file's key."""
        layers = self.feature_layers(n_target_layers)

        def output_of(j: int) -> str:
            return "embeddings" if j == 0 else str(j - 1)

        text = (f"inputs of target layers {list(layers)} (outputs of layers "
                f"[{', '.join(output_of(j) for j in layers)}], of {n_target_layers})")
        if self.aux_layers_key is None:
            return text + "; EAGLE-3 default: the config names none"
        convention = ("SpecForge/SGLang convention, id j = output of layer j" if self.aux_layers_key == NESTED_KEY
                      else "vLLM convention, id j = input of layer j, 0 = embeddings")
        return text + f"; {self.aux_layers_key} = {list(self.aux_layers_in_file)} ({convention})"

    # ------------------------------------------------------------------ reading
    @classmethod
    def from_file(cls, path: str | Path) -> "Eagle3Config":
        from ..io import read_json_object

        return cls.from_dict(read_json_object(path, "the drafter's config.json"), source=str(path))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "Eagle3Config":
        if is_speculators(raw):
            return _from_speculators(raw, source)
        return _from_llama_layout(raw, raw, source, checkpoint_format="eagle3")

    def to_dict(self) -> dict:
        """The EAGLE-3 (``LlamaForCausalLMEagle3``) layout, feature layers at the top level."""
        raw = {
            "architectures": [EAGLE3_ARCHITECTURE],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "hidden_size": self.hidden_size,
            "target_hidden_size": self.target_hidden_size,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "tie_word_embeddings": False,
            "torch_dtype": self.dtype,
        }
        if self.rope.rope_type != "default":
            raw["rope_scaling"] = _rope_block(self.rope)
        for flag in ("fc_norm", "norm_output", "norm_before_residual", "norm_before_fc"):
            if getattr(self, flag):
                raw[flag] = True
        if self.aux_hidden_state_layer_ids is not None:
            raw[TOP_KEY] = list(self.aux_hidden_state_layer_ids)
        return raw


def is_speculators(raw: dict) -> bool:
    """vLLM speculators' layout: ``Eagle3Speculator`` or a ``speculators_model_type``."""
    architectures = raw.get("architectures") or []
    named = isinstance(architectures, list) and SPECULATORS_ARCHITECTURE in architectures
    return named or architectures == SPECULATORS_ARCHITECTURE or raw.get("speculators_model_type") is not None


# ----------------------------------------------------------------- parsing
def _from_speculators(raw: dict, source: str) -> Eagle3Config:
    kind = raw.get("speculators_model_type", "eagle3")
    if kind != "eagle3":
        raise SpecFitError(f"{source}: key 'speculators_model_type' is {kind!r}; only 'eagle3' speculators are supported")
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise SpecFitError(f"{source}: missing key 'transformer_layer_config' (the draft layer's config object)")
    if layer.get("model_type", "llama") != "llama":
        raise SpecFitError(f"{source}: key 'transformer_layer_config.model_type' is {layer.get('model_type')!r}; "
                           f"only Llama-style draft layers are supported")
    speculators = raw.get("speculators_config")
    if speculators is not None and not isinstance(speculators, dict):
        raise SpecFitError(f"{source}: key 'speculators_config' must be an object")
    algorithm = (speculators or {}).get("algorithm", "eagle3")
    if algorithm != "eagle3":
        raise SpecFitError(f"{source}: key 'speculators_config.algorithm' is {algorithm!r}; expected 'eagle3'")
    # the draft layer's shape is the nested config; the drafter-level keys are at the top
    merged = {**layer, **{key: raw[key] for key in ("draft_vocab_size", "target_hidden_size", "norm_before_residual",
                                                     "norm_before_fc", TOP_KEY, "torch_dtype", "dtype")
                          if raw.get(key) is not None}}
    return _from_llama_layout(merged, raw, f"{source} (transformer_layer_config)", checkpoint_format="speculators")


def _from_llama_layout(raw: dict, top: dict, source: str, checkpoint_format: str) -> Eagle3Config:
    def get(key, kind=int, default=None):
        value = raw.get(key, default)
        if value is None:
            raise SpecFitError(f"{source}: missing key {key!r} (EAGLE-3 drafter config)")
        value = config_value(value, key, source, kind)
        if kind is int and value < 1:
            raise SpecFitError(f"{source}: key {key!r} must be at least 1, got {value}")
        return value

    n_layers = get("num_hidden_layers", default=1)
    if n_layers != 1:
        raise SpecFitError(f"{source}: key 'num_hidden_layers' must be 1 for an EAGLE-3 drafter, got {n_layers}")
    if raw.get("hidden_act", "silu") != "silu":
        raise SpecFitError(f"{source}: key 'hidden_act' must be 'silu', got {raw['hidden_act']!r}")
    if raw.get("attention_bias"):
        raise SpecFitError(f"{source}: key 'attention_bias' is true; EAGLE-3 draft layers without biases only")
    hidden_size = get("hidden_size")
    n_heads = get("num_attention_heads")
    n_kv_heads = get("num_key_value_heads", default=n_heads)
    if n_heads % n_kv_heads:
        raise SpecFitError(f"{source}: num_attention_heads ({n_heads}) must be a multiple of "
                           f"num_key_value_heads ({n_kv_heads})")
    dtype = str(raw.get("dtype") or raw.get("torch_dtype") or "float32").removeprefix("torch.")
    if dtype not in DRAFTER_DTYPES:
        raise SpecFitError(f"{source}: key 'dtype' must be one of {', '.join(DRAFTER_DTYPES)}, got {dtype!r}")
    max_positions = get("max_position_embeddings", default=4096)
    rope = parse_rope(raw, source, max_positions, default_theta=10000.0)
    if rope.rope_type == "dynamic":
        # dynamic NTK depends on the pass length; a drafter's passes are tree levels of any length
        raise SpecFitError(f"{source}: key 'rope_scaling' has rope_type 'dynamic'; not supported for drafters")
    aux, key, in_file = _aux_layers(top, source)
    vocab_size = get("vocab_size")
    return Eagle3Config(
        hidden_size=hidden_size,
        target_hidden_size=get("target_hidden_size", default=hidden_size),
        vocab_size=vocab_size,
        draft_vocab_size=get("draft_vocab_size", default=vocab_size),
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        head_dim=get("head_dim", default=hidden_size // n_heads),
        intermediate_size=get("intermediate_size"),
        rms_norm_eps=norm_eps(get("rms_norm_eps", float, 1e-6), source),
        rope_theta=rope.theta,
        max_position_embeddings=max_positions,
        aux_hidden_state_layer_ids=aux,
        dtype=dtype,
        fc_norm=_flag(top, "fc_norm", source),
        norm_output=_flag(top, "norm_output", source),
        norm_before_residual=_flag(top, "norm_before_residual", source),
        norm_before_fc=_flag(top, "norm_before_fc", source),
        rope=rope,
        checkpoint_format=checkpoint_format,
        aux_layers_key=key,
        aux_layers_in_file=in_file,
    )


def _flag(raw: dict, key: str, source: str) -> bool:
    value = raw.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise SpecFitError(f"{source}: key {key!r} must be true or false, got {value!r}")
    return value


def _layer_ids(value, key: str, source: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) != 3 or not all(isinstance(v, int) and v >= 0 for v in value):
        raise SpecFitError(f"{source}: key {key!r} must be a list of three non-negative layer indices, got {value!r}")
    return tuple(value)


def _aux_layers(raw: dict, source: str):
    """(capture layers, key, ids as written): the top-level ids are inputs of layers (vLLM), the
    nested ``eagle_config`` ones outputs of layers (SpecForge / SGLang), so +1."""
    top = raw.get(TOP_KEY)
    nested_block = raw.get("eagle_config")
    if nested_block is not None and not isinstance(nested_block, dict):
        raise SpecFitError(f"{source}: key 'eagle_config' must be an object, got {nested_block!r}")
    nested = (nested_block or {}).get(TOP_KEY)
    top = _layer_ids(top, TOP_KEY, source) if top is not None else None
    nested = _layer_ids(nested, NESTED_KEY, source) if nested is not None else None
    if nested is not None:
        capture = layer_order(tuple(j + 1 for j in nested))
        if top is not None and layer_order(top) != capture:
            raise SpecFitError(f"{source}: keys {TOP_KEY!r} = {list(top)} (inputs of layers) and {NESTED_KEY!r} = "
                               f"{list(nested)} (outputs of layers) name different target layers")
        return capture, NESTED_KEY, nested
    if top is not None:
        return layer_order(top), TOP_KEY, top
    return None, None, None


def _rope_block(rope: RopeSpec) -> dict:
    block = {"rope_type": rope.rope_type, "factor": rope.factor}
    for name in ("original_max_position_embeddings", "mscale", "mscale_all_dim", "attention_factor"):
        if getattr(rope, name) is not None:
            block[name] = getattr(rope, name)
    if rope.rope_type == "yarn":
        block.update(beta_fast=rope.beta_fast, beta_slow=rope.beta_slow, truncate=rope.truncate)
    if rope.rope_type == "llama3":
        block.update(low_freq_factor=rope.low_freq_factor, high_freq_factor=rope.high_freq_factor)
    return block
