"""The EAGLE-3 drafter, in its published checkpoint format.

An EAGLE-3 head is one Llama decoder layer that reads two streams per token: the embedding of the
token and a hidden state. For a committed token the hidden state is the target's own features —
the inputs of three target layers (low / mid / high, ``3 * H_target`` wide) fused by ``fc``; for a
draft token it is the drafter's previous output (``H`` wide), fed back. Attention runs over
``cat(input_layernorm(embed), hidden_norm(hidden))`` (2·H-wide q/k/v projections), the residual
carries the hidden stream only, and ``lm_head`` scores a reduced *draft vocabulary*, mapped back to
target ids by ``d2t`` (``target_id = i + d2t[i]``).

Checkpoint (a directory): Llama-style ``config.json`` (``num_hidden_layers: 1``,
``draft_vocab_size``, optional ``target_hidden_size``, explicit ``head_dim``, architectures
``LlamaForCausalLMEagle3``, and ``eagle_aux_hidden_state_layer_ids``: the target layers whose
inputs are the features) and ``model.safetensors`` holding ``fc.weight``, ``norm.weight``,
``lm_head.weight`` (some exports omit it: the target's head restricted to the draft vocabulary is
used), ``d2t``, ``t2d``, the layer under ``midlayer.`` or ``layers.0.`` and optionally
``embed_tokens.weight`` (else the target's embedding is used).

KV slots follow :mod:`specfit.runtime.model`: committed entries occupy slots
``0 .. cache_len-1``; a call writes its T new entries to the next T slots in input order, with
explicit RoPE positions and a boolean mask over (cache + new), so one call drafts a whole tree
level. The drafter's position for the entry pairing target feature ``g[i]`` with token
``x[i+1]`` is ``i``; a draft node at depth d below the root entry is at ``root position + d``.
After verification the decoder re-runs the accepted tokens with the target's features and
overwrites the slots of their draft entries, as EAGLE-3 does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ..errors import SpecFitError
from .drafting import DraftOutput
from .model import KVCache, RMSNorm, apply_rope, rope_inv_freq

__all__ = ["Eagle3Config", "Eagle3Drafter", "EAGLE3_ARCHITECTURE"]

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
_LAYER_PREFIXES = ("midlayer.", "layers.0.")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ----------------------------------------------------------------- config
@dataclass(frozen=True)
class Eagle3Config:
    """The drafter's shape, read from / written to a Llama-style ``config.json``."""

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

    @property
    def kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def check_target(self, vocab_size: int, hidden_size: int, source: str = "target") -> None:
        """One clear error if this drafter was not built for a target of this shape (checked
        before any weight is read)."""
        if hidden_size != self.target_hidden_size:
            raise SpecFitError(f"drafter: fc.weight expects 3 x target_hidden_size = 3 x {self.target_hidden_size} "
                               f"features, but the {source} has hidden_size {hidden_size}")
        if vocab_size != self.vocab_size:
            raise SpecFitError(f"drafter: config key 'vocab_size' is {self.vocab_size}, but the {source} has "
                               f"vocab_size {vocab_size}")

    @classmethod
    def from_file(cls, path: str | Path) -> "Eagle3Config":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise SpecFitError(f"{path}: no such file; expected the drafter's config.json") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SpecFitError(f"{path}: not a readable JSON file ({exc})") from None
        if not isinstance(raw, dict):
            raise SpecFitError(f"{path}: expected a JSON object at the top level")
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "Eagle3Config":
        def get(key, kind=int, default=None):
            value = raw.get(key, default)
            if value is None:
                raise SpecFitError(f"{source}: missing key {key!r} (EAGLE-3 drafter config)")
            try:
                return kind(value)
            except (TypeError, ValueError):
                raise SpecFitError(f"{source}: key {key!r} must be {kind.__name__}, got {value!r}") from None

        n_layers = get("num_hidden_layers", default=1)
        if n_layers != 1:
            raise SpecFitError(f"{source}: key 'num_hidden_layers' must be 1 for an EAGLE-3 drafter, got {n_layers}")
        if raw.get("hidden_act", "silu") != "silu":
            raise SpecFitError(f"{source}: key 'hidden_act' must be 'silu', got {raw['hidden_act']!r}")
        hidden_size = get("hidden_size")
        n_heads = get("num_attention_heads")
        n_kv_heads = get("num_key_value_heads", default=n_heads)
        if n_heads % n_kv_heads:
            raise SpecFitError(f"{source}: num_attention_heads ({n_heads}) must be a multiple of "
                               f"num_key_value_heads ({n_kv_heads})")
        vocab_size = get("vocab_size")
        dtype = str(raw.get("dtype") or raw.get("torch_dtype") or "float32").removeprefix("torch.")
        if dtype not in _DTYPES:
            raise SpecFitError(f"{source}: key 'dtype' must be one of {', '.join(_DTYPES)}, got {dtype!r}")
        return cls(
            hidden_size=hidden_size,
            target_hidden_size=get("target_hidden_size", default=hidden_size),
            vocab_size=vocab_size,
            draft_vocab_size=get("draft_vocab_size", default=vocab_size),
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv_heads,
            head_dim=get("head_dim", default=hidden_size // n_heads),
            intermediate_size=get("intermediate_size"),
            rms_norm_eps=get("rms_norm_eps", float, 1e-6),
            rope_theta=_rope_theta(raw, source),
            max_position_embeddings=get("max_position_embeddings", default=4096),
            aux_hidden_state_layer_ids=_aux_layers(raw, source),
            dtype=dtype,
        )

    def to_dict(self) -> dict:
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
        if self.aux_hidden_state_layer_ids is not None:
            raw["eagle_aux_hidden_state_layer_ids"] = list(self.aux_hidden_state_layer_ids)
        return raw


def _rope_theta(raw: dict, source: str) -> float:
    for key in ("rope_parameters", "rope_scaling"):
        block = raw.get(key)
        if isinstance(block, dict):
            rope_type = block.get("rope_type", block.get("type", "default"))
            if rope_type != "default":
                raise SpecFitError(f"{source}: key {key!r} has rope_type {rope_type!r}; only the default RoPE is supported")
            if block.get("rope_theta") is not None:
                return float(block["rope_theta"])
    return float(raw.get("rope_theta", 10000.0))


def _aux_layers(raw: dict, source: str) -> tuple[int, ...] | None:
    # top level (our export, vLLM's speculators) or nested in "eagle_config" (other exports)
    value = raw.get("eagle_aux_hidden_state_layer_ids")
    if value is None and isinstance(raw.get("eagle_config"), dict):
        value = raw["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != 3 or not all(isinstance(v, int) for v in value):
        raise SpecFitError(f"{source}: key 'eagle_aux_hidden_state_layer_ids' must be a list of three layer indices, "
                           f"got {value!r}")
    return tuple(value)


# ----------------------------------------------------------------- modules
class Attention(nn.Module):
    """Llama attention over the 2·H-wide (embedding, hidden) input; GQA, no q/k norm."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        H, hd = config.hidden_size, config.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.q_proj = nn.Linear(2 * H, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * H, self.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(2 * H, self.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, H, bias=False)
        self.scale = hd ** -0.5
        self.kv_cache: KVCache | None = None


class MLP(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    """The drafter's one decoder layer, split in three so training can unroll steps with its own
    attention pattern while inference goes through the KV cache: :meth:`project` (q, k, v with
    RoPE), :meth:`attend` (masked attention + o_proj), :meth:`finish` (residuals + MLP).
    Tensors may carry leading batch dimensions: ``[..., T, H]``."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, trainable=True)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, trainable=True)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, trainable=True)
        self.mlp = MLP(config)

    def project(self, embeds: torch.Tensor, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """q [..., heads, T, hd] and k, v [..., kv_heads, T, hd] for H-wide ``embeds`` and ``hidden``."""
        attn = self.self_attn
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)
        q = attn.q_proj(x).unflatten(-1, (attn.n_heads, attn.head_dim)).transpose(-2, -3)
        k = attn.k_proj(x).unflatten(-1, (attn.n_kv_heads, attn.head_dim)).transpose(-2, -3)
        v = attn.v_proj(x).unflatten(-1, (attn.n_kv_heads, attn.head_dim)).transpose(-2, -3)
        cos, sin = rope
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """Attention of q [..., heads, T, hd] over keys/values [..., kv_heads, S, hd]; ``allowed`` is
        bool [T, S]. Returns [..., T, H] after o_proj."""
        attn = self.self_attn
        # GQA: KV head j serves query heads j*g .. j*g+g-1
        keys = keys.repeat_interleave(attn.n_heads // attn.n_kv_heads, dim=-3)
        values = values.repeat_interleave(attn.n_heads // attn.n_kv_heads, dim=-3)
        scores = torch.matmul(q, keys.transpose(-1, -2)) * attn.scale
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, values).transpose(-2, -3).flatten(-2)
        return attn.o_proj(out)

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residuals on the hidden stream only, then the SwiGLU MLP."""
        x = hidden + attn_out
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Drafter(nn.Module):
    """An EAGLE-3 head. Parameter names are the checkpoint's (layer under ``midlayer``).

    ``target_embed`` ([vocab, H]) is the target's input embedding, shared and frozen; without it
    the drafter owns an ``embed_tokens`` (saved with it).
    """

    def __init__(self, config: Eagle3Config, target_embed: torch.Tensor | None = None):
        super().__init__()
        self.config = config
        H = config.hidden_size
        if target_embed is not None:
            _check_embedding(config, target_embed, "target_embed")
            # a plain attribute, not a parameter: the target's (possibly huge) matrix is used in
            # place, never copied, moved or saved with the drafter
            self.embed_tokens = None
            self.shared_embed = target_embed.detach()
        else:
            self.embed_tokens = nn.Embedding(config.vocab_size, H)
            self.shared_embed = None
        self.fc = nn.Linear(3 * config.target_hidden_size, H, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(H, config.rms_norm_eps, trainable=True)
        self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.set_draft_vocabulary(torch.arange(config.draft_vocab_size))
        self.register_buffer("inv_freq", rope_inv_freq(config.head_dim, config.rope_theta), persistent=False)
        self.max_seq_len = 0

    @property
    def owns_embedding(self) -> bool:
        return self.embed_tokens is not None

    # ------------------------------------------------------------------ vocabulary
    def set_draft_vocabulary(self, draft_ids: torch.Tensor) -> None:
        """Use the target tokens ``draft_ids`` (ascending, distinct) as the draft vocabulary."""
        draft_ids = torch.as_tensor(draft_ids, dtype=torch.long)
        if draft_ids.shape != (self.config.draft_vocab_size,):
            raise ValueError(f"draft_ids: expected {self.config.draft_vocab_size} ids, got {list(draft_ids.shape)}")
        self.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
        self.t2d.zero_()
        self.t2d[draft_ids] = True

    @property
    def draft_ids(self) -> torch.Tensor:
        """int64 [draft_vocab_size]: the target id of each draft-vocabulary entry."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def to_target_ids(self, draft_token_ids: torch.Tensor) -> torch.Tensor:
        return draft_token_ids + self.d2t[draft_token_ids]

    # ------------------------------------------------------------------ setup
    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """Llama's initialisation (normal(0, std) projections, unit norms), from ``seed``."""
        generator = torch.Generator().manual_seed(seed)
        for name, param in self.named_parameters():
            if not param.requires_grad:
                continue
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    param.copy_(torch.randn(param.shape, generator=generator) * std)

    def setup_kv_cache(self, max_seq_len: int) -> None:
        """Allocate ``max_seq_len`` KV slots (previous contents are lost)."""
        c = self.config
        self.midlayer.self_attn.kv_cache = KVCache(c.num_key_value_heads, max_seq_len, c.head_dim,
                                                   self.dtype, self.device)
        self.max_seq_len = int(max_seq_len)

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    # ------------------------------------------------------------------ forward pieces
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.owns_embedding else self.shared_embed
        return F.embedding(input_ids.to(weight.device), weight).to(device=self.device, dtype=self.dtype)

    def fuse(self, hidden: torch.Tensor) -> torch.Tensor:
        """The hidden stream: ``fc`` over the target's 3·H_target features, or the drafter's own H."""
        width = hidden.shape[-1]
        if width == 3 * self.config.target_hidden_size:
            return self.fc(hidden.to(self.dtype))
        if width == self.config.hidden_size:
            return hidden.to(self.dtype)
        raise SpecFitError(f"drafter input: hidden width {width} is neither the target's 3 x {self.config.target_hidden_size} "
                           f"features nor the drafter's hidden size {self.config.hidden_size}")

    def _apply(self, fn, recurse=True):
        # ``drafter.to(dtype=torch.bfloat16)`` casts float buffers too: recompute the RoPE
        # frequencies in float32 rather than keep rounded ones (the angles would drift by radians
        # at long positions), on whatever device the cast moved them to
        super()._apply(fn, recurse)
        if "inv_freq" in self._buffers and self.inv_freq.dtype != torch.float32:
            inv_freq = rope_inv_freq(self.config.head_dim, self.config.rope_theta)
            self.register_buffer("inv_freq", inv_freq.to(self.inv_freq.device), persistent=False)
        return self

    def rope_angles(self, positions: torch.Tensor) -> torch.Tensor:
        """float32 [T, head_dim / 2] rotary angles ``position * inv_freq``, whatever the dtype."""
        return positions.to(self.inv_freq.device, torch.float32)[:, None] * self.inv_freq[None, :]

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim] for absolute ``positions`` [T], in the drafter's dtype."""
        freqs = self.rope_angles(positions)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, input_ids, positions, attn_mask=None) -> DraftOutput:
        """Run T entries through the drafter, writing their keys/values to the KV cache.

        Args:
            hidden: [T, 3 * H_target] target features (concatenated low/mid/high) or [T, H]
                drafter outputs of the entries' parents.
            input_ids: int [T] the tokens paired with ``hidden`` (target ids).
            positions: int [T] absolute RoPE positions.
            attn_mask: bool [T, cache_len + T]; its width fixes ``cache_len``, the slots already
                committed. None means a linear continuation: positions consecutive, starting at
                ``cache_len = positions[0]``.
        """
        input_ids = torch.as_tensor(input_ids, dtype=torch.long, device=self.device).reshape(-1)
        positions = torch.as_tensor(positions, dtype=torch.long, device=self.device).reshape(-1)
        T = input_ids.numel()
        if hidden.ndim != 2 or hidden.shape[0] != T or positions.numel() != T:
            raise ValueError(f"drafter input: expected hidden [T, width], input_ids [T] and positions [T] with the "
                             f"same T, got hidden {list(hidden.shape)}, {T} ids, {positions.numel()} positions")
        if attn_mask is None:
            cache_len = int(positions[0])
            if not torch.equal(positions, torch.arange(cache_len, cache_len + T, device=self.device)):
                raise ValueError("positions: without attn_mask the entries must continue the cache at consecutive positions")
            attn_mask = torch.ones(T, cache_len + T, dtype=torch.bool, device=self.device).tril(diagonal=cache_len)
        attn_mask = torch.as_tensor(attn_mask, dtype=torch.bool, device=self.device)
        cache_len = attn_mask.shape[-1] - T
        if attn_mask.shape != (T, cache_len + T) or cache_len < 0:
            raise ValueError(f"attn_mask: expected shape [{T}, cache_len + {T}], got {list(attn_mask.shape)}")
        if cache_len + T > self.max_seq_len:
            raise ValueError(f"drafter KV cache: {cache_len} cached + {T} new entries exceed its {self.max_seq_len} slots")

        x = self.fuse(hidden.to(self.device))
        q, k, v = self.midlayer.project(self.embed(input_ids), x, self.rope(positions))
        keys, values = self.midlayer.self_attn.kv_cache.write(cache_len, k, v)
        out = self.midlayer.finish(x, self.midlayer.attend(q, keys, values, attn_mask))
        return DraftOutput(logits=self.head(out), hidden=out)

    @torch.inference_mode()
    def compact_kv(self, cache_len: int, keep) -> None:
        """Keep the new entries ``keep`` (ascending indices into the last call's T entries) at
        slots ``cache_len .. cache_len + len(keep) - 1``."""
        keep = torch.as_tensor(keep, dtype=torch.long, device=self.device).reshape(-1)
        self.midlayer.self_attn.kv_cache.compact(cache_len, keep)

    # ------------------------------------------------------------------ target checks
    def check_target(self, vocab_size: int, hidden_size: int, source: str = "target") -> None:
        """One clear error if the drafter was not built for a target of this shape."""
        self.config.check_target(vocab_size, hidden_size, source)

    # ------------------------------------------------------------------ checkpoint I/O
    @classmethod
    def from_pretrained(cls, drafter_dir: str | Path, target_embed: torch.Tensor | None = None,
                        target_lm_head: torch.Tensor | None = None, device: str | torch.device = "cpu",
                        dtype: torch.dtype | None = None) -> "Eagle3Drafter":
        """Load ``config.json`` + ``model.safetensors`` (safetensors only).

        ``target_embed`` [vocab, H] is required when the checkpoint has no ``embed_tokens.weight``;
        ``target_lm_head`` [vocab, H] when it has no ``lm_head.weight`` (its draft-vocabulary rows
        are used). Every tensor is checked; a problem is one :class:`SpecFitError` naming it.
        """
        drafter_dir = Path(drafter_dir)
        config = Eagle3Config.from_file(drafter_dir / "config.json")
        weights_path = drafter_dir / "model.safetensors"
        if not weights_path.is_file():
            raise SpecFitError(f"{drafter_dir}: no model.safetensors (only safetensors drafter checkpoints are supported)")
        dtype = dtype or _DTYPES[config.dtype]
        tensors = _read_safetensors(weights_path)
        state = _checked_state_dict(tensors, config, weights_path)

        draft_ids = _checked_vocabulary(tensors, config, weights_path)
        if "embed_tokens.weight" in state:
            if target_embed is not None:
                _check_embedding(config, target_embed, "target_embed")
            embedding = None
        elif target_embed is None:
            raise SpecFitError(f"{weights_path}: no tensor 'embed_tokens.weight'; pass the target's input embedding "
                               f"(target_embed, [{config.vocab_size}, {config.hidden_size}])")
        else:
            embedding = target_embed
        if "lm_head.weight" not in state:
            if target_lm_head is None:
                raise SpecFitError(f"{weights_path}: no tensor 'lm_head.weight'; pass the target's lm_head "
                                   f"(target_lm_head, [{config.vocab_size}, {config.hidden_size}])")
            _check_embedding(config, target_lm_head, "target_lm_head")
            state["lm_head.weight"] = target_lm_head[draft_ids]

        drafter = cls(config, target_embed=embedding)
        if embedding is not None:
            state.pop("embed_tokens.weight", None)
        state["d2t"] = draft_ids - torch.arange(config.draft_vocab_size)
        state["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool).index_fill_(0, draft_ids, True)
        drafter.load_state_dict(state, strict=True)
        drafter.requires_grad_(False).eval()
        return drafter.to(device=device, dtype=dtype)

    def save_pretrained(self, drafter_dir: str | Path, layer_prefix: str = "midlayer.") -> None:
        """Write ``config.json`` and ``model.safetensors`` in the published EAGLE-3 format."""
        if layer_prefix not in _LAYER_PREFIXES:
            raise ValueError(f"layer_prefix: expected one of {_LAYER_PREFIXES}, got {layer_prefix!r}")
        drafter_dir = Path(drafter_dir)
        drafter_dir.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for name, param in self.named_parameters():
            tensors[name.replace("midlayer.", layer_prefix, 1)] = param.detach().contiguous().cpu()
        tensors["d2t"] = self.d2t.detach().cpu().contiguous()
        tensors["t2d"] = self.t2d.detach().cpu().contiguous()
        config = self.config.to_dict() | {"torch_dtype": str(self.dtype).removeprefix("torch.")}
        (drafter_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(drafter_dir / "model.safetensors"), metadata={"format": "pt"})


# ----------------------------------------------------------------- loading helpers
def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        with safe_open(path, framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise SpecFitError(f"{path}: not a readable safetensors file ({exc})") from None


def _expected_shapes(config: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Parameter name (layer under ``midlayer.``) -> shape."""
    H, I, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q_width, kv_width = config.num_attention_heads * hd, config.num_key_value_heads * hd
    return {
        "fc.weight": (H, 3 * config.target_hidden_size),
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


def _checked_state_dict(tensors: dict[str, torch.Tensor], config: Eagle3Config, path: Path) -> dict[str, torch.Tensor]:
    """Checkpoint tensors under the module's names, each checked against the config's shape."""
    prefix = next((p for p in _LAYER_PREFIXES if any(name.startswith(p) for name in tensors)), "midlayer.")
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
            if name == "fc.weight" and actual[:1] == shape[:1]:
                hint = (f"; the features are 3 x the target's hidden size, so this drafter was built for a target "
                        f"with hidden size {actual[1] / 3:g}, not config's target_hidden_size {config.target_hidden_size}")
            raise SpecFitError(f"{path}: tensor {stored!r} has shape {list(actual)}, expected {list(shape)}{hint}")
        state[name] = tensors[stored]
    if "embed_tokens.weight" in tensors:
        embed = tensors["embed_tokens.weight"]
        expected = (config.vocab_size, config.hidden_size)
        if tuple(embed.shape) != expected:
            raise SpecFitError(f"{path}: tensor 'embed_tokens.weight' has shape {list(embed.shape)}, expected {list(expected)}")
        state["embed_tokens.weight"] = embed
    return state


def _checked_vocabulary(tensors: dict[str, torch.Tensor], config: Eagle3Config, path: Path) -> torch.Tensor:
    """The draft vocabulary's target ids from ``d2t``, checked against ``t2d`` and the vocabulary."""
    V, D = config.vocab_size, config.draft_vocab_size
    if "d2t" not in tensors:
        if D == V and "t2d" not in tensors:
            return torch.arange(V)   # a full-vocabulary drafter needs no mapping
        raise SpecFitError(f"{path}: missing tensor 'd2t' (int64 [{D}] offsets: target_id = i + d2t[i])")
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
    if "t2d" not in tensors:
        raise SpecFitError(f"{path}: missing tensor 't2d' (bool [{V}] marking the target tokens in the draft vocabulary)")
    t2d = tensors["t2d"]
    if tuple(t2d.shape) != (V,):
        raise SpecFitError(f"{path}: tensor 't2d' has shape {list(t2d.shape)}, expected [{V}] (vocab_size)")
    expected = torch.zeros(V, dtype=torch.bool)
    expected[draft_ids] = True
    if not torch.equal(t2d.bool(), expected):
        raise SpecFitError(f"{path}: tensors 't2d' and 'd2t' disagree on which target tokens are in the draft vocabulary")
    return draft_ids


def _check_embedding(config: Eagle3Config, weight: torch.Tensor, name: str) -> None:
    expected = (config.vocab_size, config.hidden_size)
    if tuple(weight.shape) != expected:
        raise SpecFitError(f"{name}: the target's matrix is {list(weight.shape)}, but the drafter expects "
                           f"[vocab_size, hidden_size] = {list(expected)}")
