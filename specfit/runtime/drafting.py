"""Tree drafting, level by level, for any drafter: the drafter's session state and EAGLE-2/3
dynamic-tree expansion.

A drafter (an EAGLE-3 head, :mod:`specfit.runtime.eagle3`, or an independent draft model,
:mod:`specfit.runtime.draft_model`) is called with ``(hidden, input_ids, positions, mask)`` over
its own KV cache and returns a :class:`DraftOutput`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..tree import DraftTree

__all__ = ["DraftOutput", "DrafterSession", "DynamicTree"]


@dataclass
class DraftOutput:
    """One drafter call over T entries.

    Attributes:
        logits: [T, draft_vocab_size]; map an argmax ``i`` to a target token with ``draft_ids[i]``.
        hidden: [T, H], the layer's output before the final norm: the hidden input of a child.
    """

    logits: torch.Tensor
    hidden: torch.Tensor


class DrafterSession:
    """The drafter's state for one sequence: the committed entries in its KV cache.

    Entry ``i`` pairs the target's features at position ``i`` with the token that followed,
    ``x[i + 1]``, at drafter position (and slot) ``i``. :meth:`commit` appends entries for target
    positions the target has just processed (overwriting the slots that draft entries used), and
    returns the output of the newest entry, whose distribution drafts the first level.
    """

    def __init__(self, drafter, max_entries: int):
        self.drafter = drafter
        if drafter.max_seq_len < max_entries:
            drafter.setup_kv_cache(max_entries)
        self.n_committed = 0

    def commit(self, features: torch.Tensor, next_tokens) -> DraftOutput:
        """Entries for the next ``n`` target positions: ``features`` [n, 3 * H_target], and
        ``next_tokens`` [n], the token after each position (the last one is the new root)."""
        n = features.shape[0]
        positions = torch.arange(self.n_committed, self.n_committed + n)
        out = self.drafter(features, next_tokens, positions)
        self.n_committed += n
        return DraftOutput(logits=out.logits[-1:], hidden=out.hidden[-1:])


class DynamicTree:
    """EAGLE-2/3 dynamic tree drafting, one level at a time.

    Level 1 is the top-``top_k`` of the root entry's distribution. Each :meth:`grow` runs the
    current frontier (the ``top_k`` nodes of the newest level with the best cumulative
    log-probability) through the drafter in one call — tree mask: the committed entries, the
    node's ancestors, itself; position: root position + depth — and scores ``top_k`` children of
    each; the best ``top_k`` children become the next frontier. :meth:`tree` reranks every drafted
    node by cumulative log-probability and keeps the best; the result is connected because a
    child never outscores its parent. A chain of depth d is ``top_k=1`` grown to d levels.
    """

    def __init__(self, session: DrafterSession, root_token: int, root_output: DraftOutput, top_k: int):
        if top_k < 1:
            raise ValueError(f"top_k: expected >= 1, got {top_k}")
        self.session, self.top_k = session, top_k
        self.tokens = [int(root_token)]
        self.parents = [-1]
        self.log_probs = [0.0]                  # cumulative, root -> node (float64)
        self.depths = [0]
        self.output_hidden: dict[int, torch.Tensor] = {}   # node -> drafter output (its children's input)
        self.slot: dict[int, int] = {}          # node -> KV slot of its entry (expanded nodes only)
        self.frontier = self._add_children([0], root_output)

    @property
    def n_levels(self) -> int:
        return max(self.depths)

    def grow(self) -> np.ndarray:
        """Draft one more level; return the node ids of its frontier."""
        frontier, committed = self.frontier, self.session.n_committed
        cache_len = committed + len(self.slot)
        mask = torch.zeros(len(frontier), cache_len + len(frontier), dtype=torch.bool)
        mask[:, :committed] = True
        for row, node in enumerate(frontier):
            mask[row, cache_len + row] = True
            ancestor = self.parents[node]
            while ancestor > 0:
                mask[row, self.slot[ancestor]] = True
                ancestor = self.parents[ancestor]
            self.slot[node] = cache_len + row
        hidden = torch.stack([self.output_hidden[self.parents[node]] for node in frontier])
        # the root entry sits at position committed - 1, so a depth-d node at committed - 1 + d
        positions = torch.tensor([committed - 1 + self.depths[node] for node in frontier])
        tokens = torch.tensor([self.tokens[node] for node in frontier])
        self.frontier = self._add_children(frontier, self.session.drafter(hidden, tokens, positions, mask))
        return self.frontier

    def tree(self, max_nodes: int | None = None) -> DraftTree:
        """The best ``max_nodes`` nodes drafted so far (root included; all by default)."""
        n = len(self.tokens)
        keep = n if max_nodes is None else max(1, min(max_nodes, n))
        if keep == n:
            # every node, in creation (level) order: called after each level while drafting
            return DraftTree(parents=np.array(self.parents, dtype=np.int64), path_probs=np.exp(self.log_probs),
                             tokens=np.array(self.tokens, dtype=np.int64))
        # best cumulative log-prob first; ties keep creation order, so parents precede children
        best = sorted(range(1, n), key=lambda v: (-self.log_probs[v], v))[: keep - 1]
        nodes = np.array(sorted([0] + best), dtype=np.int64)
        renumber = np.full(n, -1, dtype=np.int64)
        renumber[nodes] = np.arange(nodes.size)
        parents = np.array([-1] + [renumber[self.parents[v]] for v in nodes[1:]], dtype=np.int64)
        return DraftTree(parents=parents, path_probs=np.exp(np.array(self.log_probs)[nodes]),
                         tokens=np.array(self.tokens, dtype=np.int64)[nodes])

    def _add_children(self, expanded: list[int] | np.ndarray, out: DraftOutput) -> np.ndarray:
        """Record the outputs of the ``expanded`` nodes, add their top-k children, return the
        next frontier (the top_k children by cumulative log-prob)."""
        # clamp: a float32 log-softmax can round a certain token to a tiny positive value, and
        # path probabilities must not increase along a path
        log_probs = F.log_softmax(out.logits.float(), dim=-1).clamp(max=0.0)
        top_lp, top_ids = log_probs.topk(min(self.top_k, log_probs.shape[-1]), dim=-1)
        target_ids = self.session.drafter.to_target_ids(top_ids).tolist()
        children = []
        for row, parent in enumerate(expanded):
            parent = int(parent)
            self.output_hidden[parent] = out.hidden[row]
            for token, lp in zip(target_ids[row], top_lp[row].double().tolist()):
                self.tokens.append(token)
                self.parents.append(parent)
                self.log_probs.append(self.log_probs[parent] + lp)
                self.depths.append(self.depths[parent] + 1)
                children.append(len(self.tokens) - 1)
        children.sort(key=lambda v: (-self.log_probs[v], v))
        return np.array(sorted(children[: self.top_k]), dtype=np.int64)
