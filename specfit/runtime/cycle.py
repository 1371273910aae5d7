"""The values one decode cycle's stages hand each other (:mod:`specfit.runtime.decoder`): a
:class:`Draft`, a :class:`Verification`, a :class:`Commit`, the cycle's :class:`CycleStats`, and a
prompt's :class:`DecodeResult`."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..costmodel import CostModel
from ..search import Selection
from ..tree import DraftTree
from .offload import OffloadCounters

__all__ = ["Draft", "Verification", "Commit", "CycleStats", "DecodeResult"]


@dataclass
class Draft:
    """A cycle's draft phase: what the policy saw, what it chose, what drafting cost."""

    tree: DraftTree                 # every drafted node, in drafting order (root alone without drafting)
    experts: np.ndarray             # int [n, L, k] predicted experts of every node
    edge_logprob: np.ndarray        # float64 [n] the drafter's log p(node | parent), root 0
    nodes: np.ndarray               # the nodes to verify (sorted, with the root)
    selection: Selection | None     # the policy's choice and its prediction (None without a cost model)
    cached: np.ndarray | None = None  # bool [L, E] the expert cache's residency the policy's last decision saw
    cost: CostModel | None = None   # the cost model the policy decided with (the online one when refitting)
    draft_levels: int = 0
    drafter_time_s: float = 0.0     # the drafter's forward passes
    search_time_s: float = 0.0      # the policy's decisions (keep drafting? which nodes?)
    predict_time_s: float = 0.0     # expert predictions for the drafted nodes
    prefetched: int = 0             # experts copied ahead of the pass while levels were drafted
    prefetch_copy_s: float = 0.0    # their copy time (beside the drafter)
    prefetch_wait_s: float = 0.0    # the part of it the verification pass had to wait for
    phase_s: float = 0.0            # the draft phase itself: drafting, decisions, predictions, views
    last_known: np.ndarray | None = None   # [L, k] the routing the predictions saw as most recent
    last_known_rows: np.ndarray | None = None   # [max nodes, L, k] it, once per node the tree can hold
    contexts: list = field(default_factory=list)   # per level: the drafter context rows of its nodes (root: NaN)
    # the drafter's own path probabilities where the tree's are calibrated (None: the tree's are the drafter's)
    drafter_probs: np.ndarray | None = None


@dataclass
class Verification:
    """The target's verdicts on the verified nodes of a tree.

    ``nodes`` are the verified node ids (sorted, with the root); ``verdicts[i]`` is the target's
    greedy next token after ``nodes[i]``, ``logits[i]`` its logits there; ``expert_ids[i, layer,
    k]`` its true experts; ``hidden[i]`` its captured features (EAGLE-3's drafter input). A cycle a
    generation keeps (:attr:`DecodeResult.cycles`) no longer holds its logits and features: the
    commit used them.
    """

    nodes: np.ndarray
    verdicts: np.ndarray
    logits: torch.Tensor | None
    expert_ids: np.ndarray
    hidden: torch.Tensor | None
    offload: OffloadCounters
    target_time_s: float          # the target pass
    transfer_time_s: float        # how long it waited for host-to-device copies (the exposed stall)


@dataclass
class Commit:
    """What a cycle committed: the accepted path (node ids from the root), its rows in the
    verification pass, and the tokens (accepted draft tokens, then the bonus token)."""

    path: np.ndarray
    rows: np.ndarray
    tokens: list[int]
    # sampling: the drafted children of the path's nodes and the chance the walk accepts each there
    edges: tuple[np.ndarray, np.ndarray] | None = None


@dataclass
class CycleStats:
    """Measurements of one decode cycle, next to what the policy predicted for it
    (:mod:`specfit.accounting` turns it into a row of the one per-cycle schema)."""

    position: int                  # index of the cycle's root in the output
    draft: Draft
    verification: Verification
    committed_tokens: int          # accepted draft tokens + the bonus token
    draft_time_s: float            # from the cycle's start (the previous cycle's learning done) to the selection
    verify_time_s: float           # from the selection to the committed tokens (target pass, acceptance, KV)
    path: np.ndarray | None = None  # the accepted path's node ids, from the root
    edges: tuple[np.ndarray, np.ndarray] | None = None   # sampling: Commit.edges
    predicted_slots: int = 0       # (layer, rank) slots predicted for verified draft nodes
    predicted_slots_right: int = 0  # ... naming an expert the node really routed to
    learn_time_s: float = 0.0      # after the commit: the policy and the predictor learn
    update_time_s: float = 0.0     # at the start (in draft_time_s): the online cost model's update
    cpu_time_s: float = float("nan")   # CPU time of the decoding thread over the cycle
    # wall time the decoding thread did not run (measured minus its CPU time and its wait for the
    # prefetch copies), where that thread does the cycle's work (a CPU device with one torch
    # thread); NaN elsewhere
    waited_s: float = float("nan")
    online: bool = False           # the policy decided with the online-refitted cost model
    # int [L]: misses the expert cache's bookkeeping gives the true experts from the residency before
    # the cycle (what the cost model charges, checked against what the offload moved)
    charged_misses_per_layer: np.ndarray | None = None
    # int [5, L]: the true and predicted unions per layer, their overlap, and each one's misses
    # against the residency the policy saw (rows of specfit.kernels.evaluate.union_accounting);
    # None without a prediction
    union_counts: np.ndarray | None = None

    @property
    def cycle_time_s(self) -> float:
        return self.draft_time_s + self.verify_time_s + self.learn_time_s

    @property
    def offload(self) -> OffloadCounters:
        return self.verification.offload


@dataclass
class DecodeResult:
    """One prompt's generation. ``offload`` counts every target pass, the prompt's included;
    ``prefill_offload`` the prompt's passes alone (one per prefill chunk); ``decode_bytes_h2d`` the decode cycles' copies
    (their passes' and the prefetched experts')."""

    prompt_ids: list[int]
    output_ids: list[int]
    stop_reason: str                  # "eos", or "length" when max_new_tokens was reached
    prefill_time_s: float             # the target's prompt passes and, with a drafter, its passes over the prompt
    decode_time_s: float
    n_cycles: int
    offload: OffloadCounters
    decode_bytes_h2d: int
    prefill_offload: OffloadCounters
    cycle_tokens: list[int] = field(default_factory=list)   # tokens each decode cycle added to the output
    cycles: list[CycleStats] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        """Decode-phase throughput: tokens committed by the cycles after the prefill per second
        (NaN without a decode cycle: the output ended at the prefill's token)."""
        committed = sum(self.cycle_tokens)
        return committed / self.decode_time_s if self.decode_time_s > 0 and self.n_cycles else float("nan")

    @property
    def decode_offload(self) -> OffloadCounters:
        """The decode cycles' passes: every pass less the prompt's."""
        return self.offload - self.prefill_offload

    def to_dict(self) -> dict:
        """The run's ``decode.jsonl`` record. ``bytes_h2d``, ``hits``, ``misses`` and ``hit_rate``
        cover the prompt's pass and the decode cycles (``bytes_h2d`` with the prefetched
        experts); the ``decode_`` fields and ``tokens_per_s`` the decode cycles alone."""
        decode = self.decode_offload
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
            "bytes_h2d": self.prefill_offload.total_bytes_h2d + self.decode_bytes_h2d,
            "decode_bytes_h2d": self.decode_bytes_h2d,
            "hits": self.offload.total_hits,
            "misses": self.offload.total_misses,
            "hit_rate": self.offload.hit_rate,
            "decode_hits": decode.total_hits,
            "decode_misses": decode.total_misses,
            "decode_hit_rate": decode.hit_rate,
        }
