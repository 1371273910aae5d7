"""A generative model of MoE routing, for synthetic traces and for the draft nodes that an
importer adds around real routing.

A token's ``top_k`` slots at a layer are filled from three sources, in shares set by two
probabilities (slot counts rounded stochastically):

- with probability ``token_prob_``: the token's own preference list (a fixed ranking per token
  id: popularity plus a per-token random preference, low rank like a router applied to an
  embedding), taken in order;
- with probability ``anchor_prob``: a random expert of the *anchor* set: the previous token's
  experts for a token that follows another (temporal locality), or the true next token's experts
  for an off-path draft sibling (same context, different token);
- otherwise: an expert drawn from the layer's popularity (raised to ``popularity_power_``).

Each probability has a target statistic (measured with :mod:`specfit.traces.stats`) that
:meth:`RoutingModel.calibrate` reproduces per layer by damped fixed-point rounds on a pilot
sample, because chance overlaps add to the probabilities:

- popularity skew: share of routing slots of the most popular quarter of the experts;
- consecutive reuse: fraction of a token's experts the previous token used (about 0.45 in OLMoE);
- token affinity: overlap between two occurrences of the same token id (about 0.7 in real OLMoE
  decode routing). Both claim the same ``top_k`` slots; consecutive reuse is served first, so
  with OLMoE's targets the model lands below the affinity target here (see traces/README.md);
- sibling reuse: overlap between two off-path siblings. Token affinity and reuse share the same
  ``top_k`` slots, so with OLMoE-like affinity siblings cannot be very similar.
"""

from __future__ import annotations

import numpy as np

from ..errors import SpecFitError
from .stats import consecutive_reuse, popularity as measure_popularity, same_token_reuse, set_overlap, top_quarter_share

__all__ = ["RoutingModel", "zipf_popularity", "TokenSampler"]

_EMBED_DIM = 16  # rank of the token preference vectors
_DISTINCT_ROUNDS = 64   # draws of distinct tokens before the rest are drawn without replacement


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
        """``size`` distinct tokens, none of them in ``avoid``: drawn until distinct (a few draws at
        any usual exponent), the rest without replacement once that takes too long (a steep
        exponent puts nearly all the mass on a few tokens)."""
        out: list[int] = []
        taken = set(int(a) for a in avoid)
        if size > self.ids.size - len(taken):
            raise SpecFitError(f"token sampler: {size} distinct tokens asked besides {len(taken)}, but the vocabulary "
                               f"has {self.ids.size}")
        for _ in range(_DISTINCT_ROUNDS):
            if len(out) == size:
                break
            for t in self.sample(size - len(out) + 2, rng):
                t = int(t)
                if t not in taken:
                    taken.add(t)
                    out.append(t)
                    if len(out) == size:
                        break
        if len(out) < size:
            # every untaken token possible (a steep exponent's tail has no mass left in the cdf)
            mass = np.maximum(np.diff(self.cdf, prepend=0.0), np.finfo(np.float64).tiny)
            mass *= ~np.isin(self.ids, np.fromiter(taken, np.int64, len(taken)))
            out += rng.choice(self.ids, size - len(out), replace=False, p=mass / mass.sum()).tolist()
        return np.array(out, dtype=np.int64)


class RoutingModel:
    """Synthetic routing with calibrated popularity skew, token affinity, consecutive reuse and
    sibling reuse (see the module docstring).

    Args:
        popularity: [layers, experts] routing share of each expert (its skew is a target too).
        consecutive_reuse, token_affinity, sibling_reuse: [layers] (or scalars) target overlaps.
        top_k: experts per token and layer.
        vocab_size: token ids are in [0, vocab_size).
        seed: fixes each token id's preference list.
    """

    def __init__(self, popularity: np.ndarray, consecutive_reuse, token_affinity, sibling_reuse,
                 top_k: int, vocab_size: int, seed: int = 0):
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
        self.popularity_skew = top_quarter_share(self.popularity)
        self._log_pop = np.log(np.maximum(self.popularity, 1e-12)).astype(np.float32)
        table_rng = np.random.default_rng([self.seed, 0xE4B])
        self._embedding = table_rng.standard_normal((int(vocab_size), _EMBED_DIM), dtype=np.float32)
        self._projection = (table_rng.standard_normal((_EMBED_DIM, L * E), dtype=np.float32)
                            / np.float32(np.sqrt(_EMBED_DIM)))
        self._preferences: dict[int, np.ndarray] = {}   # token id -> [layers, top_k]
        # starting values; calibrate() fits them
        self.popularity_power_ = np.ones(L)
        self.token_prob_ = self.token_affinity.copy()
        self.consecutive_prob_ = self.consecutive_reuse.copy()
        self.token_prob_ = np.minimum(self.token_prob_, 1 - self.consecutive_prob_)
        self.sibling_prob_ = np.minimum(self.sibling_reuse, 1 - self.token_prob_)

    @property
    def n_layers(self) -> int:
        return self.popularity.shape[0]

    @property
    def n_experts(self) -> int:
        return self.popularity.shape[1]

    # ------------------------------------------------------------------ sampling
    def preferences(self, tokens: np.ndarray) -> np.ndarray:
        """[n, layers, top_k] each token's preferred experts, most preferred first (fixed per
        token id for fixed popularity; memoised per token, as tokens repeat)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        uniq, inverse = np.unique(tokens, return_inverse=True)
        missing = np.array([t not in self._preferences for t in uniq.tolist()], dtype=bool)
        if missing.any():
            new = uniq[missing]
            z = (self._embedding[new] @ self._projection).reshape(new.size, self.n_layers, self.n_experts)
            prefs = _top_k(z + (self.popularity_power_[:, None] * self._log_pop).astype(np.float32)[None], self.top_k)
            self._preferences.update(zip(new.tolist(), prefs))
        return np.stack([self._preferences[t] for t in uniq.tolist()])[inverse.ravel()]

    def route(self, tokens: np.ndarray, anchor: np.ndarray | None, anchor_prob: np.ndarray,
              rng: np.random.Generator | None = None, noise: np.ndarray | None = None) -> np.ndarray:
        """[n, layers, top_k] experts of ``tokens`` given anchor sets ``[n, layers, top_k]``;
        ``noise`` (uniform [0, 1), [n, layers, experts + 2 * top_k]) is drawn from ``rng`` unless
        given (the calibration reuses it)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        n, L, E, k = tokens.size, self.n_layers, self.n_experts, self.top_k
        if noise is None:
            noise = rng.random((n, L, E + 2 * k), dtype=np.float32)
        free_u, slot_u, anchor_u = noise[..., :E], noise[..., E:E + k], noise[..., E + k:]
        # free slots: Gumbel-top-k over the (powered) popularity
        scores = (self.popularity_power_[:, None] * self._log_pop).astype(np.float32)[None] \
            - np.log(-np.log(np.maximum(free_u, np.float32(1e-12))))
        # slot counts by stochastic rounding: the mean is exact and the spread minimal, so two
        # occurrences of a token take about the same prefix of its preference list
        n_tok = np.floor(self.token_prob_[None, :, None] * k + slot_u[..., :1]).astype(np.int64)
        # top-1 has one slot uniform; its anchor rank needs no uniform (one anchor expert), so that
        # one rounds the anchor count
        anchor_round = slot_u[..., 1:2] if k > 1 else anchor_u[..., :1]
        n_anchor = np.minimum(k - n_tok, np.floor(np.asarray(anchor_prob)[None, :, None] * k + anchor_round))
        if anchor is not None:
            # a random n_anchor of the anchor's experts, ranked above every free candidate
            rank = np.argsort(np.argsort(anchor_u, axis=2), axis=2)
            node, layer, slot = np.nonzero(rank < n_anchor)
            scores[node, layer, np.asarray(anchor)[node, layer, slot]] = _ANCHOR_SCORE
        # the first n_tok preferred experts, ranked above everything, in preference order
        node, layer, slot = np.nonzero(np.arange(k)[None, None, :] < n_tok)
        scores[node, layer, self.preferences(tokens)[node, layer, slot]] = _TOKEN_SCORE - slot.astype(np.float32)
        return _top_k(scores, k)

    def likely_experts(self, tokens: np.ndarray) -> np.ndarray:
        """[n, layers, top_k] the experts each token is most likely routed to when its anchor set
        is unknown: its preferred experts in order, as many as its expected token slots, each by the
        chance that the slot is its own (1 for the first ``floor(token_prob_ * top_k)``), then the
        layer's most popular others. What a predictor that knew this model, but none of its
        draws, would name."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        L, k = self.n_layers, self.top_k
        popular = np.exp(self.popularity_power_[:, None] * self._log_pop.astype(np.float64))
        # a free expert's score stays below any preference slot's chance (> 0); the certain slots
        # (chance 1) keep the preference order
        base = 1e-9 * popular / popular.sum(axis=1, keepdims=True)
        rank = np.arange(k)[None, :]
        slot_chance = np.clip(self.token_prob_[:, None] * k - rank, 0.0, 1.0) * (1.0 + (k - rank) * 1e-6)
        out = np.empty((tokens.size, L, k), dtype=np.int64)
        for lo in range(0, tokens.size, 8192):
            chunk = tokens[lo:lo + 8192]
            prefs = self.preferences(chunk)
            scores = np.repeat(base[None], chunk.size, axis=0)
            node, layer, slot = np.indices(prefs.shape)
            scores[node, layer, prefs] = np.maximum(scores[node, layer, prefs], slot_chance[layer, slot])
            out[lo:lo + 8192] = _top_k(scores, k)
        return out

    def next_token(self, previous: np.ndarray | None, tokens: np.ndarray, rng: np.random.Generator,
                   noise: np.ndarray | None = None) -> np.ndarray:
        """Experts of ``tokens`` that follow tokens routed to ``previous`` (temporal reuse)."""
        return self.route(tokens, previous, self.consecutive_prob_, rng, noise)

    def sibling(self, true_next: np.ndarray, tokens: np.ndarray, rng: np.random.Generator,
                noise: np.ndarray | None = None) -> np.ndarray:
        """Experts of off-path draft tokens at positions whose true next token routes to
        ``true_next`` (same context, different token)."""
        return self.route(tokens, true_next, self.sibling_prob_, rng, noise)

    def sequences(self, tokens: np.ndarray, rng: np.random.Generator, noise: np.ndarray | None = None) -> np.ndarray:
        """[n_seq, length, layers, top_k] routing of token sequences ``tokens [n_seq, length]``,
        the sequences stepped together (``noise``: optional [n_seq, length, ...] per step)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        n_seq, length = tokens.shape
        out = np.empty((n_seq, length, self.n_layers, self.top_k), dtype=np.int64)
        prev = None
        for t in range(length):
            prev = out[:, t] = self.next_token(prev, tokens[:, t], rng, None if noise is None else noise[:, t])
        return out

    # ------------------------------------------------------------------ calibration
    def calibrate(self, token_sampler: "TokenSampler", rng: np.random.Generator, pilot_tokens: int = 512,
                  rounds: int = 8) -> "RoutingModel":
        """Fit the slot probabilities and the popularity power per layer so that a pilot sample
        reproduces the targets; the pilot's measured statistics (layer means) are kept in
        ``pilot_``. The pilot reuses its tokens and noise every round (common random numbers), so
        a round's change in the statistics comes from the parameters alone."""
        if rounds < 1:
            # pilot_ holds the last round's measured statistics: with no round there are none
            raise ValueError(f"rounds: expected at least 1, got {rounds}")
        n_seq = 8
        length = max(16, pilot_tokens // n_seq)
        L, E, k = self.n_layers, self.n_experts, self.top_k
        tokens = token_sampler.sample((n_seq, length), rng)
        seq = np.repeat(np.arange(n_seq), length)
        noise = rng.random((n_seq, length, L, E + 2 * k), dtype=np.float32)
        sib_tokens = [token_sampler.sample(n_seq * length, rng) for _ in range(2)]
        sib_noise = [rng.random((n_seq * length, L, E + 2 * k), dtype=np.float32) for _ in range(2)]
        for _ in range(rounds):
            routed = self.sequences(tokens, rng, noise).reshape(-1, L, k)
            skew = top_quarter_share(measure_popularity(routed, E))
            r = consecutive_reuse(routed, seq)
            a = same_token_reuse(routed, tokens.ravel())
            s = set_overlap(*(self.sibling(routed, t, rng, z) for t, z in zip(sib_tokens, sib_noise))).mean(axis=0)
            self.popularity_power_ = np.clip(self.popularity_power_ + 4.0 * (self.popularity_skew - skew), 0, 10)
            self._preferences.clear()   # they depend on the popularity power
            # overlaps are probabilities plus chance, so a unit step in the probability is about
            # right. Consecutive reuse drives cache hit rates, so it has the first claim on the
            # slots; token affinity gets what is left (real routing reaches both because a
            # token's own preferences also follow the context, which this model leaves out)
            self.consecutive_prob_ = np.clip(self.consecutive_prob_ + (self.consecutive_reuse - r), 0, 1)
            if np.all(np.isfinite(a)):
                self.token_prob_ = np.clip(self.token_prob_ + (self.token_affinity - a), 0, 1 - self.consecutive_prob_)
            self.sibling_prob_ = np.clip(self.sibling_prob_ + (self.sibling_reuse - s), 0, 1 - self.token_prob_)
        self.pilot_ = {"popularity_skew": float(skew.mean()), "consecutive_reuse": float(r.mean()),
                       "token_affinity": float(np.nanmean(a)), "sibling_reuse": float(s.mean())}
        return self


_TOKEN_SCORE = np.float32(3e6)    # token-preference slots outrank ...
_ANCHOR_SCORE = np.float32(2e6)   # ... anchor slots, which outrank any free (log-probability) score


def _top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k highest scores along the last axis, highest first (like a router)."""
    idx = np.argpartition(-scores, k - 1, axis=-1)[..., :k]
    order = np.argsort(-np.take_along_axis(scores, idx, axis=-1), axis=-1, kind="stable")
    return np.take_along_axis(idx, order, axis=-1)
