"""The dense feed-forward parts of MoE decoder layers: what is always resident on the device.

- :class:`DenseMLP`: a SwiGLU MLP, ``down(silu(gate(x)) * up(x))``. Dense layers between MoE
  layers (Qwen2/Qwen3-MoE's ``mlp_only_layers`` / ``decoder_sparse_step``, DeepSeek-V2's first
  ``first_k_dense_replace`` layers) run one instead of experts.
- :class:`SharedExpert`: the expert every token goes through beside its routed ones. Qwen2-MoE
  scales it per token by ``sigmoid(shared_expert_gate(x))``; DeepSeek-V2's ``n_shared_experts``
  are one MLP of ``n_shared_experts * moe_intermediate_size`` without a gate.

Neither goes through the expert offload: their weights live with the dense weights, so the cost
model, the expert cache and its counters see only routed experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DenseMLP", "SharedExpert"]


class DenseMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SharedExpert(DenseMLP):
    """A :class:`DenseMLP` that every token runs, optionally behind a sigmoid gate [1, H]."""

    def __init__(self, hidden_size: int, intermediate_size: int, gated: bool):
        super().__init__(hidden_size, intermediate_size)
        self.gate = nn.Linear(hidden_size, 1, bias=False) if gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.gate is not None:
            out = torch.sigmoid(self.gate(x)) * out
        return out
