"""Drafting: the proposer stage of speculative decoding, for any drafter.

A drafter (an EAGLE-3 head, :mod:`specfit.runtime.eagle3`, or an independent draft model,
:mod:`specfit.runtime.draft_model`) is called as ``drafter(hidden, input_ids, positions, mask)``
over its own KV cache and returns a :class:`DraftOutput`. This module owns what is the same for
every drafter:

- :class:`DrafterSession`: the drafter's committed entries for one sequence. Entry ``i`` pairs the
  target's features at position ``i`` with the token that followed, ``x[i + 1]``, at drafter
  position (and slot) ``i``;
- :class:`TreeDraft`: EAGLE-2/3 dynamic-tree drafting of one cycle, one level per :meth:`TreeDraft.grow`,
  in flat arrays (tokens, parents, cumulative log-probabilities, depths) whose every prefix is the
  tree drafted so far; the decoder hands each :meth:`TreeDraft.tree` to the policy;
- :class:`Proposer`: a drafter with its session and the accepted entries not yet run through it
  (EAGLE-3 re-runs the accepted tokens with the target's features, lazily, when the next cycle
  drafts its first level: a cycle that drafts nothing never pays for it). The prompt's entries
  are run in the prefill, all but the last, which the first cycle runs as any cycle runs its
  accepted ones.

The tree is expanded as EAGLE-2/3 does: level 1 is the top-``k`` of the root entry's distribution;
each further level runs the current frontier (the ``k`` nodes of the newest level with the best
cumulative log-probability) through the drafter in one call — tree mask: the committed entries,
the node's ancestors, itself; position: root position + depth — and scores ``k`` children of each.
Which nodes to verify is the policy's choice (:mod:`specfit.policies`, whose ``RerankPolicy`` is
EAGLE's rerank). A chain is ``k = 1``.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .. import kernels
from ..errors import SpecFitError
from ..tree import DraftTree
from .prefill import prefill_chunks

__all__ = ["DraftOutput", "DrafterSession", "TreeDraft", "Level", "Proposer", "tree_capacity"]

# On a GPU a drafter pass over a number of entries it has not run before is slow (a level after a
# gap of undrafted cycles took several times what a repeated length took: benchmarks/RESULTS.md,
# "The GPU run again, and a drafter pass's first use", which times each length), and the
# cost model prices every level alike: the first sequence runs the drafter once at each catch-up
# length up to this many entries per device type, off the clock (none on the CPU, where no such
# cost was seen).
WARM_LENGTHS = {"cuda": 32}
_NEWEST = [-1]            # the rows whose logits a pass over committed entries computes
_warmed: "weakref.WeakKeyDictionary[torch.nn.Module, int]" = weakref.WeakKeyDictionary()


@dataclass
class DraftOutput:
    """One drafter call over T entries.

    Attributes:
        logits: [T, draft_vocab_size]; map an argmax ``i`` to a target token with the drafter's
            ``to_target_ids``.
        hidden: [T, H], the layer's output before the final norm: the hidden input of a child
            (width 0 for a drafter that feeds nothing back).
    """

    logits: torch.Tensor
    hidden: torch.Tensor


def tree_capacity(top_k: int, levels: int) -> int:
    """Nodes of a dynamic tree after ``levels`` levels, root included: ``top_k`` children of the
    root, then ``top_k`` children of each of the ``top_k`` expanded nodes per level."""
    return 1 + (top_k + (levels - 1) * top_k * top_k if levels > 0 else 0)


class DrafterSession:
    """The drafter's state for one sequence: its committed entries.

    :meth:`commit` appends entries for target positions the target has just processed
    (overwriting the slots that draft entries used) and returns the output of the newest entry,
    whose distribution drafts the first level.
    """

    def __init__(self, drafter, max_entries: int):
        self.drafter = drafter
        if drafter.max_seq_len < max_entries:
            drafter.setup_kv_cache(max_entries)
        self.n_committed = 0
        self._target_ids: np.ndarray | None = None

    def target_ids(self, draft_vocab_size: int) -> np.ndarray:
        """int64 [draft_vocab_size]: the target's id of every draft-vocabulary id (the drafter's
        ``to_target_ids``, as a host table made once)."""
        if self._target_ids is None or self._target_ids.size != draft_vocab_size:
            ids = torch.arange(draft_vocab_size, device=self.drafter.device)
            self._target_ids = np.ascontiguousarray(self.drafter.to_target_ids(ids).cpu().numpy(), dtype=np.int64)
        return self._target_ids

    def commit(self, features: torch.Tensor, next_tokens) -> DraftOutput:
        """Entries for the next ``n`` target positions: ``features`` [n, 3 * H_target], and
        ``next_tokens`` [n], the token after each position (the last one is the new root)."""
        n = features.shape[0]
        positions = torch.arange(self.n_committed, self.n_committed + n)
        # the newest entry's logits alone: the head over the draft vocabulary is most of a
        # drafter's work, and a prompt's pass would otherwise run it over every prompt token
        out = self.drafter(features, next_tokens, positions, logits_rows=_NEWEST)
        self.n_committed += n
        return DraftOutput(logits=out.logits[-1:], hidden=out.hidden[-1:])


@dataclass(frozen=True)
class Level:
    """The nodes one :meth:`TreeDraft.grow` added, ids ``first .. first + size - 1``.

    ``context`` [size, H] is the drafter's output at each new node's parent (what the router
    predictor reads), on the drafter's device.
    """

    first: int
    tokens: np.ndarray
    parents: np.ndarray
    context: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.tokens.size)


class TreeDraft:
    """One cycle's dynamic tree, drafted level by level into preallocated arrays.

    Args:
        session: the drafter's committed entries (the tree's entries go after them).
        root_token: the cycle's root (the last committed token).
        root_output: a callable returning the root entry's :class:`DraftOutput`, called when level
            1 is drafted (the proposer runs the pending accepted entries then).
        top_k: children per expanded node and nodes expanded per level.
        max_levels: levels at most (sizes the arrays).
        acceptance: an acceptance calibrator (:class:`~specfit.experts.calibration.AcceptanceCalibrator`:
            its edge map, confidence refinement and depth correction give each node's path
            probability, as on a trace);
            None uses the drafter's own probabilities.
    """

    def __init__(self, session: DrafterSession, root_token: int, root_output: Callable[[], DraftOutput], top_k: int,
                 max_levels: int, acceptance=None):
        if top_k < 1:
            raise ValueError(f"top_k: expected >= 1, got {top_k}")
        self.session, self.top_k, self._root_output, self._acceptance = session, int(top_k), root_output, acceptance
        capacity = tree_capacity(self.top_k, max(int(max_levels), 1))
        # two allocations per cycle (rows of one integer and one float block), not seven
        ints, floats = np.zeros((4, capacity), dtype=np.int64), np.zeros((3, capacity), dtype=np.float64)
        self.tokens, self.parents, self.depth, self.slot = ints
        self.parents[0] = self.slot[0] = -1                       # slot: KV slot of an expanded node's entry
        self.cum_logprob, self.path_prob, self.edge_product = floats
        # cum_logprob: the drafter's, root -> node; path_prob: the acceptance estimate the policy
        # uses; edge_product: calibrated edges multiplied, root -> node (the root's two are 1)
        self.path_prob[0] = self.edge_product[0] = 1.0
        self.tokens[0] = int(root_token)
        self.n_nodes, self.levels = 1, 0
        self.frontier = np.zeros(0, dtype=np.int64)
        # the newest level's parents' drafter outputs (one row per expanded node, its children
        # contiguous after _first, _width per node): the hidden input of the next frontier
        self._parent_hidden: torch.Tensor | None = None
        self._first, self._width = 1, 1
        self._n_slots = 0
        self.calibration_s = 0.0     # seconds of the acceptance calibration within grow(): not drafting

    def grow(self) -> Level:
        """Draft one more level; return its nodes."""
        if self.levels == 0:
            expanded = np.zeros(1, dtype=np.int64)
            out = self._root_output()
        else:
            expanded = self.frontier
            out = self.session.drafter(*self._frontier_inputs(expanded))
        level = self._add_children(expanded, out)
        self.levels += 1
        return level

    def tree(self) -> DraftTree:
        """Every node drafted so far, in drafting order (each level extends the previous tree)."""
        n = self.n_nodes
        return DraftTree.grown(self.parents[:n], self.path_prob[:n], self.tokens[:n], self.depth[:n])

    @property
    def edge_logprob(self) -> np.ndarray:
        """float64 [n] the drafter's log-probability of each node given its parent (root: 0)."""
        n = self.n_nodes
        out = np.zeros(n)
        out[1:] = self.cum_logprob[1:n] - self.cum_logprob[self.parents[1:n]]
        return out

    # ------------------------------------------------------------------ helpers
    def _frontier_inputs(self, frontier: np.ndarray):
        """(hidden, tokens, positions, mask) of one drafter call over the frontier: each row sees
        the committed entries, its ancestors' entries and itself."""
        committed = self.session.n_committed
        cache_len = committed + self._n_slots
        mask = kernels.tree.frontier_mask(frontier, self.parents, self.slot, committed, cache_len)
        self._n_slots += frontier.size
        device = self.session.drafter.device
        # each frontier node's parent output: the row of its parent among the newest level's expanded nodes
        rows = torch.from_numpy((frontier - self._first) // self._width)
        hidden = self._parent_hidden[rows.to(self._parent_hidden.device)]
        # the root entry sits at position committed - 1, so a depth-d node at committed - 1 + d
        positions = torch.from_numpy(committed - 1 + self.depth[frontier]).to(device)
        tokens = torch.from_numpy(self.tokens[frontier]).to(device)
        return hidden, tokens, positions, torch.from_numpy(mask).to(device)

    def _add_children(self, expanded: np.ndarray, out: DraftOutput) -> Level:
        """Append the top-k children of each ``expanded`` node; the next frontier is the top_k of
        them by cumulative log-probability (ties: the earlier node)."""
        logits = out.logits.float()
        top_logits, top_ids = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1)
        # log_softmax at the top k alone; clamp: float32 can round a certain token to a tiny
        # positive value, and path probabilities must not increase along a path
        top_lp = (top_logits - torch.logsumexp(logits, dim=-1, keepdim=True)).clamp(max=0.0)
        width = top_ids.shape[-1]
        # one host copy of the level's candidates; the tree's arrays are filled in one compiled call
        edge_lp = top_lp.double().cpu().numpy().ravel()
        first = self.n_nodes
        ok, self.frontier = kernels.tree.add_level(
            expanded, edge_lp, top_ids.cpu().numpy().ravel(), self.session.target_ids(logits.shape[-1]), self.top_k,
            first, self.tokens, self.parents, self.depth, self.cum_logprob, self.path_prob, self._acceptance is None)
        if not ok:
            source = getattr(self.session.drafter, "source", None)
            raise SpecFitError(f"drafter{f' {source}' if source else ''}: NaN probabilities at draft level "
                               f"{self.levels + 1} (its logits hold NaN); expected finite logits (a tensor of the "
                               "checkpoint holds NaN or inf, or the dtype overflows)")
        m = edge_lp.size
        self.n_nodes += m
        self._parent_hidden, self._first, self._width = out.hidden, first, width
        parents = self.parents[first:first + m]
        if self._acceptance is not None:
            # as the calibrator does on a trace: edges multiplied, depth-corrected, never above the parent
            start = time.perf_counter()
            # each expanded node's children are its top-k: the first one's probability is the top
            self._acceptance.calibrate_level(edge_lp, width, np.arange(first, first + m), parents, self.depth,
                                             self.edge_product, self.path_prob)
            self.calibration_s += time.perf_counter() - start
        # each expanded node's output is its children's context, in the level's order
        context = out.hidden.repeat_interleave(width, dim=0)
        return Level(first=first, tokens=self.tokens[first:first + m], parents=parents, context=context)


class Proposer:
    """A drafter as the decoder's proposer: drafts one :class:`TreeDraft` per cycle and keeps its
    session consistent with what the target committed.

    ``context_in_target_space``: the drafter's hidden states estimate the target's (an EAGLE-3
    head as wide as the target), so the router predictor may read them.
    """

    def __init__(self, drafter, top_k: int = 4, warm_lengths: int | None = None):
        if top_k < 1:
            raise ValueError(f"tree_top_k: expected >= 1, got {top_k}")
        self.drafter, self.top_k = drafter, int(top_k)
        device = getattr(getattr(drafter, "device", None), "type", None)
        self.warm_lengths = WARM_LENGTHS.get(device, 0) if warm_lengths is None else int(warm_lengths)
        self.session: DrafterSession | None = None
        self._pending: list[tuple[torch.Tensor, list[int]]] = []   # (features, next tokens) not yet run

    @property
    def context_in_target_space(self) -> bool:
        return getattr(self.drafter, "features_in_target_space", True)

    def start(self, prompt_ids: list[int], features: torch.Tensor, first_token: int, max_entries: int,
              chunk: int = 0) -> None:
        """A new sequence: the prompt's features (from the prefill) pair with the tokens that
        followed them, the last with the prefill's token.

        The drafter runs every prompt entry but the last one now, as the prefill's drafter pass:
        a prompt-length pass in the first cycle would make that cycle unlike every other (its
        cost model prices one pass over the few entries a cycle accepts). The last entry, the
        one whose output drafts the first level, stays pending as a cycle's accepted entries do.
        The prompt's entries run in passes of at most ``chunk`` entries (0: one pass), each over
        the ones before it, as the target's prompt passes do."""
        self.session = DrafterSession(self.drafter, max_entries)
        self._warm_up(features[-1:], int(first_token), max_entries)
        tokens = list(prompt_ids[1:]) + [int(first_token)]
        for start, end in prefill_chunks(len(tokens) - 1, chunk):
            self.session.commit(features[start:end], torch.tensor(tokens[start:end]))
        self._pending = [(features[-1:], tokens[-1:])]

    def draft(self, root_token: int, max_levels: int, top_k: int | None = None, acceptance=None) -> TreeDraft:
        """An empty tree under ``root_token``; :meth:`TreeDraft.grow` drafts its levels."""
        return TreeDraft(self.session, root_token, self._sync, top_k or self.top_k, max_levels, acceptance)

    def accept(self, features: torch.Tensor, tokens: list[int]) -> None:
        """The target committed ``tokens``; ``features`` [len(tokens), F] are its features at the
        accepted nodes (each paired with the token that followed it, the last with the bonus)."""
        self._pending.append((features, list(tokens)))

    def _warm_up(self, feature: torch.Tensor, token: int, max_entries: int) -> None:
        """Run the drafter once over 1, 2, ... ``warm_lengths`` entries (``feature`` and ``token``
        repeated) from slot 0, once per drafter: the slots it writes are the sequence's own, which
        its prompt's pass overwrites before anything reads them."""
        lengths = min(self.warm_lengths, max_entries)
        if lengths <= _warmed.get(self.drafter, 0):
            return
        for n in range(1, lengths + 1):            # as DrafterSession.commit runs them
            self.drafter(feature.expand(n, -1), torch.full((n,), token), torch.arange(n), logits_rows=_NEWEST)
        _warmed[self.drafter] = lengths

    def _sync(self) -> DraftOutput:
        """Run the pending committed entries through the drafter; return the newest entry's output."""
        features = torch.cat([f for f, _ in self._pending])
        tokens = torch.tensor([t for _, ts in self._pending for t in ts])
        self._pending.clear()
        return self.session.commit(features, tokens)
