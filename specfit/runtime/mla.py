"""DeepSeek-V2's multi-head latent attention (MLA), with a cache of the compressed latents.

Per token, keys and values come from one ``kv_lora_rank``-wide latent and one
``qk_rope_head_dim``-wide rotary key shared by every head:

    q            = q_proj(x)   or   q_b_proj(q_a_layernorm(q_a_proj(x)))    [heads, qk_nope + qk_rope]
    latent, k_pe = split(kv_a_proj_with_mqa(x));  latent = kv_a_layernorm(latent)
    k_nope, v    = split(kv_b_proj(latent))                                  per head
    key          = cat(k_nope, rope(k_pe));  query = cat(q_nope, rope(q_pe))

The cache holds ``latent`` and the rotated ``k_pe`` (what ``transformers`` caches). A pass over few
queries (decoding, verification) absorbs ``kv_b_proj`` into the queries and the output, as
DeepSeek-V2 describes for inference: ``q_nope . (W_uk latent) = (q_nope W_uk) . latent`` and the
attention-weighted latents go through ``W_uv`` once per query, so no cached latent is expanded; a
pass over about as many queries as cached latents (a prompt) expands every latent through
``kv_b_proj`` into keys and values, as ``transformers`` does. The two agree up to rounding; the
absorbed form runs in float32 only, since in a 16-bit dtype its rounding differs from
``transformers``' by a few steps of the dtype.

RoPE here is the interleaved form (pairs ``(x[2i], x[2i+1])`` rotated as complex numbers) in
float32, on the rotary part only; the softmax scale is ``qk_head_dim^-0.5``, times
``yarn_mscale(factor, mscale_all_dim)^2`` under YaRN scaling. The two inner norms use
``transformers``' default epsilon (1e-6), not ``rms_norm_eps``.

Slots and masks follow :mod:`specfit.runtime.model`: a pass writes its T entries after the
``cache_len`` committed ones, and :meth:`LatentCache.compact` keeps the accepted ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import KVCache, RMSNorm
from .rope import yarn_mscale

__all__ = ["MLAttention", "LatentCache"]

_INNER_NORM_EPS = 1e-6


class LatentCache(KVCache):
    """Compressed keys of one layer: ``k`` = latents [1, max_seq_len, kv_lora_rank], ``v`` =
    rotated shared keys [1, max_seq_len, qk_rope_head_dim], indexed by slot."""

    def __init__(self, kv_lora_rank: int, rope_dim: int, max_seq_len: int, dtype: torch.dtype, device):
        nn.Module.__init__(self)
        self.register_buffer("k", torch.zeros((1, max_seq_len, kv_lora_rank), dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("v", torch.zeros((1, max_seq_len, rope_dim), dtype=dtype, device=device),
                             persistent=False)


class MLAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        mla, H = config.mla, config.hidden_size
        self.n_heads, self.mla = config.n_heads, mla
        qk = mla.qk_head_dim
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(H, self.n_heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(H, mla.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, _INNER_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, self.n_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, _INNER_NORM_EPS)
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, self.n_heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.o_proj = nn.Linear(self.n_heads * mla.v_head_dim, H, bias=False)
        self.scale = qk ** -0.5
        rope = config.rope
        if rope.rope_type != "default" and rope.mscale_all_dim:
            self.scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
        self.kv_cache: LatentCache | None = None

    def make_kv_cache(self, max_seq_len: int, dtype: torch.dtype, device) -> LatentCache:
        return LatentCache(self.mla.kv_lora_rank, self.mla.qk_rope_head_dim, max_seq_len, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache_len: int,
                additive_mask: torch.Tensor) -> torch.Tensor:
        """``cos``/``sin`` [T, qk_rope_head_dim] in float32 (half-split layout, attention factor
        applied), as :class:`~specfit.runtime.rope.Rotary` returns them."""
        mla, T = self.mla, x.shape[0]
        if mla.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(T, self.n_heads, mla.qk_head_dim).transpose(0, 1)               # [heads, T, qk]
        q_nope, q_pe = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)

        half = mla.qk_rope_head_dim // 2
        rotation = torch.complex(cos[:, :half].float(), sin[:, :half].float())     # [T, rope / 2]
        q_pe, k_pe = _rotate_pairs(q_pe, rotation), _rotate_pairs(k_pe, rotation)
        latents, k_pes = self.kv_cache.write(cache_len, latent[None], k_pe[None])  # [1, S, r], [1, S, rope]

        S = latents.shape[1]
        if self._absorbs(T, S):
            out = self._absorbed(q_nope, q_pe, latents[0], k_pes[0], additive_mask)
        else:
            out = self._expanded(q_nope, q_pe, latents[0], k_pes[0], additive_mask)
        out = out.transpose(0, 1).reshape(T, self.n_heads * mla.v_head_dim)
        return self.o_proj(out)

    def _absorbs(self, T: int, S: int) -> bool:
        """Whether the absorbed form does less arithmetic for ``T`` queries over ``S`` cached
        latents. Per head, the expanded form costs ``S r (nope + v)`` (every latent through
        ``kv_b_proj``) plus ``T S (qk + v)``, the absorbed one ``T r (nope + v)`` plus
        ``T S (2 r + rope)``: verification and decode passes absorb (up to ~170 queries at
        DeepSeek-V2-Lite's shapes), a prompt's pass over about as many tokens as it caches expands.
        Float32 weights only: there the two forms agree to float32 rounding (``benchmarks/RESULTS.md``,
        "MLA decode and verification passes absorb"), while in a 16-bit dtype the
        absorbed form rounds other intermediates than ``transformers``' expanded one (a few
        bfloat16 steps on the logits, enough to flip a near tie); on a GPU, where 16-bit runs, the
        product it saves is also the cheap part of a pass."""
        if self.kv_b_proj.weight.dtype != torch.float32:
            return False
        m = self.mla
        r, per_head = m.kv_lora_rank, m.qk_nope_head_dim + m.v_head_dim
        expanded = S * r * per_head + T * S * (m.qk_head_dim + m.v_head_dim)
        absorbed = T * r * per_head + T * S * (2 * r + m.qk_rope_head_dim)
        return absorbed < expanded

    def _expanded(self, q_nope, q_pe, latents, k_pes, additive_mask) -> torch.Tensor:
        """Attention with every cached latent expanded to its keys and values (``transformers``'
        form): [heads, T, v]."""
        mla, S = self.mla, latents.shape[0]
        kv = self.kv_b_proj(latents).view(S, self.n_heads, mla.qk_nope_head_dim + mla.v_head_dim).transpose(0, 1)
        k_nope, values = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        keys = torch.cat((k_nope, k_pes.expand(self.n_heads, S, -1)), dim=-1)
        query = torch.cat((q_nope, q_pe), dim=-1)
        scores = torch.matmul(query, keys.transpose(1, 2)) * self.scale + additive_mask
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        return torch.matmul(probs, values)

    def _absorbed(self, q_nope, q_pe, latents, k_pes, additive_mask) -> torch.Tensor:
        """The same attention with ``kv_b_proj`` absorbed into the query and the output (as
        DeepSeek-V2's paper describes for inference): a head's key part is ``W_uk latent``, so
        ``q_nope . k_nope = (q_nope W_uk) . latent``, and its value ``W_uv latent``, so the
        attention-weighted sum of latents goes through ``W_uv`` once per query instead of every
        latent once per pass. Equal to :meth:`_expanded` up to rounding: [heads, T, v]."""
        mla = self.mla
        weight = self.kv_b_proj.weight.view(self.n_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        w_uk, w_uv = weight.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=1)     # [heads, nope | v, r]
        q_latent = torch.matmul(q_nope, w_uk)                                           # [heads, T, r]
        scores = (torch.matmul(q_latent, latents.t()) + torch.matmul(q_pe, k_pes.t())) * self.scale + additive_mask
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q_nope.dtype)
        return torch.matmul(torch.matmul(probs, latents), w_uv.transpose(1, 2))       # [heads, T, v]


def _rotate_pairs(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE: ``x`` [..., T, d] as d/2 complex pairs times ``rotation`` [T, d/2], in float32."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * rotation).flatten(-2).type_as(x)
