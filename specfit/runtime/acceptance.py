"""Which verified draft tokens a cycle commits: greedy acceptance and tree speculative sampling.

Greedy (temperature 0): the longest root-to-node path whose every token equals the target's argmax
at its parent (:meth:`~specfit.tree.DraftTree.accepted_path`), then the bonus token, the target's
argmax at the last accepted node.

Sampling (temperature > 0) with a deterministic draft (EAGLE's top-k children, see REFERENCE.md):
at the current node with target distribution ``p``, try its verified children in the drafter's
order; child token ``x`` is accepted with probability ``p(x)``; on rejection ``p(x)`` is set to 0
and ``p`` renormalised before the next child. When a child is accepted the walk moves to it; when
all are rejected (or there are none) the bonus token is drawn from what is left of ``p``. Each
committed token is therefore distributed exactly as the target's own sample at that position: a
point-mass proposal ``x`` accepted with probability ``min(1, p(x) / 1)`` leaves the residual
``p`` with ``x`` removed, which is what the next trial and the bonus draw use.

The walk accepts a child exactly when a sample of ``p`` is its token: the first ``i - 1`` children
(tokens ``x_1 .. x_{i-1}``, mass ``S``) are all rejected with probability ``1 - S`` (the factors
``1 - p(x_j) / (1 - S_{j-1})`` telescope), and the i-th is then accepted with probability
``p(x_i) / (1 - S)``. So a drafted child of a node on the accepted path is accepted there with
probability ``p(x)``, the target's probability of its token at the parent, whatever its siblings
and their order. That is the outcome a policy learns acceptance from when decoding samples
(:func:`sampled_edge_outcomes`), as greedy decoding's is "the token is the parent's argmax".
"""

from __future__ import annotations

import numpy as np
import torch

from .. import kernels
from ..tree import DraftTree

__all__ = ["draw", "greedy_accept", "sample_accept", "sampled_edge_outcomes", "target_probs"]


def target_probs(logits: torch.Tensor, temperature: float) -> np.ndarray:
    """float64 [..., V] softmax of ``logits / temperature`` on the host (float64 so that
    renormalising after many rejections stays exact enough to sample from)."""
    return torch.softmax(logits.float() / temperature, dim=-1).double().cpu().numpy()


def draw(p: np.ndarray, rng: np.random.Generator) -> int:
    """A token drawn from ``p`` (float64, sums to 1), as ``rng.choice(p.size, p=p)`` draws it (its
    cumulative sums, one uniform number, the first bin above it), without the validation of ``p``
    that costs that call most of its time: the same stream gives the same tokens."""
    cdf = p.cumsum()
    cdf /= cdf[-1]
    return int(cdf.searchsorted(rng.random(), side="right"))


def sampled_edge_outcomes(tree: DraftTree, nodes: np.ndarray, path: np.ndarray, logits: torch.Tensor,
                          temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """(drafted nodes whose parent lies on the accepted ``path``, the chance that tree speculative
    sampling accepts each there): the target's probability at ``temperature`` of the node's token
    at its parent (``logits[i]`` are the target's at verified node ``nodes[i]``; sorted, with the
    root). The sampling counterpart of the greedy 0/1 outcomes of
    :func:`specfit.policy_base.edge_outcomes`, with the same nodes: every drafted child of a path
    node, verified or not (a parent's logits price any token)."""
    path = np.asarray(path, dtype=np.int64)
    on_path = np.zeros(tree.n_nodes, dtype=bool)
    on_path[path] = True
    children = np.flatnonzero(on_path[tree.parents[1:]]) + 1
    if children.size == 0:
        return children, np.zeros(0)
    parents = tree.parents[children]
    rows = np.asarray(nodes, dtype=np.int64).searchsorted(path)       # the path nodes' rows in the pass
    probs = target_probs(logits[torch.from_numpy(rows)], temperature)  # [path, V]
    # a path from the root ascends (parents come before their children)
    return children, probs[path.searchsorted(parents), tree.tokens[children]]


def greedy_accept(tree: DraftTree, nodes: np.ndarray, verdicts: np.ndarray) -> tuple[np.ndarray, int]:
    """(accepted path from the root, bonus token) for the target's greedy ``verdicts`` (int64) at
    ``nodes`` (row i is node ``nodes[i]``; sorted, with the root): the decoder's own arrays, so
    the tree's compiled rule is called without :meth:`DraftTree.accepted_path`'s checks."""
    path, bonus = kernels.tree.greedy_path(tree.parents, tree.depth, tree.tokens, nodes, verdicts)
    return path, int(bonus)


def sample_accept(tree: DraftTree, nodes: np.ndarray, logits: torch.Tensor, temperature: float,
                  rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """(accepted path from the root, bonus token) by tree speculative sampling.

    ``logits[i]`` are the target's logits at node ``nodes[i]``; only the rows on the walk are
    turned into probabilities, so a large vocabulary costs one softmax per committed token.
    """
    row_of = np.full(tree.n_nodes, -1, dtype=np.int64)
    row_of[nodes] = np.arange(nodes.size)
    path = [0]
    while True:
        node = path[-1]
        p = target_probs(logits[row_of[node]], temperature)
        kids = np.flatnonzero(tree.parents == node)      # ascending (only the walk's nodes need theirs)
        kids = kids[row_of[kids] >= 0]
        # the drafter's order: most probable first (ties: the earlier node)
        kids = kids[np.lexsort((kids, -tree.path_probs[kids]))]
        accepted = -1
        for child in kids:
            token = int(tree.tokens[child])
            rest = p.sum() - p[token]
            # rest == 0: the token holds all the mass but rounded below 1; it cannot be rejected
            if rng.random() < p[token] or rest <= 0.0:
                accepted = int(child)
                break
            p[token] = 0.0
            p /= rest
        if accepted < 0:
            return np.array(path, dtype=np.int64), draw(p / p.sum(), rng)
        path.append(accepted)
