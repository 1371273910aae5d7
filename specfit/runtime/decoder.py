"""Greedy decoding on the target model, one cycle at a time.

A cycle is the unit both autoregressive and speculative decoding share:

    draft  -> a :class:`~specfit.tree.DraftTree` whose root is the last committed token
    select -> the ancestor-closed nodes to verify (a policy's choice)
    verify -> one target pass over those nodes with a tree mask and per-node positions
    commit -> greedy acceptance (longest matching path), KV compaction, the bonus token

:class:`Decoder` is the autoregressive case: the tree is the root alone, so every cycle commits
exactly the target's next token. The speculative decoder extends it by overriding :meth:`draft`
and :meth:`select` (a drafter and a policy from :mod:`specfit.policies`); :meth:`verify`,
:meth:`commit`, the stopping rules and the accounting stay here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..tree import DraftTree
from .model import MoETransformer, causal_mask
from .offload import OffloadCounters

__all__ = ["Decoder", "DecodeResult", "Verification"]


@dataclass
class Verification:
    """The target's verdicts on the verified nodes of a tree.

    ``nodes`` are the verified node ids (sorted, with the root); ``verdicts[i]`` is the target's
    greedy next token after ``nodes[i]``; ``expert_ids[i, layer, k]`` its true experts.
    """

    nodes: np.ndarray
    verdicts: np.ndarray
    expert_ids: np.ndarray
    hidden: torch.Tensor | None
    offload: OffloadCounters
    verify_time_s: float


@dataclass
class DecodeResult:
    """One prompt's generation. Counters cover every target pass, prefill included;
    ``decode_bytes_h2d`` only the passes after the prefill."""

    prompt_ids: list[int]
    output_ids: list[int]
    stop_reason: str                  # "eos", or "length" when max_new_tokens was reached
    prefill_time_s: float
    decode_time_s: float
    n_cycles: int
    offload: OffloadCounters
    decode_bytes_h2d: int
    cycle_tokens: list[int] = field(default_factory=list)   # tokens committed by each decode cycle

    @property
    def tokens_per_s(self) -> float:
        """Decode-phase throughput: tokens committed by the cycles after the prefill per second."""
        committed = sum(self.cycle_tokens)
        return committed / self.decode_time_s if self.decode_time_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": len(self.prompt_ids),
            "output_ids": list(self.output_ids),
            "n_new_tokens": len(self.output_ids),
            "stop_reason": self.stop_reason,
            "prefill_time_s": self.prefill_time_s,
            "decode_time_s": self.decode_time_s,
            "decode_tokens": sum(self.cycle_tokens),
            "tokens_per_s": self.tokens_per_s,
            "n_cycles": self.n_cycles,
            "bytes_h2d": self.offload.total_bytes_h2d,
            "decode_bytes_h2d": self.decode_bytes_h2d,
            "hits": self.offload.total_hits,
            "misses": self.offload.total_misses,
            "hit_rate": self.offload.hit_rate,
        }


class Decoder:
    """Greedy autoregressive decoding of ``model``.

    Args:
        model: the loaded target (with its expert offload attached).
        eos_token_ids: generation stops after committing one of these (unless ``ignore_eos``).
    """

    def __init__(self, model: MoETransformer, eos_token_ids=()):
        self.model = model
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.cache_len = 0          # committed tokens whose K/V are in the cache

    # ------------------------------------------------------------------ generation
    def generate(self, prompt_ids, max_new_tokens: int, ignore_eos: bool = False) -> DecodeResult:
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ValueError("prompt_ids: expected at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected >= 1, got {max_new_tokens}")
        self._ensure_kv_slots(len(prompt_ids) + max_new_tokens + self.extra_kv_slots())
        totals = OffloadCounters.zeros(self.model.config.n_layers)

        start = _now(self.model.device)
        root, prefill_counters = self.prefill(prompt_ids)
        prefill_time_s = _now(self.model.device) - start
        totals += prefill_counters

        output, cycle_tokens = [root], []
        stop_reason = "eos" if self._is_eos(root, ignore_eos) else "length"
        decode_bytes_h2d = 0
        start = _now(self.model.device)
        while stop_reason != "eos" and len(output) < max_new_tokens:
            tree = self.draft(root)
            verification = self.verify(tree, self.select(tree))
            committed = self.commit(tree, verification)
            totals += verification.offload
            decode_bytes_h2d += verification.offload.total_bytes_h2d
            committed = committed[: max_new_tokens - len(output)]
            for i, token in enumerate(committed):
                if self._is_eos(token, ignore_eos):
                    committed = committed[: i + 1]
                    stop_reason = "eos"
                    break
            output.extend(committed)
            cycle_tokens.append(len(committed))
            root = committed[-1]
        decode_time_s = _now(self.model.device) - start
        return DecodeResult(prompt_ids=prompt_ids, output_ids=output, stop_reason=stop_reason,
                            prefill_time_s=prefill_time_s, decode_time_s=decode_time_s, n_cycles=len(cycle_tokens),
                            offload=totals, decode_bytes_h2d=decode_bytes_h2d, cycle_tokens=cycle_tokens)

    def prefill(self, prompt_ids: list[int]) -> tuple[int, OffloadCounters]:
        """Run the prompt; return the first generated token. The prompt's K/V stay cached."""
        n = len(prompt_ids)
        out = self.model(prompt_ids, np.arange(n), causal_mask(0, n), logits_rows=[n - 1])
        self.cache_len = n
        return int(out.logits[-1].argmax()), out.offload

    # ------------------------------------------------------------------ one cycle
    def extra_kv_slots(self) -> int:
        """KV slots a cycle may need beyond the committed tokens (the verified nodes but the root)."""
        return 0

    def draft(self, root_token: int) -> DraftTree:
        """The cycle's draft tree; autoregressive decoding drafts nothing."""
        return DraftTree(parents=np.array([-1]), path_probs=np.array([1.0]), tokens=np.array([root_token]))

    def select(self, tree: DraftTree) -> np.ndarray:
        """The node ids to verify; autoregressive decoding verifies the whole (root-only) tree."""
        return np.arange(tree.n_nodes)

    def verify(self, tree: DraftTree, nodes) -> Verification:
        """One target pass over ``nodes`` (ancestor-closed, with the root), written to the KV
        slots after the committed tokens in node order."""
        nodes = np.asarray(nodes, dtype=np.int64)
        prefix_mask = np.ones((nodes.size, self.cache_len), dtype=bool)
        mask = np.concatenate([prefix_mask, tree.attention_mask(nodes)], axis=1)
        start = _now(self.model.device)
        out = self.model(tree.tokens[nodes], tree.positions(self.cache_len, nodes), torch.from_numpy(mask))
        verdicts = out.logits.argmax(dim=-1).cpu().numpy()
        return Verification(nodes=nodes, verdicts=verdicts, expert_ids=out.expert_ids, hidden=out.hidden,
                            offload=out.offload, verify_time_s=_now(self.model.device) - start)

    def commit(self, tree: DraftTree, verification: Verification) -> list[int]:
        """Accept the longest verified path that matches the target, keep its K/V, and return the
        committed tokens: the accepted draft tokens, then the bonus token."""
        verdicts = np.full(tree.n_nodes, -1, dtype=np.int64)
        verdicts[verification.nodes] = verification.verdicts
        path = tree.accepted_path(verdicts, verification.nodes)
        keep = np.searchsorted(verification.nodes, path)         # path nodes' indices in the pass
        if keep.size != verification.nodes.size:                 # otherwise the slots are already in place
            self.model.compact_kv(self.cache_len, keep)
        self.cache_len += keep.size
        return [int(t) for t in tree.tokens[path[1:]]] + [int(verdicts[path[-1]])]

    # ------------------------------------------------------------------ helpers
    def _is_eos(self, token: int, ignore_eos: bool) -> bool:
        return not ignore_eos and token in self.eos_token_ids

    def _ensure_kv_slots(self, n_slots: int) -> None:
        if self.model.max_seq_len < n_slots:
            self.model.setup_kv_cache(n_slots)


def _now(device: torch.device) -> float:
    """Wall-clock seconds, after the device has finished the work queued so far."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
