"""Reading an EAGLE-3 drafter's ``model.safetensors``: every tensor checked against the config,
the variants' norms, and the draft vocabulary (``d2t`` / ``t2d``) checked so that a lost mapping
is one clear error instead of silently collapsed acceptance (see :mod:`specfit.runtime.eagle3`)."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import SpecFitError
from .eagle3_config import Eagle3Config

__all__ = ["DrafterVocabularyWarning", "LAYER_PREFIXES", "read_safetensors", "checked_state_dict",
           "checked_vocabulary", "check_embedding"]

LAYER_PREFIXES = ("midlayer.", "layers.0.")
# weights are stored in one of these and converted to the drafter's dtype; an integer, bool or
# 8-bit float tensor (stored without its scale) would convert to other numbers
_WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# buffers older exports saved beside the weights, as the target loader allows (loader.py)
_NOT_WEIGHTS = (".rotary_emb.inv_freq",)


class DrafterVocabularyWarning(UserWarning):
    """A drafter's draft-vocabulary mapping looks lost: acceptance may collapse."""


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        with safe_open(path, framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise SpecFitError(f"{path}: not a readable safetensors file ({exc})") from None


def _expected_shapes(config: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Parameter name (layer under ``midlayer.``) -> shape."""
    H, I, hd, TH = config.hidden_size, config.intermediate_size, config.head_dim, config.target_hidden_size
    q_width, kv_width = config.num_attention_heads * hd, config.num_key_value_heads * hd
    shapes = {
        "fc.weight": (H, 3 * TH),
        "norm.weight": (H,),
        "lm_head.weight": (config.draft_vocab_size, H),
        "midlayer.self_attn.q_proj.weight": (q_width, 2 * H),
        "midlayer.self_attn.k_proj.weight": (kv_width, 2 * H),
        "midlayer.self_attn.v_proj.weight": (kv_width, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, q_width),
        "midlayer.mlp.gate_proj.weight": (I, H),
        "midlayer.mlp.up_proj.weight": (I, H),
        "midlayer.mlp.down_proj.weight": (H, I),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,),
    }
    if config.fc_norm:
        shapes.update({f"fc_norm.{i}.weight": (TH,) for i in range(3)})
    if config.norm_before_fc:
        shapes["input_norm.weight"] = (3 * TH,)
    return shapes


# tensors of a variant the config must announce: (tensor name prefix, config key)
_VARIANT_TENSORS = (("fc_norm.", "fc_norm"), ("input_norm.", "norm_before_fc"))


def checked_state_dict(tensors: dict[str, torch.Tensor], config: Eagle3Config, path: Path) -> dict[str, torch.Tensor]:
    """Checkpoint tensors under the module's names, each checked against the config's shape and
    stored as floating-point weights; a tensor the config does not describe is refused, as the
    target loader refuses one (the drafter would run without it)."""
    prefixes = [p for p in LAYER_PREFIXES if any(name.startswith(p) for name in tensors)]
    if len(prefixes) > 1:
        raise SpecFitError(f"{path}: has both {prefixes[0]}* and {prefixes[1]}* tensors; expected the drafter's one "
                           f"layer under one of them")
    prefix = prefixes[0] if prefixes else "midlayer."
    for tensor_prefix, key in _VARIANT_TENSORS:
        if not getattr(config, key) and any(name.startswith(tensor_prefix) for name in tensors):
            raise SpecFitError(f"{path}: has tensors {tensor_prefix}*, but config.json does not set \"{key}\": true; "
                               f"the drafter would run without them")
    optional = {"lm_head.weight"}
    state = {}
    for name, shape in _expected_shapes(config).items():
        stored = name.replace("midlayer.", prefix, 1)
        if stored not in tensors:
            if name in optional:
                continue
            raise SpecFitError(f"{path}: missing tensor {stored!r} (expected shape {list(shape)})")
        actual = tuple(tensors[stored].shape)
        if actual != shape:
            hint = ""
            if name == "fc.weight" and actual[:1] == shape[:1] and len(actual) == 2 and actual[1] % 3 == 0:
                hint = (f"; the features are 3 x the target's hidden size, so this drafter was built for a target "
                        f"with hidden size {actual[1] // 3}, not config's target_hidden_size {config.target_hidden_size}")
            raise SpecFitError(f"{path}: tensor {stored!r} has shape {list(actual)}, expected {list(shape)}{hint}")
        state[name] = _checked_weight(tensors, stored, path)
    if "embed_tokens.weight" in tensors:
        embed = tensors["embed_tokens.weight"]
        expected = (config.vocab_size, config.hidden_size)
        if tuple(embed.shape) != expected:
            raise SpecFitError(f"{path}: tensor 'embed_tokens.weight' has shape {list(embed.shape)}, expected {list(expected)}")
        state["embed_tokens.weight"] = _checked_weight(tensors, "embed_tokens.weight", path)
    known = {name.replace("midlayer.", prefix, 1) for name in state} | {"d2t", "t2d"}
    unexpected = sorted(name for name in tensors if name not in known and not name.endswith(_NOT_WEIGHTS))
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise SpecFitError(f"{path}: tensor {unexpected[0]!r}{more} is no weight of the EAGLE-3 drafter its config.json "
                           f"describes; expected only its one layer's, fc, norm, lm_head, embed_tokens, d2t and t2d")
    return state


def _checked_weight(tensors: dict[str, torch.Tensor], name: str, path: Path) -> torch.Tensor:
    tensor = tensors[name]
    if tensor.dtype not in _WEIGHT_DTYPES:
        raise SpecFitError(f"{path}: tensor {name!r} is stored as {str(tensor.dtype).removeprefix('torch.')}, "
                           f"expected floating-point weights (float32, float16, bfloat16 or float64)")
    return tensor


def checked_vocabulary(tensors: dict[str, torch.Tensor], config: Eagle3Config, path: Path) -> torch.Tensor:
    """The draft vocabulary's target ids: from ``d2t`` (offsets), checked against ``t2d`` when
    present (it is optional: vLLM and SGLang ignore it); an all-zero ``d2t`` of a reduced
    vocabulary only when ``t2d`` confirms it (see the module docstring)."""
    V, D = config.vocab_size, config.draft_vocab_size
    t2d = _checked_t2d(tensors, V, path)
    if "d2t" not in tensors:
        if D == V and (t2d is None or bool(t2d.all())):
            return torch.arange(V)   # a full-vocabulary drafter needs no mapping
        # t2d says which target tokens are drafted, not in which order lm_head scores them
        raise SpecFitError(f"{path}: missing tensor 'd2t' (int64 [{D}] offsets: target_id = i + d2t[i]); a drafter "
                           f"with a reduced vocabulary needs it ('t2d' alone does not give the order of lm_head's rows)")
    d2t = tensors["d2t"]
    if tuple(d2t.shape) != (D,) or d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise SpecFitError(f"{path}: tensor 'd2t' is {d2t.dtype} {list(d2t.shape)}, expected integer offsets of "
                           f"shape [{D}] (draft_vocab_size)")
    draft_ids = torch.arange(D) + d2t.long()
    outside = ((draft_ids < 0) | (draft_ids >= V)).nonzero()
    if outside.numel():
        i = int(outside[0])
        raise SpecFitError(f"{path}: tensor 'd2t' maps draft token {i} to target id {int(draft_ids[i])}, outside the "
                           f"target vocabulary [0, {V})")
    if draft_ids.unique().numel() != D:
        raise SpecFitError(f"{path}: tensor 'd2t' maps several draft tokens to the same target id")
    expected = torch.zeros(V, dtype=torch.bool)
    expected[draft_ids] = True
    if D < V and not bool(d2t.any()):
        if t2d is None or not torch.equal(t2d, expected):
            marked = "no 't2d'" if t2d is None else f"'t2d' marks {int(t2d.sum())} tokens"
            raise SpecFitError(f"{path}: tensor 'd2t' is all zeros ({marked}): every draft token would map to the "
                               f"target token with the same id, the state of a vocabulary mapping that was never "
                               f"filled in, and acceptance would collapse; re-export the drafter with its d2t/t2d")
        warnings.warn(f"{path}: tensor 'd2t' is all zeros: the draft vocabulary is target ids 0..{D - 1} ('t2d' "
                      f"agrees); if the drafter was trained with another mapping, acceptance will collapse",
                      DrafterVocabularyWarning, stacklevel=3)
    if t2d is not None and not torch.equal(t2d, expected):
        raise SpecFitError(f"{path}: tensors 't2d' and 'd2t' disagree on which target tokens are in the draft vocabulary")
    return draft_ids


def _checked_t2d(tensors: dict[str, torch.Tensor], V: int, path: Path) -> torch.Tensor | None:
    if "t2d" not in tensors:
        return None
    t2d = tensors["t2d"]
    if tuple(t2d.shape) != (V,):
        raise SpecFitError(f"{path}: tensor 't2d' has shape {list(t2d.shape)}, expected [{V}] (vocab_size)")
    return t2d.bool()


def check_embedding(config: Eagle3Config, weight: torch.Tensor, name: str) -> None:
    expected = (config.vocab_size, config.hidden_size)
    if tuple(weight.shape) != expected:
        raise SpecFitError(f"{name}: the target's matrix is {list(weight.shape)}, but the drafter expects "
                           f"[vocab_size, hidden_size] = {list(expected)}")
