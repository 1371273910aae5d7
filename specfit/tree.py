"""Draft trees: parents, path probabilities, depths, ancestor closure, tree masks and positions.

A draft tree is stored in plain arrays. Node 0 is the root (the last committed token, which the
target processes anyway); every other node ``v`` has ``parents[v] < v`` so the arrays are in
topological order and one forward sweep visits parents before children.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from . import kernels
from .kernels.tolerances import PROB_SLACK   # a child may exceed its parent by float rounding alone

__all__ = ["DraftTree", "check_nodes", "bad_path_probs"]


@dataclass(frozen=True, eq=False)
class DraftTree:
    """A draft tree in topological order.

    Attributes:
        parents: int64 [n]; ``parents[0] == -1``, ``0 <= parents[v] < v`` for ``v > 0``.
        path_probs: float64 [n]; predicted probability that the path root->v is accepted;
            ``path_probs[0] == 1``; a node above its parent's value as given (float rounding, at
            most ``PROB_SLACK``) is clipped to it, so along a path the values fall or stay level
            up to that rounding per level.
        tokens: int64 [n] or None; the token of each node (node 0: the last committed token).
        depth: int64 [n], derived; the root has depth 0.
    """

    parents: np.ndarray
    path_probs: np.ndarray
    tokens: np.ndarray | None = None
    depth: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        parents = np.asarray(self.parents)
        if parents.ndim != 1 or parents.size == 0:
            raise ValueError(f"parents: expected a non-empty 1-D array, got shape {parents.shape}")
        if not np.issubdtype(parents.dtype, np.integer):
            raise ValueError(f"parents: expected integers, got dtype {parents.dtype}")
        parents = parents.astype(np.int64)
        n = parents.size
        probs = np.array(self.path_probs, dtype=np.float64)   # a copy the tree owns (clipped in place)
        if probs.shape != (n,):
            raise ValueError(f"path_probs: expected shape ({n},) to match parents, got {probs.shape}")
        # one compiled pass checks, clips rounding slack and computes depths (trees are built per
        # drafted level, on the decoder's and the replay's critical path); on a failure the
        # checks below name the field and the node
        ok, depth = kernels.tree.check_tree(parents, probs, PROB_SLACK)
        if not ok:
            _raise_invalid(parents, np.asarray(self.path_probs, dtype=np.float64))
        tokens = self.tokens
        if tokens is not None:
            tokens = np.asarray(tokens)
            if tokens.shape != (n,) or not np.issubdtype(tokens.dtype, np.integer):
                raise ValueError(f"tokens: expected an integer array of shape ({n},), got {tokens.dtype} {tokens.shape}")
            tokens = tokens.astype(np.int64)
        for name, value in (("parents", parents), ("path_probs", probs), ("tokens", tokens), ("depth", depth)):
            if value is not None:
                value.setflags(write=False)
            object.__setattr__(self, name, value)

    @classmethod
    def grown(cls, parents: np.ndarray, path_probs: np.ndarray, tokens: np.ndarray, depth: np.ndarray) -> "DraftTree":
        """The tree of arrays a drafter grew level by level (:class:`specfit.runtime.drafting.TreeDraft`),
        which holds this class's invariants by construction: int64 ``parents`` in topological
        order, float64 ``path_probs`` in [0, 1] never above the parent's (checked finite when each
        level is added), int64 ``tokens`` and ``depth``. They are taken as read-only views, without
        the checks and copies of the constructor: the live decoder builds one such tree per
        drafted level, after a model pass, when every call costs several times its warm price."""
        tree = object.__new__(cls)
        for name, value in (("parents", parents), ("path_probs", path_probs), ("tokens", tokens), ("depth", depth)):
            value = value.view()
            value.setflags(write=False)
            object.__setattr__(tree, name, value)
        return tree

    # ----------------------------------------------------------------- structure
    @property
    def n_nodes(self) -> int:
        return int(self.parents.size)

    def __len__(self) -> int:
        return self.n_nodes

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())

    @cached_property
    def levels(self) -> list[np.ndarray]:
        """levels[d]: node ids at depth d, ascending."""
        order = np.argsort(self.depth, kind="stable")
        return np.split(order, np.cumsum(np.bincount(self.depth))[:-1])

    def children(self) -> list[np.ndarray]:
        """children()[v]: the children of v, ascending."""
        order = np.argsort(self.parents[1:], kind="stable") + 1
        counts = np.bincount(self.parents[1:], minlength=self.n_nodes)
        return np.split(order, np.cumsum(counts)[:-1])

    def _node_ids(self, nodes, distinct: bool = False, check_range: bool = True, name: str = "nodes") -> np.ndarray:
        """``nodes`` as int64 ids, each in ``[0, n_nodes)`` (a negative id would wrap around to
        the tree's last nodes), and with ``distinct`` none twice; one clear error otherwise.
        ``check_range=False`` for a caller whose kernel checks the range itself."""
        if type(nodes) is np.ndarray and nodes.dtype == np.int64 and nodes.ndim == 1:
            ids = nodes                          # the decoder's selections: no conversion
        else:
            ids = np.asarray(nodes)
            if ids.size and ids.dtype.kind not in "iu":
                raise ValueError(f"{name}: expected integer node ids, got {ids.dtype}")
            ids = ids.astype(np.int64, copy=False).reshape(-1)
        if check_range and ids.size and (ids.min() < 0 or ids.max() >= self.n_nodes):
            raise ValueError(f"{name}: expected ids in [0, {self.n_nodes}), got [{ids.min()}, {ids.max()}]")
        if distinct and np.unique(ids).size != ids.size:
            raise ValueError(f"{name}: expected a set of node ids, got one twice")
        return ids

    def is_ancestor_closed(self, nodes) -> bool:
        """True when ``nodes`` contains the root and every ancestor of each node it contains."""
        sel = np.zeros(self.n_nodes, dtype=bool)
        sel[self._node_ids(nodes)] = True
        return bool(sel[0] and np.all(sel[self.parents[1:]] | ~sel[1:]))

    def closure(self, nodes) -> np.ndarray:
        """Sorted node ids of the smallest ancestor-closed set containing ``nodes`` and the root."""
        sel = np.zeros(self.n_nodes, dtype=bool)
        sel[0] = True
        sel[self._node_ids(nodes)] = True
        for v in range(self.n_nodes - 1, 0, -1):
            if sel[v]:
                sel[self.parents[v]] = True
        return np.flatnonzero(sel)

    def expected_tokens(self, nodes) -> float:
        """A(S) = 1 + sum of path probabilities of the selected draft nodes (the 1 is the bonus)."""
        nodes = self._node_ids(nodes, distinct=True)
        return 1.0 + float(self.path_probs[nodes[nodes != 0]].sum())

    def subtree(self, nodes) -> "DraftTree":
        """The tree restricted to an ancestor-closed node set, renumbered in order."""
        nodes = np.unique(self._node_ids(nodes))
        if not self.is_ancestor_closed(nodes):
            raise ValueError("nodes: expected an ancestor-closed set containing the root")
        remap = np.full(self.n_nodes, -1, dtype=np.int64)
        remap[nodes] = np.arange(nodes.size)
        parents = np.where(self.parents[nodes] >= 0, remap[self.parents[nodes]], -1)
        tokens = None if self.tokens is None else self.tokens[nodes]
        return DraftTree(parents=parents, path_probs=self.path_probs[nodes], tokens=tokens)

    def level(self, d: int) -> np.ndarray:
        """Node ids at depth d."""
        return np.flatnonzero(self.depth == d)

    def truncate(self, max_depth: int) -> "DraftTree":
        """The tree of the first ``max_depth`` draft levels (nodes are in order of depth when the
        tree was drafted level by level, but this does not rely on it)."""
        return self.subtree(np.flatnonzero(self.depth <= max_depth))

    # ----------------------------------------------------------- verification
    def attention_mask(self, nodes=None, prefix_len: int = 0) -> np.ndarray:
        """[m, prefix_len + m] bool tree mask over ``nodes`` (default: all): row i may attend to
        the ``prefix_len`` committed tokens before the tree, and to column ``prefix_len + j`` when
        node ``nodes[j]`` is node i or one of its ancestors."""
        nodes = np.arange(self.n_nodes) if nodes is None else self._node_ids(nodes, check_range=False)
        ok, mask = kernels.tree.tree_mask(self.parents, nodes, int(prefix_len))
        if not ok:
            raise ValueError(f"nodes: expected ids in [0, {self.n_nodes}), got [{nodes.min()}, {nodes.max()}]")
        return mask

    def positions(self, prefix_len: int, nodes=None) -> np.ndarray:
        """Absolute positions of ``nodes`` (default: all) when the root sits at ``prefix_len``."""
        d = self.depth if nodes is None else self.depth[self._node_ids(nodes)]
        return prefix_len + d

    def accepted_path(self, verdicts, nodes=None) -> np.ndarray:
        """Greedy acceptance: the longest root-to-node path (within ``nodes``) on which each node's
        token equals the target's greedy next token at its parent (``verdicts[parent]``).
        Returns the path's node ids from the root; the bonus token is ``verdicts[path[-1]]``."""
        if self.tokens is None:
            raise ValueError("tokens: the tree has no tokens, greedy acceptance needs them")
        n = self.n_nodes
        verdicts = np.asarray(verdicts)
        if verdicts.shape != (n,) or not np.issubdtype(verdicts.dtype, np.integer):
            raise ValueError(f"verdicts: expected an integer array of shape ({n},), got {verdicts.dtype} {verdicts.shape}")
        inside = np.zeros(0 if nodes is None else n, dtype=bool)
        if nodes is not None:
            inside[self._node_ids(nodes)] = True
        ok, out = np.empty(n, dtype=bool), np.empty(n, dtype=np.int64)
        size = kernels.tree.accepted_path(self.parents, self.depth, self.tokens, verdicts.astype(np.int64), 0, n,
                                          inside, ok, out)
        return out[:size]


def _raise_invalid(parents: np.ndarray, probs: np.ndarray) -> None:
    """Raise the first failing check of a tree's parents and path probabilities."""
    n = parents.size
    if parents[0] != -1:
        raise ValueError(f"parents: node 0 must be the root (parents[0] == -1), got {parents[0]}")
    idx = np.arange(n)
    bad = np.flatnonzero((parents[1:] < 0) | (parents[1:] >= idx[1:])) + 1
    if bad.size:
        v = int(bad[0])
        raise ValueError(
            f"parents: every node v > 0 needs a parent in [0, v) (topological order, no cycles); "
            f"node {v} has parent {parents[v]}"
        )
    root = idx == 0
    bad = bad_path_probs(probs, np.where(root, 0, parents), root)
    if bad is None:
        raise AssertionError("kernels.tree.check_tree rejected a tree that every check accepts")
    v = int(np.flatnonzero(bad[0])[0])
    if bad[1] == "range" and not np.isfinite(probs[v]):
        raise ValueError(f"path_probs: expected finite values, found NaN/inf at node {v}")
    if bad[1] == "range":
        raise ValueError(f"path_probs: expected values in [0, 1], node {v} has {float(probs[v])!r}")
    if bad[1] == "root":
        raise ValueError(f"path_probs: the root's path probability must be 1, got {float(probs[0])!r}")
    raise ValueError(f"path_probs: expected non-increasing along paths, node {v} has {float(probs[v])!r} > "
                     f"its parent {parents[v]}'s {float(probs[parents[v]])!r}")


def bad_path_probs(probs: np.ndarray, parent_row: np.ndarray, root: np.ndarray) -> tuple[np.ndarray, str] | None:
    """The first check that path probabilities fail, for one tree or a forest of them: the mask of
    the nodes that fail it and which it is (``"range"``: not a finite value in [0, 1]; ``"root"``: a
    root's is not 1; ``"rising"``: above its parent's by more than the rounding slack); None when
    they pass every check. ``parent_row``: each node's parent's index into ``probs`` (any index at
    a root), ``root``: the roots' mask. What a :class:`DraftTree`, a prepared trace and a trace's
    validation check, each naming the node its own way."""
    in_range = np.isfinite(probs) & (probs >= 0) & (probs <= 1)
    if not in_range.all():
        return ~in_range, "range"
    if np.any(probs[root] != 1.0):
        return root & (probs != 1.0), "root"
    rising = ~root & (probs > probs[parent_row] + PROB_SLACK)
    if rising.any():
        return rising, "rising"
    return None


def check_nodes(tree: DraftTree, nodes, name: str = "nodes") -> np.ndarray:
    """Validate a node selection: sorted unique ids in range, containing the root, ancestor-closed."""
    nodes = np.unique(tree._node_ids(nodes, check_range=False, name=name))
    if nodes.size == 0 or nodes[0] != 0:
        raise ValueError(f"{name}: expected a selection containing the root (node 0)")
    if nodes[-1] >= tree.n_nodes:
        raise ValueError(f"{name}: node {int(nodes[-1])} is out of range for a tree of {tree.n_nodes} nodes")
    if not tree.is_ancestor_closed(nodes):
        raise ValueError(f"{name}: expected an ancestor-closed set (every selected node's parent selected)")
    return nodes
