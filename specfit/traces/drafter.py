"""A synthetic EAGLE-style drafter: draft trees, draft probabilities and the target's verdicts
around a reference output, with acceptance statistics that are parameters.

Tree shape (EAGLE-2/3 dynamic tree): level 1 holds the root's ``width`` most probable tokens; each
further level expands the ``width`` nodes of the previous level with the highest path probability
(the frontier) into ``width`` children each. Every candidate is kept, so a policy that reranks
(EAGLE-3, static) sees exactly what EAGLE's rerank would: ``width + (depth - 1) * width**2`` nodes.

Probabilities: at each expanded node one probability is Beta-distributed with mean
``top1_prob * depth_decay**(depth - 1)`` (confidence falls with depth, as draft errors compound);
the other ``width - 1`` children share the remaining mass (sorted Dirichlet shares of it), and the
children are sorted. Where a share exceeds the Beta draw it is the top-1, so the top-1's mean is
above that mean, the more so the lower it is (0.558 for 0.55 at depth 1, 0.415 for 0.379 at depth
7; 0.286 for a ``--top1-prob`` of 0.1). The
target accepts child i with probability ``q_i ** calibration_exponent`` (1: the drafter is
calibrated; above 1: it is over-confident), and none of them with the rest. On the reference path
the accepted child carries the reference's next token, so the verdicts spell the reference output.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from .routing import TokenSampler

__all__ = ["DrafterParams", "DraftedTree", "draft_tree", "MAX_TREE_NODES"]

# a trace numbers a tree's nodes (columns 'node', 'parent') in int16
MAX_TREE_NODES = int(np.iinfo(np.int16).max) + 1
# non-top-1 tokens that share a node's remaining draft probability (Dirichlet(0.5) shares)
_ALTERNATIVES = 16


@dataclass(frozen=True)
class DrafterParams:
    """Statistics of the synthetic drafter (see the module docstring)."""

    width: int = 4                  # EAGLE top_k: children per expanded node, frontier size
    depth: int = 7                  # draft levels
    top1_prob: float = 0.55         # mean of the Beta-drawn probability at depth 1 (the top-1 averages a bit above)
    depth_decay: float = 0.94       # per-level factor on the mean top-1 probability
    confidence_spread: float = 4.0  # Beta concentration of the top-1 probability (lower: more spread)
    calibration_exponent: float = 1.15  # acceptance = draft_prob ** exponent (1: calibrated)

    def __post_init__(self) -> None:
        # each check names the field with the command-line option that sets it (`traces synth`,
        # `traces import-routing`) and the value it got; NaN fails every one of them
        checks = (("width", "--tree-width", self.width >= 1, ">= 1"),
                  ("depth", "--tree-depth", self.depth >= 0, ">= 0"),
                  ("top1_prob", "--top1-prob", 0 < self.top1_prob < 1, "in (0, 1)"),
                  ("depth_decay", "--depth-decay", 0 < self.depth_decay <= 1, "in (0, 1]"),
                  ("confidence_spread", None, self.confidence_spread > 0, "> 0"),
                  ("calibration_exponent", "--calibration-exponent", self.calibration_exponent > 0, "> 0"))
        for name, option, ok, expected in checks:
            if not ok:
                what = f"drafter field {name!r}" + (f" ({option})" if option else "")
                raise ValueError(f"{what}: expected {expected}, got {getattr(self, name)}")
        if self.tree_nodes > MAX_TREE_NODES:
            raise ValueError(f"drafter fields 'width' (--tree-width) and 'depth' (--tree-depth): width {self.width} "
                             f"and depth {self.depth} make trees of {self.tree_nodes} nodes (1 + width + (depth - 1) * "
                             f"width^2); expected at most {MAX_TREE_NODES} (a trace numbers nodes in int16)")

    @property
    def tree_nodes(self) -> int:
        """Nodes of every drafted tree, the root included."""
        return 1 if self.depth == 0 else 1 + self.width + (self.depth - 1) * self.width ** 2

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class DraftedTree:
    """One position's drafted tree (arrays over nodes, root first, in drafting order)."""

    parent: np.ndarray         # int64 [n]
    depth: np.ndarray          # int64 [n]
    token: np.ndarray          # int64 [n]
    draft_logprob: np.ndarray  # float64 [n]
    path_prob: np.ndarray      # float64 [n]
    verdict: np.ndarray        # int64 [n]
    on_path: np.ndarray        # bool [n]: the node's path spells the reference output


def _draft_probs(params: DrafterParams, depth: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """[n, width] the drafter's top-``width`` probabilities at ``n`` nodes of a level, sorted."""
    w = params.width
    mean = params.top1_prob * params.depth_decay ** (depth - 1)
    top1 = rng.beta(mean * params.confidence_spread, (1 - mean) * params.confidence_spread, size=n)
    # the rest of the mass spread over many alternatives (16, or as many as the drafter lists);
    # the drafter lists the largest ones
    alternatives = max(_ALTERNATIVES, w - 1)
    shares = np.sort(rng.dirichlet(np.full(alternatives, 0.5), size=n), axis=1)[:, ::-1][:, : w - 1]
    probs = np.concatenate([top1[:, None], (1 - top1)[:, None] * shares], axis=1)
    return np.clip(np.sort(probs, axis=1)[:, ::-1], 1e-6, 1.0)


def draft_tree(reference: np.ndarray, params: DrafterParams, tokens: TokenSampler,
               rng: np.random.Generator) -> DraftedTree:
    """Draft a tree at a position whose reference output from the root on is ``reference``
    (``reference[0]`` the root token, ``reference[1]`` the target's next token, ...; at least
    two tokens). Draft nodes on the reference path stop where the reference ends."""
    reference = np.asarray(reference, dtype=np.int64)
    w = params.width
    parent, depth, token, logq, path, verdict, on_path = [-1], [0], [int(reference[0])], [0.0], [1.0], [int(reference[1])], [True]
    frontier = [0]
    for d in range(1, params.depth + 1):
        q = _draft_probs(params, d, len(frontier), rng)
        accept = q ** params.calibration_exponent
        accept /= np.maximum(1.0, accept.sum(axis=1, keepdims=True))
        # which child (if any, index w = none) equals the target's verdict at each frontier node
        u = rng.random(len(frontier))
        chosen = (u[:, None] >= np.cumsum(accept, axis=1)).sum(axis=1)
        level_start = len(parent)
        for i, u_node in enumerate(frontier):
            if on_path[u_node]:
                if d >= reference.size - 1:
                    chosen[i] = w   # the reference ends here: no child may be accepted
                kids = tokens.distinct_from([verdict[u_node]], w, rng)
                if chosen[i] < w:
                    kids[chosen[i]] = verdict[u_node]
            else:
                kids = tokens.distinct_from([], w + 1, rng)
                # an off-path node's verdict: the chosen child's token, or a token none of them has
                verdict[u_node] = int(kids[chosen[i]])
                kids = kids[:w]
            for j in range(w):
                is_path = bool(on_path[u_node] and chosen[i] == j)
                parent.append(u_node)
                depth.append(d)
                token.append(int(kids[j]))
                logq.append(float(np.log(q[i, j])))
                path.append(path[u_node] * float(q[i, j]))
                on_path.append(is_path)
                verdict.append(int(reference[d + 1]) if is_path else -1)
        # the frontier: the level's w most probable nodes (earlier node first among equals)
        level = np.arange(level_start, len(parent))
        probs = np.asarray(path[level_start:])
        frontier = level[np.lexsort((level, -probs))][:w].tolist()
    verdict_a = np.asarray(verdict, dtype=np.int64)
    leaves = np.flatnonzero(verdict_a < 0)   # never expanded: no child can match a fresh token
    verdict_a[leaves] = tokens.sample(leaves.size, rng)
    return DraftedTree(parent=np.asarray(parent, dtype=np.int64), depth=np.asarray(depth, dtype=np.int64),
                       token=np.asarray(token, dtype=np.int64),
                       draft_logprob=np.asarray(logq), path_prob=np.asarray(path), verdict=verdict_a,
                       on_path=np.asarray(on_path))
