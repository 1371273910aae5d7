"""A compact forward pass for Hugging Face MoE checkpoints (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral,
DeepSeek-V2).

gpt-fast style: plain modules, a static KV cache written at explicit slots, a forward that reads
top to bottom. The math mirrors ``transformers``' eager path operation by operation (see
REFERENCE.md) so that logits agree to float32 rounding and greedy outputs agree token for token.

Any set of new tokens can be run in one pass: the caller gives each token its RoPE position and a
boolean attention mask over (cache + new tokens), so a draft tree is verified in one pass. KV
slots: committed tokens occupy slots ``0 .. cache_len-1`` (slot == absolute position); the new
tokens of a pass are written to slots ``cache_len .. cache_len+T-1`` in input order, whatever
their positions (siblings of a tree share a position). :meth:`MoETransformer.compact_kv` then moves
the accepted ones to contiguous slots after the prefix.

The MoE block is the only place that knows about experts; it gets their weights from the
:class:`~specfit.runtime.offload.ExpertOffload` layer by layer, under its MoE-layer index (dense
layers and shared experts are plain resident weights, :mod:`specfit.runtime.dense`). The router
is :mod:`specfit.runtime.routers`, RoPE :mod:`specfit.runtime.rope`, DeepSeek-V2's attention
:mod:`specfit.runtime.mla`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from .config import ModelConfig, default_capture_layers
from .dense import DenseMLP, SharedExpert
from .devices import to_host, upload
from .layers import KVCache, RMSNorm, apply_rope, embedding
from .mla import MLAttention
from .offload import ExpertOffload, OffloadCounters
from .rope import Rotary
from .routers import route

__all__ = ["MoETransformer", "ForwardOutput", "causal_mask", "routing_plan", "expert_output", "weight_dtype"]

_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.bool_): torch.bool}


@dataclass
class ForwardOutput:
    """One pass over T new tokens.

    Attributes:
        logits: [R, V] for the requested rows (all T by default), in the compute dtype.
        expert_ids: int64 [T, L_moe, k], the router's top-k experts of each token at each MoE
            layer (rank order).
        hidden: [T, len(capture_layers) * H], the inputs of the capture layers concatenated in
            order (EAGLE-3's low / mid / high features; layer ``n_layers`` is the last layer's
            output before the final norm), or None when nothing is captured.
        offload: expert traffic of this pass, per MoE layer.
    """

    logits: torch.Tensor
    expert_ids: np.ndarray
    hidden: torch.Tensor | None
    offload: OffloadCounters


def causal_mask(n_cached: int, n_new: int) -> torch.Tensor:
    """[n_new, n_cached + n_new] bool: a linear continuation of the cache."""
    return torch.ones(n_new, n_cached + n_new, dtype=torch.bool).tril(diagonal=n_cached)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        H, hd = config.hidden_size, config.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, hd
        bias = config.attention_bias                                         # Qwen2-MoE: q/k/v biases
        self.q_proj = nn.Linear(H, config.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(H, config.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(H, config.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(config.n_heads * hd, H, bias=False)
        self.qk_norm, self.clip_qkv = config.qk_norm, config.clip_qkv
        if config.qk_norm == "per_head":      # Qwen3: RMSNorm over head_dim, per head
            self.q_norm = RMSNorm(hd, config.rms_norm_eps)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        elif config.qk_norm == "full":        # OLMoE: RMSNorm over the whole projection
            self.q_norm = RMSNorm(config.n_heads * hd, config.rms_norm_eps)
            self.k_norm = RMSNorm((H // config.n_heads) * config.n_kv_heads, config.rms_norm_eps)
        self.scale = hd ** -0.5
        self.kv_cache: KVCache | None = None

    def make_kv_cache(self, max_seq_len: int, dtype: torch.dtype, device) -> KVCache:
        return KVCache(self.n_kv_heads, max_seq_len, self.head_dim, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache_len: int,
                additive_mask: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.view(T, self.n_heads, self.head_dim)
        k = k.view(T, self.n_kv_heads, self.head_dim)
        v = v.view(T, self.n_kv_heads, self.head_dim)
        if self.qk_norm == "per_head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)   # [heads, T, hd]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys, values = self.kv_cache.write(cache_len, k, v)
        # GQA: KV head j serves query heads j*g .. j*g+g-1, which go side by side against its keys
        # and values ([kv_heads, g*T, hd]): the cache is read in place, not copied g times per pass
        groups = self.n_heads // self.n_kv_heads
        q = q.reshape(self.n_kv_heads, groups * T, self.head_dim)
        scores = torch.matmul(q, keys.transpose(1, 2)).view(self.n_heads, T, -1) * self.scale + additive_mask
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs.view(self.n_kv_heads, groups * T, -1), values).view(self.n_heads, T, self.head_dim)
        return self.o_proj(out.transpose(0, 1).reshape(T, self.n_heads * self.head_dim))


def weight_dtype(name: str, config: ModelConfig, dtype: torch.dtype) -> torch.dtype:
    """The dtype :class:`MoETransformer`'s weight ``name`` is held in when the model computes in
    ``dtype``: float32 for a router the family keeps in float32 (``router_float32``: DeepSeek),
    ``dtype`` otherwise. The loader and the calibration's stand-in both hold weights so."""
    return torch.float32 if config.router_float32 and name.endswith("moe.gate.weight") else dtype


class MoEBlock(nn.Module):
    """Router plus routed experts. Expert weights come from the offload, one expert at a time;
    ``layer`` is the MoE-layer index the offload knows the experts by."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.gate = nn.Linear(config.hidden_size, config.n_experts, bias=False)
        self.layer, self.top_k = layer, config.top_k
        self.config = config
        self.offload: ExpertOffload | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights [T, k] and expert ids [T, k] of ``x`` [T, H]."""
        return route(x, self.gate.weight, self.config)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
        weights, expert_ids = self.route(x)
        # the union decides the transfers, so routing must reach the host before any expert runs:
        # the layer's one synchronisation
        expert_ids_host = to_host(expert_ids)
        experts, spans, index = routing_plan(expert_ids_host)
        index = upload(index, x.device)              # one non-blocking copy for every expert's tokens
        weights = weights.reshape(-1)
        outputs = {}
        # the offload yields hits first and misses as their copies land
        for expert, gate_up, down in self.offload.layer_experts(self.layer, experts):
            start, end = spans[expert]
            outputs[expert] = expert_output(x, weights, index[:, start:end], gate_up, down)
        out = torch.zeros_like(x)
        for expert in experts.tolist():
            # ascending expert order with index_add_ reproduces transformers' sum bit for bit
            token, y = outputs[expert]
            out.index_add_(0, token, y.to(out.dtype))
        return out, expert_ids_host


def routing_plan(expert_ids: np.ndarray) -> tuple[np.ndarray, dict[int, tuple[int, int]], np.ndarray]:
    """The layer's token-expert assignments sorted once, on the host.

    ``expert_ids`` is int [T, k] (the router's top-k). Returns the union (ascending ids), each
    expert's ``(start, end)`` columns, and ``index`` int64 [2, T*k]: row 0 the token, row 1 its
    entry in the flattened [T, k] routing weights; within an expert, assignments are in
    (k-slot, token) order, the order ``transformers`` gathers them in.
    """
    T, k = expert_ids.shape
    flat = np.ascontiguousarray(expert_ids.T).reshape(-1).astype(np.int64)   # assignment = slot * T + token
    order = np.argsort(flat, kind="stable")
    experts, starts, counts = np.unique(flat[order], return_index=True, return_counts=True)
    token, slot = order % T, order // T
    spans = {e: (s, s + n) for e, s, n in zip(experts.tolist(), starts.tolist(), counts.tolist())}
    return experts, spans, np.stack([token, token * k + slot])


def expert_output(x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's part of a MoE layer: gather its tokens (``index`` [2, n] from
    :func:`routing_plan`), SwiGLU through ``gate_up`` [2I, H] and ``down`` [H, I], scale by the
    routing weights (``weights`` flattened [T * k]). Returns (token ids, outputs [n, H]); the
    calibration's hit probe times exactly this plus the ``index_add_``."""
    token = index[0]
    gate, up = F.linear(x[token], gate_up).chunk(2, dim=-1)
    return token, F.linear(F.silu(gate) * up, down) * weights[index[1], None]


class DecoderLayer(nn.Module):
    """Attention, then routed experts (plus a shared expert where the family has one) on an MoE
    layer or a dense MLP on a dense layer (``moe`` is None there)."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        H = config.hidden_size
        self.input_layernorm = RMSNorm(H, config.rms_norm_eps)
        if config.mla is not None:
            self.self_attn = MLAttention(config)
        else:
            self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(H, config.rms_norm_eps)
        moe_index = config.moe_index(layer)
        self.moe = MoEBlock(config, moe_index) if moe_index is not None else None
        self.mlp = DenseMLP(H, config.dense_intermediate_size) if moe_index is None else None
        self.shared_expert = (SharedExpert(H, config.shared_expert_intermediate_size, config.shared_expert_gated)
                              if moe_index is not None and config.shared_expert_intermediate_size else None)

    def forward(self, x, cos, sin, cache_len, additive_mask) -> tuple[torch.Tensor, np.ndarray | None]:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache_len, additive_mask)
        h = self.post_attention_layernorm(x)
        if self.moe is None:
            return x + self.mlp(h), None
        out, expert_ids = self.moe(h)
        if self.shared_expert is not None:
            out = out + self.shared_expert(h)    # routed + shared, transformers' order of the sum
        return x + out, expert_ids


class MoETransformer(nn.Module):
    """The target model. Dense weights and the KV cache live on ``device``; experts come from
    ``offload`` (attach with :meth:`attach_offload`; the loader does both).

    Build on the meta device and fill with ``load_state_dict(..., assign=True)`` to avoid
    allocating random weights first (the loader does this).
    """

    def __init__(self, config: ModelConfig, capture_layers: tuple[int, ...] | None = None):
        super().__init__()
        self.config = config
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, layer) for layer in range(config.n_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.capture_layers = default_capture_layers(config.n_layers) if capture_layers is None else tuple(capture_layers)
        bad = [layer for layer in self.capture_layers if not 0 <= layer <= config.n_layers]
        if bad:
            raise ValueError(f"capture_layers: expected layers in [0, {config.n_layers}], got {bad}")
        self.offload: ExpertOffload | None = None
        self.max_seq_len = 0
        self._kv_storage: torch.Tensor | None = None     # every layer's K/V in one tensor (setup_kv_cache)
        self._kv_host: np.ndarray | None = None           # ... viewed as numpy, on the host
        self._slot_positions: torch.Tensor | None = None  # each slot's position, for a sliding window

    # ------------------------------------------------------------------ setup
    def init_rope(self) -> None:
        """(Re)compute RoPE frequencies on the model's device, after weights are loaded."""
        c = self.config
        # a plain attribute, not a buffer: ``model.to(torch.bfloat16)`` leaves the float32
        # frequencies alone (rounded ones would drift by radians at long positions)
        self.rotary = Rotary(c.rope, c.head_dim, c.max_position_embeddings, device=self.device)

    def attach_offload(self, offload: ExpertOffload) -> None:
        self.offload = offload
        for block in self.moe_blocks():
            block.offload = offload

    def moe_blocks(self) -> list[MoEBlock]:
        """The MoE blocks in MoE-layer order (dense layers have none)."""
        return [layer.moe for layer in self.layers if layer.moe is not None]

    def setup_kv_cache(self, max_seq_len: int) -> None:
        """Allocate a static KV cache of ``max_seq_len`` slots per layer (its contents are lost)."""
        if max_seq_len > self.config.max_position_embeddings:
            raise ValueError(f"max_seq_len: {max_seq_len} exceeds the model's max_position_embeddings "
                             f"({self.config.max_position_embeddings})")
        attention = [layer.self_attn for layer in self.layers]
        self._kv_storage = self._kv_host = None
        shapes = {(a.n_kv_heads, a.head_dim) for a in attention if type(a) is Attention}
        if len(shapes) == 1 and all(type(a) is Attention for a in attention):
            # every layer's keys and values in one tensor [layers, 2, kv heads, slots, head dim]:
            # compact_kv moves the accepted path of all layers in one copy
            (n_kv_heads, head_dim), = shapes
            self._kv_storage = torch.zeros((len(attention), 2, n_kv_heads, max_seq_len, head_dim), dtype=self.dtype,
                                           device=self.device)
            for a, storage in zip(attention, self._kv_storage):
                a.kv_cache = KVCache(n_kv_heads, max_seq_len, head_dim, self.dtype, self.device, storage=storage)
            if self.device.type == "cpu" and self.dtype in (torch.float32, torch.float16, torch.float64):
                # the same memory as bytes [layers x 2 x kv heads, slots, bytes per slot], which
                # one compiled kernel compacts for any element type
                host = self._kv_storage.numpy()
                self._kv_host = host.reshape(-1, max_seq_len, head_dim).view(np.uint8)
        else:
            for a in attention:
                a.kv_cache = a.make_kv_cache(max_seq_len, self.dtype, self.device)
        # a sliding window needs each cached key's position, which is not always its slot: a draft
        # model runs one position ahead of its slots, a draft tree's nodes sit at their depths
        self._slot_positions = (torch.zeros(max_seq_len, dtype=torch.long, device=self.device)
                                if self.config.sliding_window is not None else None)
        self.max_seq_len = int(max_seq_len)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, input_ids, positions, attn_mask=None, logits_rows=None) -> ForwardOutput:
        """Run T new tokens.

        Args:
            input_ids: int [T] token ids.
            positions: int [T] absolute RoPE positions (a tree node: prefix length + depth).
            attn_mask: bool [T, cache_len + T]; row i may attend to column j (a cached slot for
                j < cache_len, new token j - cache_len otherwise). Its width fixes ``cache_len``,
                the number of committed slots. None means a linear continuation: positions must
                be consecutive and ``cache_len = positions[0]``.
            logits_rows: which rows' logits to compute (e.g. ``[-1]`` after a prefill); all by
                default.

        Host inputs (numpy arrays, lists, CPU tensors) are checked on the host and reach the
        device together in one non-blocking copy; tensors already on the device are used where
        they are (checking device ``positions`` without a mask costs a synchronisation).
        """
        ids = self._host_or_device(input_ids, np.int64)
        positions = self._host_or_device(positions, np.int64)
        T = ids.shape[0]
        if positions.shape[0] != T:
            raise ValueError(f"positions: expected {T} positions, one per input token, got {positions.shape[0]}")
        if attn_mask is None:
            start = positions if isinstance(positions, np.ndarray) else positions.cpu().numpy()
            cache_len = int(start[0]) if T else 0
            if not np.array_equal(start, np.arange(cache_len, cache_len + T)):
                raise ValueError("positions: without attn_mask the tokens must continue the cache at consecutive positions")
            attn_mask = np.tri(T, cache_len + T, k=cache_len, dtype=bool)
        mask = self._host_or_device(attn_mask, np.bool_, flat=False)
        cache_len = mask.shape[-1] - T
        if mask.ndim != 2 or mask.shape[0] != T or cache_len < 0:
            raise ValueError(f"attn_mask: expected shape [{T}, cache_len + {T}], got {list(mask.shape)}")
        if cache_len + T > self.max_seq_len:
            raise ValueError(f"KV cache: {cache_len} cached + {T} new tokens exceed its {self.max_seq_len} slots")
        rows = None if logits_rows is None else self._host_or_device(logits_rows, np.int64)
        ids, positions, rows, mask = self._upload(ids, positions, rows, mask)
        additive_mask = self._additive_mask(mask, positions, cache_len)
        if self._slot_positions is not None:
            self._slot_positions[cache_len:cache_len + T] = positions

        cos, sin = self.rope(positions)

        self.offload.begin_pass()
        x = self.embed_tokens(ids)
        captured: dict[int, torch.Tensor] = {}
        routing = []
        for index, layer in enumerate(self.layers):
            if index in self.capture_layers:
                captured[index] = x
            x, expert_ids = layer(x, cos, sin, cache_len, additive_mask)
            if expert_ids is not None:
                routing.append(expert_ids)
        if len(self.layers) in self.capture_layers:
            captured[len(self.layers)] = x
        x = self.norm(x)
        if rows is not None:
            x = x[rows]
        hidden = torch.cat([captured[layer] for layer in self.capture_layers], dim=-1) if self.capture_layers else None
        return ForwardOutput(logits=self.lm_head(x), expert_ids=np.stack(routing, axis=1), hidden=hidden,
                             offload=self.offload.counters)

    def _host_or_device(self, values, dtype, flat: bool = True):
        """A numpy array of ``dtype`` for host values (tensors on the CPU, arrays, lists, including
        a DraftTree's read-only arrays), or the tensor itself, converted, if it is on a device."""
        if isinstance(values, torch.Tensor):
            if values.device.type != "cpu":
                return values.to(device=self.device, dtype=_TORCH_DTYPES[np.dtype(dtype)]).reshape(
                    (-1,) if flat else values.shape)
            values = values.detach().numpy()
        values = np.asarray(values).astype(dtype, copy=False)
        return values.reshape(-1) if flat else values

    def _upload(self, *values):
        """Host arrays among ``values`` on the device in one non-blocking copy: packed into one
        byte buffer (8-byte integers first, so every view stays aligned), viewed back apart."""
        host = sorted((i for i, v in enumerate(values) if isinstance(v, np.ndarray)),
                      key=lambda i: -values[i].itemsize)
        if not host:
            return values
        blob = upload(np.concatenate([np.ascontiguousarray(values[i]).reshape(-1).view(np.uint8) for i in host]),
                      self.device)
        out, offset = list(values), 0
        for i in host:
            array = values[i]
            out[i] = blob[offset:offset + array.nbytes].view(_TORCH_DTYPES[array.dtype]).view(array.shape)
            offset += array.nbytes
        return out

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's (cos, sin) at ``positions``: float32 angles whatever the compute dtype, applied in
        it (MLA also rotates in float32, as transformers does)."""
        return self.rotary.cos_sin(positions, torch.float32 if self.config.mla else self.dtype)

    def _additive_mask(self, attn_mask: torch.Tensor, positions: torch.Tensor, cache_len: int) -> torch.Tensor:
        window = self.config.sliding_window
        if window is not None:
            # a key is visible only within the window of the query's position; cached slots hold
            # the positions they were written at, new tokens their given positions
            key_positions = torch.cat((self._slot_positions[:cache_len], positions))
            attn_mask = attn_mask & (positions[:, None] - key_positions[None, :] < window)
        # 0 / finfo.min in the compute dtype, as transformers builds its eager masks
        return torch.zeros(attn_mask.shape, dtype=self.dtype, device=self.device).masked_fill(
            ~attn_mask, torch.finfo(self.dtype).min)

    def compact_kv(self, cache_len: int, keep) -> None:
        """Keep the new tokens ``keep`` (indices into the last pass's T tokens, ascending) at
        slots ``cache_len .. cache_len + len(keep) - 1``; later slots become free."""
        if self._kv_host is not None and not (isinstance(keep, torch.Tensor) and keep.device.type != "cpu"):
            # on the host: one compiled call checks and moves every layer's entries in place
            # (numpy's or torch's indexing costs several times more at these sizes: benchmarks/RESULTS.md,
            # "Stop 26: what removing calls from the live cycle buys")
            status = kernels.kv.compact(self._kv_host, int(cache_len), self._host_or_device(keep, np.int64))
            if status != kernels.kv.OK:
                self._refuse_keep(cache_len, outside=status == kernels.kv.OUT_OF_RANGE)
        else:
            self._compact_kv_tensors(cache_len, keep)
        if self._slot_positions is not None:
            # the kept tokens' positions move with their keys (after the checks above)
            keep = self._host_or_device(keep, np.int64)
            slots = upload(keep + cache_len, self.device) if isinstance(keep, np.ndarray) else keep + cache_len
            self._slot_positions[cache_len:cache_len + slots.numel()] = self._slot_positions[slots]

    def _refuse_keep(self, cache_len: int, outside: bool):
        """The one error of a ``keep`` that is not ascending or (``outside``) reaches outside the
        cache: both paths check it before they move anything."""
        raise ValueError(f"keep: expected indices of the new tokens within the cache's {self.max_seq_len} slots "
                         f"after cache_len {cache_len}" if outside else "keep: expected ascending indices of the new tokens")

    @torch.inference_mode()
    def _compact_kv_tensors(self, cache_len: int, keep) -> None:
        keep = self._host_or_device(keep, np.int64)
        if isinstance(keep, np.ndarray):
            status = kernels.kv.check(int(cache_len), keep, self.max_seq_len)
            if status != kernels.kv.OK:
                self._refuse_keep(cache_len, outside=status == kernels.kv.OUT_OF_RANGE)
            # ascending from 0: once an entry is not in its own slot, none after it is; the ones
            # before it stay where they are
            first = int(np.count_nonzero(keep == np.arange(keep.size)))
            if first == keep.size:
                return
            start, slots = cache_len + first, upload(keep[first:] + cache_len, self.device)
        else:
            if keep.numel():
                # one read back of both checks (each a device sync)
                ascending, inside = torch.stack([(keep[1:] > keep[:-1]).all(), (keep[0] >= 0) & (
                    keep[-1] + cache_len < self.max_seq_len)]).tolist()
                if not ascending or not inside or cache_len < 0:
                    self._refuse_keep(cache_len, outside=ascending)    # ascending: the range is what failed
            start, slots = cache_len, keep + cache_len
        if self._kv_storage is not None:
            storage = self._kv_storage
            storage[:, :, :, start:start + slots.numel()] = storage.index_select(3, slots)
            return
        for layer in self.layers:
            layer.self_attn.kv_cache.compact(start, slots)
