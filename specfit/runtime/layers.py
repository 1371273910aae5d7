"""The building blocks the target, its attention variants and the drafters share: RMSNorm, a
static KV cache indexed by slot, and half-split RoPE."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RMSNorm", "KVCache", "apply_rope", "embedding"]


def embedding(n: int, dim: int) -> nn.Embedding:
    """``nn.Embedding(n, dim)``, left uninitialised when built on the meta device.

    Its random init there goes through ``torch._refs.normal_``, whose first call imports
    ``torch._dynamo``: a second of start-up for a weight the checkpoint replaces anyway."""
    if torch.empty(0).is_meta:
        return nn.Embedding(n, dim, _weight=torch.empty(n, dim))
    return nn.Embedding(n, dim)


class RMSNorm(nn.Module):
    """RMSNorm; frozen in the target, ``trainable`` for the drafter."""

    def __init__(self, size: int, eps: float, trainable: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=trainable)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in float32, cast back, then scale: transformers' order, which matters in bf16
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class KVCache(nn.Module):
    """Keys and values of one layer, [n_kv_heads, max_seq_len, head_dim], indexed by slot.

    ``storage`` [2, n_kv_heads, max_seq_len, head_dim] holds them when given (a model keeps every
    layer's in one tensor, so that compacting the accepted path is one copy for all layers)."""

    def __init__(self, n_kv_heads: int, max_seq_len: int, head_dim: int, dtype: torch.dtype, device,
                 storage: torch.Tensor | None = None):
        super().__init__()
        shape = (n_kv_heads, max_seq_len, head_dim)
        if storage is None:
            storage = torch.zeros((2, *shape), dtype=dtype, device=device)
        elif tuple(storage.shape) != (2, *shape):
            raise ValueError(f"storage: expected shape {(2, *shape)}, got {tuple(storage.shape)}")
        self.register_buffer("k", storage[0], persistent=False)
        self.register_buffer("v", storage[1], persistent=False)

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store [n_kv, T, hd] at slots start..start+T-1; return all keys/values up to there."""
        end = start + k.shape[1]
        self.k[:, start:end] = k
        self.v[:, start:end] = v
        return self.k[:, :end], self.v[:, :end]

    def compact(self, start: int, slots: torch.Tensor) -> None:
        """Copy the entries at ``slots`` (absolute, ascending, none below ``start``) to slots
        ``start ..``; index_select copies first, so overlapping slots are safe."""
        self.k[:, start:start + slots.numel()] = self.k.index_select(1, slots)
        self.v[:, start:start + slots.numel()] = self.v.index_select(1, slots)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split RoPE: rotate_half(x) = cat(-x2, x1)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
