"""Load a target model from a Hugging Face model directory (safetensors only).

Dense weights go to the compute device; experts go to :class:`~specfit.runtime.offload.HostExperts`
in host memory, each expert once. Accepted layouts:

- single ``model.safetensors`` or sharded ``model.safetensors.index.json``;
- experts per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``; Mixtral
  ``block_sparse_moe.experts.{e}.{w1,w3,w2}.weight``) or fused (``mlp.experts.gate_up_proj``
  [E, 2I, H] with rows [:I] the gate, and ``mlp.experts.down_proj`` [E, H, I]), under either
  ``mlp`` or ``block_sparse_moe``; only MoE layers have them;
- dense MLP layers ``mlp.{gate,up,down}_proj.weight``; shared experts ``mlp.shared_expert.*`` with
  ``mlp.shared_expert_gate.weight`` [1, H] (Qwen2-MoE) or ``mlp.shared_experts.*`` (DeepSeek-V2);
  q/k/v biases (Qwen2-MoE); DeepSeek-V2's MLA projections (``q_proj`` or ``q_a_proj`` /
  ``q_a_layernorm`` / ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``).

Every tensor is checked against the shape the config implies; a missing or mis-shaped tensor is
one error naming the tensor, its expected shape and the file.

Drafters load here too (:func:`load_drafter`): an EAGLE-3 head (:mod:`specfit.runtime.eagle3`) or
an independent small draft model of a supported MoE architecture (:mod:`specfit.runtime.draft_model`),
told apart by their ``config.json``, checked against the target before their weights are read.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import SpecFitError
from ..io import json_text, optional_file, read_json_object
from .config import DTYPES, SUPPORTED_ARCHITECTURES, ModelConfig, check_unquantized
from .draft_model import ModelDrafter
from .eagle3 import EAGLE3_ARCHITECTURE, SPECULATORS_ARCHITECTURE, Eagle3Config, Eagle3Drafter
from .model import MoETransformer, weight_dtype
from .offload import ExpertOffload, HostExperts

__all__ = ["Checkpoint", "load_model", "load_tokenizer", "checkpoint_bytes", "load_drafter", "drafter_capture_layers",
           "is_eagle3", "check_drafter", "load_router"]

_MOE_PREFIXES = ("mlp", "block_sparse_moe")
# tensors a checkpoint may hold that are no weights (buffers saved by older exports)
_NOT_WEIGHTS = (".rotary_emb.inv_freq",)
# per-expert names of (gate, up, down)
_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


class Checkpoint:
    """The safetensors files of a model directory, read tensor by tensor."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        single = self.model_dir / "model.safetensors"
        index = self.model_dir / "model.safetensors.index.json"
        if optional_file(index, "the shard index of a sharded checkpoint"):
            weight_map = read_json_object(index, "the shard index of a sharded checkpoint").get("weight_map")
            if not (isinstance(weight_map, dict) and all(isinstance(f, str) and f for f in weight_map.values())):
                raise SpecFitError(f"{index}: key 'weight_map' must be an object of tensor name -> shard file name, "
                                   f"got {json_text(weight_map)}")
            self.files = {name: self.model_dir / file for name, file in weight_map.items()}
            for path in set(self.files.values()):
                if not path.is_file():
                    raise SpecFitError(f"{index}: shard {path.name} is listed but missing from {self.model_dir}")
        elif optional_file(single, "a safetensors checkpoint"):
            self._handles = {}
            self.files = {name: single for name in self._handle(single).keys()}
        else:
            raise SpecFitError(f"{self.model_dir}: no model.safetensors or model.safetensors.index.json "
                               f"(only safetensors checkpoints are supported)")
        self._handles = {}
        self.read: set[str] = set()          # the tensors :meth:`get` has handed out

    @property
    def nbytes(self) -> int:
        """Bytes of the checkpoint files on disk."""
        return sum(path.stat().st_size for path in set(self.files.values()))

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The tensor ``name``, checked to have ``shape``, converted to ``dtype`` (on the CPU)."""
        expected = list(shape)
        if name not in self.files:
            raise SpecFitError(f"{self.model_dir}: missing tensor {name!r} (expected shape {expected})")
        handle = self._handle(self.files[name])
        try:
            actual = list(handle.get_slice(name).get_shape())
        except Exception as exc:  # a header that names the tensor but a file that lost it
            raise SpecFitError(f"{self.files[name]}: tensor {name!r} cannot be read ({exc})") from None
        if actual != expected:
            raise SpecFitError(f"{self.files[name]}: tensor {name!r} has shape {actual}, expected {expected}")
        stored = handle.get_slice(name).get_dtype()
        # 8-bit floats are quantized weights (their scales stored apart): read plainly they would be wrong
        if dtype.is_floating_point and stored not in ("F32", "F16", "BF16", "F64"):
            raise SpecFitError(f"{self.files[name]}: tensor {name!r} is stored as {stored}, expected floating-point "
                               f"weights (F32, F16, BF16 or F64)")
        try:
            tensor = handle.get_tensor(name)
        except Exception as exc:  # truncated or overwritten data after a valid header
            raise SpecFitError(f"{self.files[name]}: tensor {name!r} cannot be read; the file is damaged ({exc})") from None
        self.read.add(name)
        return tensor.to(dtype)

    def check_all_read(self, what: str) -> None:
        """One error when the checkpoint holds a tensor no :meth:`get` asked for: weights of a
        module the config does not describe (shared experts under an architecture without them,
        an extra layer) would otherwise be dropped, and the model computed without them. Buffers
        older exports saved beside the weights (RoPE's ``inv_freq``) are not weights."""
        unread = sorted(name for name in self.files if name not in self.read and not name.endswith(_NOT_WEIGHTS))
        if unread:
            more = f" (and {len(unread) - 1} more)" if len(unread) > 1 else ""
            raise SpecFitError(f"{self.files[unread[0]]}: tensor {unread[0]!r}{more} is no weight of {what}; expected "
                               "only the tensors its config.json describes (a checkpoint of another architecture, or "
                               "a config.json whose layers, shared experts or tied embeddings differ from the weights)")

    def close(self) -> None:
        self._handles.clear()

    def _handle(self, path: Path):
        if path not in self._handles:
            try:
                self._handles[path] = safe_open(path, framework="pt")
            except Exception as exc:  # safetensors raises its own error types for corrupt headers
                raise SpecFitError(f"{path}: not a readable safetensors file ({exc})") from None
        return self._handles[path]


def checkpoint_bytes(model_dir: str | Path) -> int:
    return Checkpoint(model_dir).nbytes


def load_model(model_dir: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None,
               cache_experts: int = 0, cache_mode: str = "per_layer", eviction: str = "lru",
               capture_layers: tuple[int, ...] | None = None) -> MoETransformer:
    """Build the target from ``model_dir``: dense weights on ``device``, experts in host memory
    (pinned when ``device`` is a GPU) behind an expert cache of ``cache_experts`` slots per layer.

    ``dtype`` is the compute dtype (a name from :data:`~specfit.runtime.config.DTYPES` or a torch
    dtype); by default the checkpoint's, or float32 if the config does not say.
    """
    model_dir = Path(model_dir)
    config = ModelConfig.from_dir(model_dir)
    check_unquantized(config, model_dir / "config.json")
    dtype = _resolve_dtype(dtype, config)
    device = torch.device(device)
    checkpoint = Checkpoint(model_dir)
    try:
        dense = _dense_state_dict(checkpoint, config, dtype, device)
        host = HostExperts(config.n_moe_layers, config.n_experts, config.hidden_size, config.expert_intermediate_size,
                           dtype, pin_memory=device.type == "cuda")
        for layer in config.moe_layers:
            _load_layer_experts(checkpoint, config, layer, host)
            checkpoint.close()   # unmap the files: pages read so far would otherwise stay resident
        checkpoint.check_all_read(f"a {config.architecture} model of {config.n_layers} layers")
    finally:
        checkpoint.close()

    with torch.device("meta"):
        model = MoETransformer(config, capture_layers=capture_layers)
    model.load_state_dict(dense, strict=True, assign=True)
    model.requires_grad_(False).eval()
    model.init_rope()
    model.attach_offload(ExpertOffload(host, cache_experts, device=device, mode=cache_mode, policy=eviction))
    model.source = str(model_dir)          # what an error found while decoding names
    return model


def load_tokenizer(model_dir: str | Path):
    """The directory's ``tokenizer.json`` as a :class:`tokenizers.Tokenizer`, or None if absent."""
    path = Path(model_dir) / "tokenizer.json"
    if not optional_file(path, "a tokenizer file"):
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed files
        raise SpecFitError(f"{path}: not a readable tokenizer file ({exc})") from None


# ----------------------------------------------------------------- drafters
def is_eagle3(drafter_dir: str | Path) -> bool:
    """An EAGLE-3 head (its config names ``LlamaForCausalLMEagle3``, or vLLM speculators'
    ``Eagle3Speculator``) or an independent draft model (a supported MoE architecture)."""
    path = Path(drafter_dir) / "config.json"
    raw = read_json_object(path, "an EAGLE-3 head or a draft model's config.json")
    architectures = raw.get("architectures") or []
    if isinstance(architectures, str):
        architectures = [architectures]
    if not (isinstance(architectures, list) and all(isinstance(a, str) for a in architectures)):
        raise SpecFitError(f"{path}: key 'architectures' must be a list of class names, got {json_text(architectures)}")
    if EAGLE3_ARCHITECTURE in architectures or SPECULATORS_ARCHITECTURE in architectures:
        return True
    if isinstance(raw, dict) and raw.get("speculators_model_type") is not None:
        return True
    if any(a in SUPPORTED_ARCHITECTURES for a in architectures):
        return False
    raise SpecFitError(f"{path}: key 'architectures' is {architectures}; expected {EAGLE3_ARCHITECTURE}, "
                       f"{SPECULATORS_ARCHITECTURE} or a draft model of {', '.join(SUPPORTED_ARCHITECTURES)}")


def drafter_capture_layers(drafter_dir: str | Path, target: ModelConfig) -> tuple[int, ...] | None:
    """The target layers whose inputs the drafter in ``drafter_dir`` reads (None: a draft model,
    which reads none, or an EAGLE-3 head with the default layers), checked against ``target``."""
    if not is_eagle3(drafter_dir):
        return None
    config = Eagle3Config.from_file(Path(drafter_dir) / "config.json")
    try:
        config.check_target(target.vocab_size, target.hidden_size, source="target model")
    except SpecFitError as exc:         # named by the drafter's file, whose keys the message quotes
        raise SpecFitError(f"{Path(drafter_dir) / 'config.json'}: {str(exc).removeprefix('drafter: ')}") from None
    aux = config.aux_hidden_state_layer_ids
    # input of layer n_layers = the last layer's output (vLLM's id L)
    if aux is not None and not all(0 <= layer <= target.n_layers for layer in aux):
        raise SpecFitError(f"{Path(drafter_dir) / 'config.json'}: key '{config.aux_layers_key}' is "
                           f"{list(config.aux_layers_in_file)} (inputs of layers {list(aux)}), but the target has "
                           f"{target.n_layers} layers")
    return aux


def load_drafter(drafter_dir: str | Path, model: MoETransformer):
    """An EAGLE-3 head or an independent draft model from ``drafter_dir``, on ``model``'s device
    and dtype, checked against it (load the target with :func:`drafter_capture_layers`)."""
    drafter_capture_layers(drafter_dir, model.config)
    if not is_eagle3(drafter_dir):
        config = ModelConfig.from_dir(drafter_dir)
        # a draft model's experts are few and read every level: all resident, never offloaded
        drafter = ModelDrafter(load_model(drafter_dir, device=model.device, dtype=model.dtype,
                                          cache_experts=config.n_experts, capture_layers=()))
    else:
        config = Eagle3Config.from_file(Path(drafter_dir) / "config.json")
        # the target's embedding / lm_head stand in for tensors a checkpoint omits, which only
        # works when the drafter is as wide as the target; a wider or narrower drafter carries its own
        shared = config.hidden_size == model.config.hidden_size
        drafter = Eagle3Drafter.from_pretrained(drafter_dir, target_embed=model.embed_tokens.weight if shared else None,
                                                target_lm_head=model.lm_head.weight if shared else None,
                                                device=model.device, dtype=model.dtype)
    check_drafter(model, drafter, source=str(drafter_dir))
    drafter.source = str(drafter_dir)
    return drafter


def check_drafter(model: MoETransformer, drafter, source: str = "drafter") -> None:
    """One clear error when ``drafter`` was not made for ``model`` (vocabulary, hidden size,
    feature layers)."""
    drafter.check_target(model.config.vocab_size, model.config.hidden_size, source="target model")
    aux = drafter.config.aux_hidden_state_layer_ids
    if aux is not None and tuple(aux) != tuple(model.capture_layers):
        raise SpecFitError(f"{source}: config key 'eagle_aux_hidden_state_layer_ids' is {list(aux)}, but the target "
                           f"captures the inputs of layers {list(model.capture_layers)}; load the target with the "
                           f"drafter's feature layers")


# ----------------------------------------------------------------- helpers
def _resolve_dtype(dtype, config: ModelConfig) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype or config.checkpoint_dtype or "float32"
    if name not in DTYPES:
        where = "--dtype" if dtype else "config.json: field 'torch_dtype'"
        raise SpecFitError(f"{where}: expected one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def _dense_state_dict(checkpoint: Checkpoint, config: ModelConfig, dtype, device) -> dict[str, torch.Tensor]:
    """Everything but the routed experts, under :class:`MoETransformer`'s parameter names."""
    H, V, E = config.hidden_size, config.vocab_size, config.n_experts
    shapes = {"embed_tokens.weight": ("model.embed_tokens.weight", (V, H)),
              "norm.weight": ("model.norm.weight", (H,))}
    if not config.tie_word_embeddings or "lm_head.weight" in checkpoint:
        shapes["lm_head.weight"] = ("lm_head.weight", (V, H))
    for layer in range(config.n_layers):
        ours, theirs = f"layers.{layer}.", f"model.layers.{layer}."
        attn = _mla_shapes(config) if config.mla is not None else _attention_shapes(config)
        for name, shape in attn.items():
            shapes[f"{ours}self_attn.{name}"] = (f"{theirs}self_attn.{name}", shape)
        for name in ("input_layernorm", "post_attention_layernorm"):
            shapes[f"{ours}{name}.weight"] = (f"{theirs}{name}.weight", (H,))
        if config.moe_index(layer) is None:
            I = config.dense_intermediate_size
            for name, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                shapes[f"{ours}mlp.{name}.weight"] = (f"{theirs}mlp.{name}.weight", shape)
            continue
        prefix = f"{theirs}{_moe_prefix(checkpoint, layer)}"
        shapes[f"{ours}moe.gate.weight"] = (f"{prefix}.gate.weight", (E, H))
        if config.shared_expert_intermediate_size:
            I = config.shared_expert_intermediate_size
            stored = "shared_expert" if config.shared_expert_gated else "shared_experts"   # Qwen2-MoE / DeepSeek
            for name, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                shapes[f"{ours}shared_expert.{name}.weight"] = (f"{prefix}.{stored}.{name}.weight", shape)
            if config.shared_expert_gated:
                shapes[f"{ours}shared_expert.gate.weight"] = (f"{prefix}.shared_expert_gate.weight", (1, H))
    # copy=True: a tensor read from a safetensors file can share the file's memory map, which
    # would keep every page read from that file resident for the model's lifetime
    dense = {ours: checkpoint.get(theirs, shape, weight_dtype(ours, config, dtype)).to(device, copy=True)
             for ours, (theirs, shape) in shapes.items()}
    if "lm_head.weight" not in dense:
        dense["lm_head.weight"] = dense["embed_tokens.weight"]   # tied: one tensor, two uses
    return dense


def load_router(model_dir: str | Path, context_weight: float = 0.5):
    """The :class:`~specfit.experts.router.RouterPredictor` of the target in ``model_dir``, reading
    only its embedding, norms and routers (for a replay, where the model is not loaded)."""
    from ..experts.router import RouterPredictor

    config = ModelConfig.from_dir(model_dir)
    check_unquantized(config, Path(model_dir) / "config.json")
    checkpoint = Checkpoint(model_dir)
    H, E = config.hidden_size, config.n_experts
    try:
        embed = checkpoint.get("model.embed_tokens.weight", (config.vocab_size, H), torch.float32)
        weights = [checkpoint.get(f"model.layers.{layer}.{_moe_prefix(checkpoint, layer)}.gate.weight", (E, H), torch.float32)
                   * checkpoint.get(f"model.layers.{layer}.post_attention_layernorm.weight", (H,), torch.float32)
                   for layer in config.moe_layers]
    finally:
        checkpoint.close()
    return RouterPredictor(context_weight=context_weight, embed=embed, router_weight=torch.stack(weights),
                           top_k=config.top_k)


def _attention_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    H, hd = config.hidden_size, config.head_dim
    q_width, kv_width = config.n_heads * hd, config.n_kv_heads * hd
    shapes = {"q_proj.weight": (q_width, H), "k_proj.weight": (kv_width, H), "v_proj.weight": (kv_width, H),
              "o_proj.weight": (H, q_width)}
    if config.attention_bias:
        shapes.update({"q_proj.bias": (q_width,), "k_proj.bias": (kv_width,), "v_proj.bias": (kv_width,)})
    if config.qk_norm == "per_head":
        shapes.update({"q_norm.weight": (hd,), "k_norm.weight": (hd,)})
    elif config.qk_norm == "full":
        shapes.update({"q_norm.weight": (q_width,), "k_norm.weight": ((H // config.n_heads) * config.n_kv_heads,)})
    return shapes


def _mla_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    mla, H, heads = config.mla, config.hidden_size, config.n_heads
    shapes = {"kv_a_proj_with_mqa.weight": (mla.kv_lora_rank + mla.qk_rope_head_dim, H),
              "kv_a_layernorm.weight": (mla.kv_lora_rank,),
              "kv_b_proj.weight": (heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),
              "o_proj.weight": (H, heads * mla.v_head_dim)}
    if mla.q_lora_rank is None:
        shapes["q_proj.weight"] = (heads * mla.qk_head_dim, H)
    else:
        shapes.update({"q_a_proj.weight": (mla.q_lora_rank, H), "q_a_layernorm.weight": (mla.q_lora_rank,),
                       "q_b_proj.weight": (heads * mla.qk_head_dim, mla.q_lora_rank)})
    return shapes


def _moe_prefix(checkpoint: Checkpoint, layer: int) -> str:
    for prefix in _MOE_PREFIXES:
        if f"model.layers.{layer}.{prefix}.gate.weight" in checkpoint:
            return prefix
    return _MOE_PREFIXES[0]   # Checkpoint.get then reports the missing router under the usual name


def _load_layer_experts(checkpoint: Checkpoint, config: ModelConfig, layer: int, host: HostExperts) -> None:
    """The routed experts of decoder layer ``layer`` into ``host`` (indexed by MoE layer)."""
    E, H, I = config.n_experts, config.hidden_size, config.expert_intermediate_size
    base = f"model.layers.{layer}.{_moe_prefix(checkpoint, layer)}.experts"
    dtype = host.dtype
    index = config.moe_index(layer)
    if f"{base}.gate_up_proj" in checkpoint:
        host.gate_up[index].copy_(checkpoint.get(f"{base}.gate_up_proj", (E, 2 * I, H), dtype))
        host.down[index].copy_(checkpoint.get(f"{base}.down_proj", (E, H, I), dtype))
        return
    gate, up, down = next((names for names in _EXPERT_NAMES if f"{base}.0.{names[0]}.weight" in checkpoint),
                          _EXPERT_NAMES[0])
    for expert in range(E):
        prefix = f"{base}.{expert}"
        # copy tensor by tensor so host memory stays near one copy of the experts
        host.gate_up[index][expert, :I].copy_(checkpoint.get(f"{prefix}.{gate}.weight", (I, H), dtype))
        host.gate_up[index][expert, I:].copy_(checkpoint.get(f"{prefix}.{up}.weight", (I, H), dtype))
        host.down[index][expert].copy_(checkpoint.get(f"{prefix}.{down}.weight", (H, I), dtype))
