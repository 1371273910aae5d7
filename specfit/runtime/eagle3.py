"""The EAGLE-3 drafter, in its published checkpoint format.

An EAGLE-3 head is one Llama decoder layer that reads two streams per token: the embedding of the
token and a hidden state. For a committed token the hidden state is the target's own features —
the inputs of three target layers (low / mid / high, ``3 * H_target`` wide) fused by ``fc``; for a
draft token it is the drafter's previous output (``H`` wide), fed back. Attention runs over
``cat(input_layernorm(embed), hidden_norm(hidden))`` (2·H-wide q/k/v projections), the residual
carries the hidden stream only, and ``lm_head`` scores a reduced *draft vocabulary*, mapped back to
target ids by ``d2t`` (``target_id = i + d2t[i]``).

Checkpoint (a directory): ``config.json`` in the EAGLE-3 / SpecForge or the vLLM speculators
layout (:mod:`specfit.runtime.eagle3_config`) and ``model.safetensors`` holding ``fc.weight``,
``norm.weight``, ``lm_head.weight`` (some exports omit it: the target's head restricted to the
draft vocabulary is used), ``d2t``, ``t2d`` (optional: ``d2t`` decides), the layer under
``midlayer.`` (SpecForge) or ``layers.0.`` (speculators, some EAGLE exports), optionally
``embed_tokens.weight`` (else the target's embedding is used), and the variants' norms:
``fc_norm.{0,1,2}.weight`` (EAGLE-3.1) and ``input_norm.weight`` (speculators' ``norm_before_fc``).

Variants of the forward: ``fc_norm`` normalises each of the three target features before ``fc``,
``norm_before_fc`` the concatenated features; ``norm_before_residual`` makes the attention residual
``hidden_norm(h)``; ``norm_output`` feeds ``norm(out)`` instead of ``out`` to the next level.

The draft vocabulary must survive export: ``d2t`` holds offsets (``target_id = i + d2t[i]``). A
reduced vocabulary whose ``d2t`` is all zeros maps draft token i to target token i — the state of
a mapping that was never loaded, which silently collapses acceptance — so it is refused unless
``t2d`` confirms it (then a :class:`DrafterVocabularyWarning` is issued). A missing ``d2t`` is an
error for a reduced vocabulary: ``t2d`` names the drafted tokens but not the order of ``lm_head``'s
rows.

KV slots follow :mod:`specfit.runtime.model`: committed entries occupy slots
``0 .. cache_len-1``; a call writes its T new entries to the next T slots in input order, with
explicit RoPE positions and a boolean mask over (cache + new), so one call drafts a whole tree
level. The drafter's position for the entry pairing target feature ``g[i]`` with token
``x[i+1]`` is ``i``; a draft node at depth d below the root entry is at ``root position + d``.
After verification the decoder re-runs the accepted tokens with the target's features and
overwrites the slots of their draft entries, as EAGLE-3 does.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from ..errors import SpecFitError
from ..io import atomic_write, optional_file, write_json_atomic
from .drafting import DraftOutput
from .eagle3_checkpoint import (LAYER_PREFIXES, DrafterVocabularyWarning, check_embedding, checked_state_dict,
                                checked_vocabulary, read_safetensors)
from .eagle3_config import EAGLE3_ARCHITECTURE, SPECULATORS_ARCHITECTURE, Eagle3Config
from .layers import KVCache, RMSNorm, apply_rope, embedding
from .rope import inv_freq_and_scale

__all__ = ["Eagle3Config", "Eagle3Drafter", "EAGLE3_ARCHITECTURE", "SPECULATORS_ARCHITECTURE", "DrafterVocabularyWarning"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}



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
        self.norm_before_residual = config.norm_before_residual
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
        # GQA: KV head j serves query heads j*g .. j*g+g-1. Their queries go side by side against
        # that head's keys and values ([..., kv_heads, g*T, hd]): the cache is read in place, not
        # copied g times per call (a copy of every cached key and value per drafted level)
        g, T = attn.n_heads // attn.n_kv_heads, q.shape[-2]
        q = q.unflatten(-3, (attn.n_kv_heads, g)).flatten(-3, -2)
        scores = torch.matmul(q, keys.transpose(-1, -2)).unflatten(-2, (g, T)) * attn.scale
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs.flatten(-3, -2), values).unflatten(-2, (g, T)).flatten(-4, -3)
        return attn.o_proj(out.transpose(-2, -3).flatten(-2))

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residuals on the hidden stream only (the normalised one with ``norm_before_residual``),
        then the SwiGLU MLP."""
        residual = self.hidden_norm(hidden) if self.norm_before_residual else hidden
        x = residual + attn_out
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
            check_embedding(config, target_embed, "target_embed")
            # a plain attribute, not a parameter: the target's (possibly huge) matrix is used in
            # place, never copied, moved or saved with the drafter
            self.embed_tokens = None
            self.shared_embed = target_embed.detach()
        else:
            self.embed_tokens = embedding(config.vocab_size, H)
            self.shared_embed = None
        TH = config.target_hidden_size
        # EAGLE-3.1: one norm per target feature; speculators' norm_before_fc: one over all three
        self.fc_norm = nn.ModuleList(RMSNorm(TH, config.rms_norm_eps, trainable=True) for _ in range(3)) \
            if config.fc_norm else None
        self.input_norm = RMSNorm(3 * TH, config.rms_norm_eps, trainable=True) if config.norm_before_fc else None
        self.fc = nn.Linear(3 * TH, H, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(H, config.rms_norm_eps, trainable=True)
        self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
        # the draft vocabulary starts as target ids 0..draft_vocab_size-1, set without arithmetic:
        # on the meta device (from_pretrained builds there) that would import torch._dynamo
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.t2d[:config.draft_vocab_size] = True
        self.rope_scale = self._set_inv_freq()
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
            hidden = hidden.to(self.dtype)
            if self.input_norm is not None:
                hidden = self.input_norm(hidden)
            if self.fc_norm is not None:
                hidden = torch.cat([norm(part) for norm, part in zip(self.fc_norm, hidden.chunk(3, dim=-1))], dim=-1)
            return self.fc(hidden)
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
            self._set_inv_freq(self.inv_freq.device)
        return self

    def _set_inv_freq(self, device: torch.device | str | None = None) -> float:
        """(Re)compute the float32 RoPE frequencies as a buffer on ``device`` (the default
        device if None); returns the attention scale the RoPE variant asks for. Computed on the
        CPU: arithmetic on the meta device would import torch._dynamo."""
        c = self.config
        with torch.device("cpu"):
            inv_freq, scale = inv_freq_and_scale(c.rope, c.head_dim, c.max_position_embeddings)
        device = torch.empty(0).device if device is None else device
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        return scale

    def rope_angles(self, positions: torch.Tensor) -> torch.Tensor:
        """float32 [T, head_dim / 2] rotary angles ``position * inv_freq``, whatever the dtype."""
        return positions.to(self.inv_freq.device, torch.float32)[:, None] * self.inv_freq[None, :]

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim] for absolute ``positions`` [T], in the drafter's dtype."""
        freqs = self.rope_angles(positions)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.rope_scale).to(self.dtype), (emb.sin() * self.rope_scale).to(self.dtype)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, input_ids, positions, attn_mask=None, logits_rows=None) -> DraftOutput:
        """Run T entries through the drafter, writing their keys/values to the KV cache.

        Args:
            hidden: [T, 3 * H_target] target features (concatenated low/mid/high) or [T, H]
                drafter outputs of the entries' parents.
            input_ids: int [T] the tokens paired with ``hidden`` (target ids).
            positions: int [T] absolute RoPE positions.
            attn_mask: bool [T, cache_len + T]; its width fixes ``cache_len``, the slots already
                committed. None means a linear continuation: positions consecutive, starting at
                ``cache_len = positions[0]``.
            logits_rows: which rows' logits to compute (``[-1]``: a catch-up pass over committed
                entries, whose newest alone drafts); all by default. ``hidden`` is every row's.
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
        normed = self.norm(out)
        # EAGLE-3.1's norm_output: the next level reads the normalised state
        logits = self.lm_head(normed if logits_rows is None else normed[logits_rows])
        return DraftOutput(logits=logits, hidden=normed if self.config.norm_output else out)

    @torch.inference_mode()
    def compact_kv(self, cache_len: int, keep) -> None:
        """Keep the new entries ``keep`` (ascending indices into the last call's T entries) at
        slots ``cache_len .. cache_len + len(keep) - 1``."""
        keep = torch.as_tensor(keep, dtype=torch.long, device=self.device).reshape(-1)
        self.midlayer.self_attn.kv_cache.compact(cache_len, keep + cache_len)

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
        if not optional_file(weights_path, "the drafter's safetensors weights"):
            raise SpecFitError(f"{drafter_dir}: no model.safetensors (only safetensors drafter checkpoints are supported)")
        dtype = dtype or _DTYPES[config.dtype]
        tensors = read_safetensors(weights_path)
        state = checked_state_dict(tensors, config, weights_path)

        draft_ids = checked_vocabulary(tensors, config, weights_path)
        if "embed_tokens.weight" in state:
            if target_embed is not None:
                check_embedding(config, target_embed, "target_embed")
            shared_embed = None
        elif target_embed is None:
            raise SpecFitError(f"{weights_path}: no tensor 'embed_tokens.weight'; pass the target's input embedding "
                               f"(target_embed, [{config.vocab_size}, {config.hidden_size}])")
        else:
            shared_embed = target_embed
        if "lm_head.weight" not in state:
            if target_lm_head is None:
                raise SpecFitError(f"{weights_path}: no tensor 'lm_head.weight'; pass the target's lm_head "
                                   f"(target_lm_head, [{config.vocab_size}, {config.hidden_size}])")
            check_embedding(config, target_lm_head, "target_lm_head")
            state["lm_head.weight"] = target_lm_head[draft_ids]

        # built on the meta device and given the checkpoint's tensors: no random weights first
        # (seconds and twice the memory for a Llama-8B-sized head)
        with torch.device("meta"):
            drafter = cls(config, target_embed=shared_embed)
        if shared_embed is not None:
            state.pop("embed_tokens.weight", None)
        state["d2t"] = draft_ids - torch.arange(config.draft_vocab_size)
        state["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool).index_fill_(0, draft_ids, True)
        # copy=True: a tensor read from a safetensors file can share the file's memory map
        state = {name: t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype, copy=True)
                 for name, t in state.items()}
        drafter.load_state_dict(state, strict=True, assign=True)
        drafter._set_inv_freq(device)
        return drafter.requires_grad_(False).eval()

    def save_pretrained(self, drafter_dir: str | Path, layer_prefix: str = "midlayer.") -> None:
        """Write ``config.json`` and ``model.safetensors`` in the published EAGLE-3 format."""
        if layer_prefix not in LAYER_PREFIXES:
            raise ValueError(f"layer_prefix: expected one of {LAYER_PREFIXES}, got {layer_prefix!r}")
        drafter_dir = Path(drafter_dir)
        drafter_dir.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for name, param in self.named_parameters():
            tensors[name.replace("midlayer.", layer_prefix, 1)] = param.detach().contiguous().cpu()
        tensors["d2t"] = self.d2t.detach().cpu().contiguous()
        tensors["t2d"] = self.t2d.detach().cpu().contiguous()
        config = self.config.to_dict() | {"torch_dtype": str(self.dtype).removeprefix("torch.")}
        # the weights first: a directory whose config.json is there holds the weights it describes
        atomic_write(drafter_dir / "model.safetensors", lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
        write_json_atomic(drafter_dir / "config.json", config)
