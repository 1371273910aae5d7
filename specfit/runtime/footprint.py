"""What a decode holds on its device beyond the target's weights, KV cache and expert slots,
measured by running the runtime's own modules on the ``meta`` device (no memory, no arithmetic).

A pass's workspace is the most bytes its tensors hold at once: a target pass's attention
materialises its scores ``[heads, new tokens, keys]`` in the compute dtype, their float32 softmax
and its cast back (about 8 bytes a score in bfloat16), and its logits are ``[rows, vocab]``. The
prompt runs in chunks (:mod:`specfit.runtime.prefill`), so its largest pass is a chunk over the
whole prompt, whose workspace grows with the chunk times the prompt (one pass over a 4096-token
prompt at Qwen3-30B-A3B's 32 heads: 4.4 GB; 512-token chunks: 0.56 GB); a verification pass's
with its tree times the context. :func:`pass_workspace_bytes` runs one attention layer (the layers run
one after another: one layer's transients are alive at a time), the final norm and the
``lm_head`` over the rows whose logits are kept; the MoE and MLP blocks' transients (a few
``[tokens, intermediate]`` blocks) are left out. :func:`drafter_footprint` builds the stand-in
EAGLE-3 head :func:`~specfit.calibrate.standin.random_drafter` builds and runs its passes the same way.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["pass_workspace_bytes", "DrafterFootprint", "drafter_footprint", "PeakBytes"]


class PeakBytes(TorchDispatchMode):
    """The most bytes the storages that ops create under it hold at once (a storage is held while a
    tensor viewing it is alive), but for the storages of ``existing`` tensors (weights, caches made
    before it)."""

    def __init__(self, existing=()):
        super().__init__()
        self.existing = {t.untyped_storage()._cdata for t in existing}
        self.views, self.size, self.live, self.peak = {}, {}, 0, 0

    def _release(self, key: int) -> None:
        self.views[key] -= 1
        if not self.views[key]:
            del self.views[key]
            self.live -= self.size.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key = storage._cdata
                if key in self.existing:
                    continue
                if key not in self.views:
                    self.views[key], self.size[key] = 0, storage.nbytes()
                    self.live += storage.nbytes()
                self.views[key] += 1
                weakref.finalize(tensor, self._release, key)
        self.peak = max(self.peak, self.live)
        return out


def _meta_model(config, dtype: torch.dtype):
    from .model import MoETransformer

    with torch.device("meta"):
        model = MoETransformer(config).to(dtype)
    model.init_rope()
    return model


@torch.inference_mode()
def pass_workspace_bytes(config, dtype: torch.dtype, new_tokens: int, cached_tokens: int,
                         logits_rows: int | None = None) -> int:
    """The workspace of a target pass of ``new_tokens`` over ``cached_tokens`` committed ones
    (the model's attention, norm and ``lm_head``, on the meta device), keeping ``logits_rows``
    rows' logits (all by default)."""
    model = _meta_model(config, dtype)
    attention = model.layers[0].self_attn
    attention.kv_cache = attention.make_kv_cache(cached_tokens + new_tokens, dtype, "meta")
    model.max_seq_len = cached_tokens + new_tokens
    if config.sliding_window is not None:
        model._slot_positions = torch.zeros(model.max_seq_len, dtype=torch.long, device="meta")
    with PeakBytes() as peak:
        positions = torch.arange(cached_tokens, cached_tokens + new_tokens, device="meta")
        mask = model._additive_mask(torch.ones(new_tokens, cached_tokens + new_tokens, dtype=torch.bool, device="meta"),
                                    positions, cached_tokens)
        cos, sin = model.rope(positions)
        x = torch.empty(new_tokens, config.hidden_size, dtype=dtype, device="meta")
        x = x + attention(x, cos, sin, cached_tokens, mask)
        del mask, cos, sin
        x = model.norm(x)
        logits = model.lm_head(x if logits_rows is None else x[:logits_rows])
        del x, logits
    return peak.peak


@dataclass(frozen=True)
class DrafterFootprint:
    weight_bytes: int      # its parameters and buffers, the target's shared embedding not counted
    kv_bytes: int          # its KV cache for the given entries
    prompt_pass_bytes: int  # the workspace of its largest pass over a prompt (the newest entry's logits)


@torch.inference_mode()
def drafter_footprint(config, dtype: torch.dtype, entries: int, prompt_tokens: int, chunk: int = 0) -> DrafterFootprint:
    """The stand-in EAGLE-3 head of a target of ``config`` (:func:`~specfit.calibrate.standin.drafter_config`,
    the embedding the target's): its weights, a KV cache of ``entries`` slots and its largest pass
    over ``prompt_tokens`` (at most ``entries``) target positions in passes of at most ``chunk``
    (0: one pass): ``chunk`` entries over the ones before them, on the meta device."""
    from ..calibrate.standin import drafter_config
    from .eagle3 import Eagle3Drafter
    from .prefill import largest_prompt_pass

    with torch.device("meta"):
        embed = torch.empty(config.vocab_size, config.hidden_size, dtype=dtype)
        drafter = Eagle3Drafter(drafter_config(config, dtype), target_embed=embed)
    drafter = drafter.to(device="meta", dtype=dtype)      # its RoPE frequencies are made on the CPU
    weights = sum(t.nbytes for t in (*drafter.parameters(), *drafter.buffers()))
    drafter.setup_kv_cache(entries)
    kv = drafter.midlayer.self_attn.kv_cache.k.untyped_storage().nbytes()      # keys and values
    new, cached = largest_prompt_pass(prompt_tokens, chunk)
    with PeakBytes() as peak:
        features = torch.empty(new, 3 * config.hidden_size, dtype=dtype, device="meta")
        ids = torch.zeros(new, dtype=torch.long, device="meta")
        positions = torch.arange(cached, prompt_tokens, device="meta")
        allowed = torch.ones(new, prompt_tokens, dtype=torch.bool, device="meta").tril(diagonal=cached)
        out = drafter(features, ids, positions, allowed, logits_rows=[-1])
        del features, ids, positions, allowed, out
    return DrafterFootprint(weight_bytes=weights, kv_bytes=kv, prompt_pass_bytes=peak.peak)
