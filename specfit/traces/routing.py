"""A generative model of MoE routing, for synthetic traces and for the draft nodes that an
importer adds around real routing.

At each layer a token picks ``top_k`` experts. Three effects, each with a target statistic that
the model is calibrated to reproduce (measured with :mod:`specfit.traces.stats`):

- **popularity** ``[layers, experts]``: some experts are picked far more often than others;
- **consecutive reuse** ``[layers]``: the fraction of a token's experts that the previous token
  used at the same layer (temporal locality; about 0.45 in real OLMoE decode routing);
- **token affinity** ``[layers]``: the overlap between two occurrences of the same token id (about
  0.7 in OLMoE), i.e. how much the routing follows the token itself;
- **sibling reuse** ``[layers]``: draft siblings are different tokens at the same position; an
  off-path sibling shares this fraction of the experts of the target's true next token there.

Sampling: every expert gets a Gumbel-perturbed log-popularity score; the anchor's experts (the
previous token, or the true next token for a sibling) are kept with probability ``keep_anchor_``
each, the token's preferred experts with probability ``keep_affinity_`` each, by raising their
scores above every other; the top-k scores are the set (kept experts tie-break at random). The
keep probabilities are not the targets themselves (chance overlap adds to them), so
:meth:`RoutingModel.calibrate` finds them by a few fixed-point rounds on a pilot sample.
"""

from __future__ import annotations

import numpy as np

from .stats import consecutive_reuse, same_token_reuse, set_overlap

__all__ = ["RoutingModel", "zipf_popularity", "TokenSampler"]

_FORCED = 1e6  # score bonus of a kept expert: above any Gumbel-perturbed log-probability


def zipf_popularity(n_layers: int, n_experts: int, exponent: float, rng: np.random.Generator) -> np.ndarray:
    """[layers, experts] popularity with a Zipf-shaped rank profile; each layer gets its own
    exponent (0.75-1.25x the given one, as real layers differ) and its own expert order."""
    ranks = np.arange(1, n_experts + 1, dtype=np.float64)
    pop = np.empty((n_layers, n_experts))
    for layer in range(n_layers):
        s = exponent * rng.uniform(0.75, 1.25)
        p = ranks ** -s
        pop[layer] = rng.permutation(p / p.sum())
    return pop


class TokenSampler:
    """Token ids with Zipf-distributed frequencies over a vocabulary (rank r has weight r^-s,
    ranks mapped to ids by a fixed random permutation)."""

    def __init__(self, vocab_size: int, exponent: float, rng: np.random.Generator):
        w = np.arange(1, vocab_size + 1, dtype=np.float64) ** -exponent
        self.cdf = np.cumsum(w / w.sum())
        self.ids = rng.permutation(vocab_size).astype(np.int64)

    def sample(self, size, rng: np.random.Generator) -> np.ndarray:
        r = np.searchsorted(self.cdf, rng.random(size), side="right")
        return self.ids[np.minimum(r, self.ids.size - 1)]

    def distinct_from(self, avoid: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
        """``size`` distinct tokens, none of them in ``avoid``."""
        out: list[int] = []
        taken = set(int(a) for a in avoid)
        while len(out) < size:
            for t in self.sample(size - len(out) + 2, rng):
                t = int(t)
                if t not in taken:
                    taken.add(t)
                    out.append(t)
                    if len(out) == size:
                        break
        return np.array(out, dtype=np.int64)


class RoutingModel:
    """Synthetic routing with calibrated popularity, temporal reuse, token affinity and sibling
    similarity (see the module docstring).

    Args:
        popularity: [layers, experts] routing share of each expert.
        consecutive_reuse, token_affinity, sibling_reuse: [layers] (or scalars) target overlaps.
        top_k: experts per token and layer.
        seed: fixes each token's preferred experts (the same token id always prefers the same ones).
        known_affinity: optional {token id: [layers, top_k]} preferred experts measured from real
            routing; other tokens get preferred experts drawn from the popularity.
    """

    def __init__(self, popularity: np.ndarray, consecutive_reuse, token_affinity, sibling_reuse,
                 top_k: int, seed: int = 0, known_affinity: dict | None = None):
        self.popularity = np.asarray(popularity, dtype=np.float64)
        L, E = self.popularity.shape
        if not 0 < top_k <= E:
            raise ValueError(f"top_k: expected 1..{E}, got {top_k}")
        self.top_k, self.seed = int(top_k), int(seed)
        self.consecutive_reuse = np.broadcast_to(np.asarray(consecutive_reuse, dtype=np.float64), (L,)).copy()
        self.token_affinity = np.broadcast_to(np.asarray(token_affinity, dtype=np.float64), (L,)).copy()
        self.sibling_reuse = np.broadcast_to(np.asarray(sibling_reuse, dtype=np.float64), (L,)).copy()
        for name in ("consecutive_reuse", "token_affinity", "sibling_reuse"):
            v = getattr(self, name)
            if np.any((v < 0) | (v > 1)):
                raise ValueError(f"{name}: expected fractions in [0, 1], got {v.min():.3f}..{v.max():.3f}")
        self._log_pop = np.log(np.maximum(self.popularity, 1e-12))
        self._affinity: dict[int, np.ndarray] = dict(known_affinity or {})
        # until calibrated, use the targets as keep probabilities
        self.keep_anchor_ = self.consecutive_reuse.copy()
        self.keep_affinity_ = self.token_affinity.copy()
        self.keep_sibling_ = self.sibling_reuse.copy()

    @property
    def n_layers(self) -> int:
        return self.popularity.shape[0]

    @property
    def n_experts(self) -> int:
        return self.popularity.shape[1]

    # ------------------------------------------------------------------ sampling
    def affinity(self, tokens: np.ndarray) -> np.ndarray:
        """[n, layers, top_k] preferred experts of each token (deterministic per token id)."""
        out = np.empty((len(tokens), self.n_layers, self.top_k), dtype=np.int64)
        for i, t in enumerate(np.asarray(tokens, dtype=np.int64).tolist()):
            sets = self._affinity.get(t)
            if sets is None:
                rng = np.random.default_rng([self.seed, 0x5EED, t])
                sets = self._top_k(self._log_pop + rng.gumbel(size=self._log_pop.shape))
                self._affinity[t] = sets
            out[i] = sets
        return out

    def _top_k(self, scores: np.ndarray) -> np.ndarray:
        k = self.top_k
        idx = np.argpartition(-scores, k - 1, axis=-1)[..., :k]
        order = np.argsort(-np.take_along_axis(scores, idx, axis=-1), axis=-1, kind="stable")
        return np.take_along_axis(idx, order, axis=-1)   # highest score first, like a router

    def sample(self, anchor: np.ndarray | None, keep_anchor: np.ndarray, tokens: np.ndarray,
               rng: np.random.Generator) -> np.ndarray:
        """[n, layers, top_k] experts of ``tokens``, keeping each of ``anchor``'s experts with
        probability ``keep_anchor[layer]`` and each preferred expert with ``keep_affinity_``."""
        n, L, k = len(tokens), self.n_layers, self.top_k
        scores = self._log_pop[None] + rng.gumbel(size=(n, L, self.n_experts))
        bonus = np.zeros_like(scores)
        keep = rng.random((n, L, k)) < self.keep_affinity_[None, :, None]
        node, layer, _ = np.nonzero(keep)
        bonus[node, layer, self.affinity(tokens)[keep]] = _FORCED
        if anchor is not None:
            keep = rng.random((n, L, k)) < np.asarray(keep_anchor)[None, :, None]
            node, layer, _ = np.nonzero(keep)
            bonus[node, layer, np.asarray(anchor, dtype=np.int64)[keep]] = _FORCED
        return self._top_k(scores + bonus)

    def next_token(self, previous: np.ndarray | None, tokens: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Experts of ``tokens`` that follow tokens routed to ``previous`` (temporal reuse)."""
        return self.sample(previous, self.keep_anchor_, tokens, rng)

    def sibling(self, true_next: np.ndarray, tokens: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Experts of off-path draft tokens at a position whose true next token routes to
        ``true_next`` (same context, different token)."""
        return self.sample(true_next, self.keep_sibling_, tokens, rng)

    def sequences(self, tokens: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """[n_seq, length, layers, top_k] routing of token sequences ``tokens [n_seq, length]``,
        the sequences stepped together."""
        tokens = np.asarray(tokens, dtype=np.int64)
        n_seq, length = tokens.shape
        out = np.empty((n_seq, length, self.n_layers, self.top_k), dtype=np.int64)
        prev = None
        for t in range(length):
            prev = out[:, t] = self.next_token(prev, tokens[:, t], rng)
        return out

    # ------------------------------------------------------------------ calibration
    def calibrate(self, token_sampler: TokenSampler, rng: np.random.Generator, pilot_tokens: int = 2048,
                  rounds: int = 6) -> "RoutingModel":
        """Fit ``keep_anchor_``, ``keep_affinity_`` and ``keep_sibling_`` so that a pilot sample
        reproduces the target overlaps; stores the pilot's measured statistics in ``pilot_``."""
        n_seq = 8
        length = max(16, pilot_tokens // n_seq)
        tokens = token_sampler.sample((n_seq, length), rng)
        seq = np.repeat(np.arange(n_seq), length)
        for _ in range(rounds):
            routed = self.sequences(tokens, rng).reshape(-1, self.n_layers, self.top_k)
            flat_tokens = tokens.ravel()
            r = consecutive_reuse(routed, seq)
            a = same_token_reuse(routed, flat_tokens)
            self.keep_anchor_ = np.clip(self.keep_anchor_ + (self.consecutive_reuse - r), 0.0, 0.99)
            if np.all(np.isfinite(a)):
                self.keep_affinity_ = np.clip(self.keep_affinity_ + (self.token_affinity - a), 0.0, 0.99)
            sib_a = self.sibling(routed, token_sampler.sample(routed.shape[0], rng), rng)
            sib_b = self.sibling(routed, token_sampler.sample(routed.shape[0], rng), rng)
            s = set_overlap(sib_a, sib_b).mean(axis=0)
            self.keep_sibling_ = np.clip(self.keep_sibling_ + (self.sibling_reuse - s), 0.0, 0.99)
        self.pilot_ = {"consecutive_reuse": float(np.mean(r)), "token_affinity": float(np.nanmean(a)),
                       "sibling_reuse": float(np.mean(s))}
        return self
