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
"""

from __future__ import annotations

import numpy as np
import torch

from .. import kernels
from ..tree import DraftTree

__all__ = ["greedy_accept", "sample_accept", "target_probs"]


def target_probs(logits: torch.Tensor, temperature: float) -> np.ndarray:
    """float64 [..., V] softmax of ``logits / temperature`` on the host (float64 so that
    renormalising after many rejections stays exact enough to sample from)."""
    return torch.softmax(logits.float() / temperature, dim=-1).double().cpu().numpy()


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
    children = tree.children()
    path = [0]
    while True:
        node = path[-1]
        p = target_probs(logits[row_of[node]], temperature)
        kids = children[node][row_of[children[node]] >= 0]
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
            return np.array(path, dtype=np.int64), int(rng.choice(p.size, p=p / p.sum()))
        path.append(accepted)
