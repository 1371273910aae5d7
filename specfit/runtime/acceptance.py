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
(the edges :func:`sample_accept` returns), as greedy decoding's is "the token is the parent's
argmax". The walk's steps are compiled (:mod:`specfit.kernels.sampling`).
"""

from __future__ import annotations

import numpy as np
import torch

from .. import kernels
from ..tree import DraftTree

__all__ = ["greedy_accept", "sample_accept", "sample_token", "NonFiniteLogits"]


class NonFiniteLogits(ValueError):
    """A row of the target's logits has no distribution: a NaN, or no logit above ``-inf``."""


_ROOT_ONLY = DraftTree(parents=np.array([-1]), path_probs=np.array([1.0]), tokens=np.array([0]))


def sample_token(logits: torch.Tensor, temperature: float, rng: np.random.Generator) -> int:
    """A token drawn from the target's distribution at ``temperature`` (``logits`` [V]): the bonus
    token of a walk over the root alone."""
    return sample_accept(_ROOT_ONLY, np.zeros(1, dtype=np.int64), logits[None], temperature, rng)[1]


def greedy_accept(tree: DraftTree, nodes: np.ndarray, verdicts: np.ndarray) -> tuple[np.ndarray, int]:
    """(accepted path from the root, bonus token) for the target's greedy ``verdicts`` (int64) at
    ``nodes`` (row i is node ``nodes[i]``; sorted, with the root): the decoder's own arrays, so
    the tree's compiled rule is called without :meth:`DraftTree.accepted_path`'s checks."""
    path, bonus = kernels.tree.greedy_path(tree.parents, tree.depth, tree.tokens, nodes, verdicts)
    return path, int(bonus)


def sample_accept(tree: DraftTree, nodes: np.ndarray, logits: torch.Tensor, temperature: float,
                  rng: np.random.Generator) -> tuple[np.ndarray, int, tuple[np.ndarray, np.ndarray]]:
    """(accepted path from the root, bonus token, edges) by tree speculative sampling.

    ``logits[i]`` are the target's logits at node ``nodes[i]`` (sorted, with the root). The walk
    (:func:`specfit.kernels.sampling.walk`) reads logits on the CPU in place and copies those on a
    device to the host a visited row at a time, so a large vocabulary costs one softmax per
    committed token. ``edges`` are the drafted nodes whose parent lies on the path, verified or
    not, with the chance the walk accepts each there: the target's probability of its token at the
    parent (the sampling counterpart of the greedy 0/1 outcomes of
    :func:`specfit.policy_base.edge_outcomes`, what a policy that learns acceptance is told).
    """
    n, sampling = tree.n_nodes, kernels.sampling
    row_of = np.full(n, -1, dtype=np.int64)
    row_of[nodes] = np.arange(nodes.size)
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        host, have = logits.detach().numpy(), np.ones(nodes.size, dtype=bool)
    else:
        host, have = np.empty(tuple(logits.shape), dtype=np.float32), np.zeros(nodes.size, dtype=bool)
    path, edge_nodes, edge_probs = np.zeros(n, dtype=np.int64), np.empty(n, dtype=np.int64), np.empty(n)
    size, n_edges = 1, 0
    while True:
        status, size, n_edges, bonus = sampling.walk(host, have, row_of, float(temperature), tree.parents,
                                                     tree.path_probs, tree.tokens, rng, path, size, edge_nodes,
                                                     edge_probs, n_edges)
        if status == sampling.NEED_ROW:
            row = row_of[path[size - 1]]
            host[row] = logits[row].float().cpu().numpy()
            have[row] = True
            continue
        if status == sampling.BAD_ROW:
            raise NonFiniteLogits(f"logits: the row of node {path[size - 1]} holds NaN or no logit above -inf; "
                                  "expected a distribution to sample from")
        if status == sampling.BAD_TOKEN:
            raise ValueError(f"tree: a token drafted after node {path[size - 1]} is not in the target's vocabulary "
                             f"[0, {logits.shape[-1]})")
        return path[:size].copy(), int(bonus), (edge_nodes[:n_edges].copy(), edge_probs[:n_edges].copy())
