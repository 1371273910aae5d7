"""Policies: which draft nodes to verify, and when to stop drafting.

The interface (:class:`Policy`, :class:`CycleView`, :class:`Observation`) is in
:mod:`specfit.policy_base`. A policy sees the cycle's tree level by level (a :class:`CycleView`
after each drafted level) and answers two questions: ``keep_drafting(view)`` (draft another
level?) and, once drafting stops, ``select(view)`` (which ancestor-closed nodes to verify, with the
predicted outcome). After the
target has verified, both drivers tell the policy what the cycle revealed through
:meth:`Policy.observe` (an :class:`Observation`). The simulator and the live decoder drive the same
policy objects: the simulator through :func:`choose` on a recorded tree, the live decoder level by
level as the drafter produces them.

Policies are built from spec strings by :func:`make_policy`; :data:`POLICIES` is the one registry of
the grammar (:data:`POLICY_HELP` is written from it):

- ``ar``: no speculation, the root alone.
- ``chain:K``: draft K levels of the drafter's top-1 (a chain), verify it.
- ``eagle3[:N[:D]]``: EAGLE-2/3 dynamic tree: draft D levels (default 8), keep the N nodes
  (default 60, root included) with the highest path probabilities of the drafter (rerank; its
  cumulative log-probabilities, also where the run calibrates acceptance). The defaults are
  EAGLE-3's (``EaModel.from_pretrained``: ``total_token=60``, ``depth=7``, where ``depth`` counts
  the drafter passes after the first level, "the maximum number of draft length - 1": 8 levels).
- ``eagle3-nocache``: ``eagle3`` with no expert cache (every expert streamed), the "vanilla"
  offloaded setup (simulator only).
- ``static:N``: the same rerank with N nodes (root included) and depth N - 1 capped at the
  drafted depth, by the path probabilities the policies use (calibrated where the run calibrates
  acceptance): a fixed tree size.
- ``static:auto``: ``static:N`` with the N that is best on the trace, cache size and cost model (a
  strong baseline that knows the trace; simulator only, which tries every candidate).
- ``sequoia:N[:D]``: Sequoia's static tree of N nodes (root included, at most D levels, default
  the run's cap) from positional acceptance rates fitted on a recorded trace
  (:mod:`specfit.sequoia`: the replayed one; live, ``--acceptance``);
  ``sequoia:auto``: the best N on the trace, cache size and cost model, as ``static:auto``
  (simulator only).
- ``specfit``: the exact max-throughput search after every level; stop drafting as soon as neither
  a level nor the expected next one improves the best predicted throughput
  (:mod:`specfit.specfit_policy`).
- ``oracle``: knows the target's verdicts and true experts: drafts exactly the accepted path and
  verifies the prefix of it with the best true throughput (an upper bound, simulator only).

Any spec takes levers after it, ``SPEC+LEVER+...`` (:data:`LEVERS`): ``+cache`` (evictions by the
draft's look-ahead and each expert's recent use, :mod:`specfit.experts.lookahead`), ``+usage`` (the
recent-use part alone, for policies that do not draft), ``+prefetch`` (copies into the link time of
drafted levels, :mod:`specfit.experts.prefetch`) and, for ``specfit``, ``+online`` (acceptance
calibrated online, :mod:`specfit.experts.acceptance_online`). Both drivers apply them through the
same objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .policy_base import CycleView, Observation, Policy
from .search import Selection, evaluate
from .specfit_policy import SpecFitPolicy
from .tree import DraftTree

__all__ = [
    "CycleView", "Observation", "Policy", "ArPolicy", "ChainPolicy", "RerankPolicy", "SequoiaPolicy", "SpecFitPolicy",
    "OraclePolicy", "TunedPolicy", "PolicySpec", "POLICIES", "rerank", "POLICY_HELP", "LIVE_POLICY_HELP", "DEFAULT_POLICIES", "make_policy", "choose",
    "STATIC_AUTO_SIZES", "TUNED_FAMILIES", "is_tuned", "EAGLE3_LEVELS", "LEVERS", "apply_levers",
]


class ArPolicy(Policy):
    name = "ar"

    def select(self, view: CycleView) -> Selection:
        return view.evaluate(np.zeros(1, dtype=np.int64))     # the root, as the kernels take nodes


class ChainPolicy(Policy):
    """Draft K levels, verify the chain that follows the drafter's most probable child at each
    level. Live, the chain is drafted as a chain (top-1 at every level), as EAGLE's chain mode does;
    a replay follows the same top-1 in the recorded tree (the drafter's probabilities, not the
    calibrated ones, which can reorder siblings)."""

    draft_top_k = 1

    def __init__(self, k: int):
        if k < 1:
            raise ValueError(f"policy 'chain:{k}': expected K >= 1 draft levels (chain:0 would be ar)")
        self.max_levels = int(k)
        self.name = f"chain:{k}"

    def select(self, view: CycleView) -> Selection:
        children = view.tree.children()
        probs = view.tree.path_probs if view.drafter_probs is None else view.drafter_probs
        chain = [0]
        while len(chain) <= self.max_levels and children[chain[-1]].size:
            kids = children[chain[-1]]
            chain.append(int(kids[np.argmax(probs[kids])]))  # first of equals: the drafter's order
        return view.evaluate(chain)


class RerankPolicy(Policy):
    """EAGLE-2/3 rerank: after a fixed number of levels keep the ``total_nodes`` nodes (root
    included) with the highest path probability (ties keep the earlier node), closed under
    ancestors: a tree clips each child to its parent's probability as given, so over several
    levels of float slack a deep node can outscore an ancestor, which is then kept as well.

    ``drafter_scores``: rank by the drafter's own path probabilities (its cumulative
    log-probabilities, as EAGLE's ``topK_genrate`` ranks ``cu_scores``) where the run has calibrated
    ones; otherwise by the path probabilities the policy is given (calibrated where the run has an
    acceptance calibrator). The predicted outcome uses the given ones either way."""

    def __init__(self, total_nodes: int, depth: int, name: str, cache_capacity: int | None = None,
                 drafter_scores: bool = False):
        if total_nodes < 2:
            raise ValueError(f"policy {name!r}: expected N >= 2 nodes (root included), got N={total_nodes} (a tree of "
                             f"the root alone is ar)")
        if depth < 1:
            raise ValueError(f"policy {name!r}: expected depth >= 1, got depth={depth}")
        self.total_nodes, self.max_levels, self.name = int(total_nodes), int(depth), name
        self.drafter_scores = bool(drafter_scores)
        if cache_capacity is not None:     # a cache the run does not have: only a replay can impose it
            self.cache_capacity, self.simulator_only = int(cache_capacity), True

    def select(self, view: CycleView) -> Selection:
        scores = view.drafter_probs if self.drafter_scores else None
        return view.evaluate(rerank(view.tree, self.total_nodes, scores))


def rerank(tree: DraftTree, total_nodes: int, scores: np.ndarray | None = None) -> np.ndarray:
    """EAGLE's rerank: the ``total_nodes`` nodes (root included) with the highest path probability
    (``scores`` [nodes], default the tree's), ties to the earlier node; sorted ids of an
    ancestor-closed set."""
    probs = tree.path_probs if scores is None else scores[:tree.n_nodes]
    order = np.lexsort((np.arange(probs.size), -probs))   # by probability desc, then index
    return tree.closure(np.sort(order[:total_nodes]))


class SequoiaPolicy(RerankPolicy):
    """Sequoia's static tree of ``total_nodes`` nodes (:mod:`specfit.sequoia`): the tree of
    sibling-rank paths its dynamic program finds under the positional acceptance rates (``tree``),
    drafted to the depth it reaches (at most ``max_levels``); on a draft that lacks some of its
    nodes, the drafted nodes with the largest products of rates in their places. The rates are fitted on the
    trace a replay hands it (:meth:`fit_on_trace`) or given (``rates``; live, ``decode`` fits them on
    its ``--acceptance`` trace)."""

    def __init__(self, total_nodes: int, max_levels: int, rates: np.ndarray | None = None, name: str | None = None):
        super().__init__(total_nodes, min(total_nodes - 1, max_levels), name=name or f"sequoia:{total_nodes}",
                         drafter_scores=True)          # ranks by its own scores, not the path probabilities
        self.depth_cap = self.max_levels
        self.rates: np.ndarray | None = None
        self.tree: list[tuple[int, ...]] = [()]
        if rates is not None:
            self.fit(rates)

    def fit(self, rates: np.ndarray) -> None:
        """Take ``rates`` (one per sibling rank, each in [0, 1]) and draft the levels its tree reaches."""
        from .sequoia import shape, tree_depth
        rates = np.asarray(rates, dtype=np.float64)
        if rates.ndim != 1 or not np.all((rates >= 0) & (rates <= 1)):
            raise ValueError(f"policy {self.name!r}: expected one acceptance rate in [0, 1] per sibling rank, got "
                             f"{rates.tolist()}")
        self.rates, self.tree = rates, shape(rates, self.total_nodes, self.depth_cap)
        self.max_levels = tree_depth(self.tree)

    def fit_on_trace(self, prep) -> None:
        """The rates of ``prep`` (:meth:`specfit.simulate.prepared.PreparedTrace.positional_rates`),
        unless the policy has its rates (given, or from the first trace it was replayed on)."""
        if self.rates is None:
            self.fit(prep.positional_rates())

    def scores(self, parents: np.ndarray, depths: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        """What the rerank ranks by: each node's product of rates along its sibling ranks
        (:func:`specfit.sequoia.sibling_ranks`), plus 1 on the tree's nodes
        (:func:`specfit.sequoia.node_scores`); ``parents`` global, -1 at roots."""
        from .sequoia import node_scores
        if self.rates is None:
            raise ValueError(f"policy {self.name!r}: no positional acceptance rates; a replay fits them on its trace "
                             f"(fit_on_trace), or give them (fit)")
        return node_scores(parents, depths, ranks, self.rates, self.tree)

    def select(self, view: CycleView) -> Selection:
        from .sequoia import sibling_ranks
        tree = view.tree
        probs = tree.path_probs if view.drafter_probs is None else view.drafter_probs[:tree.n_nodes]
        scores = self.scores(tree.parents, tree.depth, sibling_ranks(tree.parents, probs))
        return view.evaluate(rerank(tree, self.verified_nodes, scores))

    @property
    def verified_nodes(self) -> int:
        """The nodes a cycle verifies: the tree's, N or fewer (rates of fewer ranks than it takes to
        hold N nodes within the depth make a smaller tree, which no node of value 0 fills up)."""
        return len(self.tree)


class OraclePolicy(Policy):
    """Knows the verdicts and the true experts; verifies the best prefix of the accepted path."""

    name = "oracle"
    needs_truth = True
    simulator_only = True

    def __init__(self, max_levels: int = 64):
        self.max_levels = int(max_levels)

    def keep_drafting(self, view: CycleView) -> bool:
        # the oracle decides on the full tree; the driver gives it every level
        return view.draft_levels < self.max_levels

    def select(self, view: CycleView) -> Selection:
        if view.verdicts is None or view.true_experts is None:
            raise ValueError("oracle: needs the target's verdicts and true experts (a full trace)")
        path = view.tree.accepted_path(view.verdicts)
        best = None
        for j in range(path.size):
            prefix = path[: j + 1]
            sel = evaluate(view.tree, prefix, view.true_experts, view.cached, view.cost, draft_levels=j)
            # every node on the accepted path is accepted: it commits j + 1 tokens for sure
            sel = Selection(nodes=prefix, expected_tokens=float(j + 1), time_s=sel.time_s, hits=sel.hits,
                            misses=sel.misses, draft_levels=j)
            if best is None or sel.expected_tokens * best.time_s > best.expected_tokens * sel.time_s:
                best = sel
        return best


class TunedPolicy(RerankPolicy):
    """A family of fixed policies of which a driver that can replay them all (the simulator) keeps
    the best: ``static:auto`` is ``static:N`` for the best N of :meth:`candidates` (``sequoia:auto``
    the same of ``sequoia:N``). Alone it is a rerank of its first size by the path probabilities
    (``static:2``'s, also for ``sequoia:auto``), which a replay refuses
    (:func:`specfit.simulate.replay.replay`); ``benchmarks/gpu_check.py`` decodes ``static:auto`` so."""

    simulator_only = True

    def __init__(self, name: str, sizes: tuple[int, ...], max_levels: int, levers: list[str] = ()):
        super().__init__(sizes[0], max(1, min(sizes[0] - 1, max_levels)), name=name)
        self.sizes, self.max_levels_cap, self.levers = tuple(sizes), int(max_levels), list(levers)
        self.family = name.partition(":")[0]

    def candidates(self, max_nodes: int) -> list[Policy]:
        """The fixed policies to try on trees of at most ``max_nodes`` nodes (with this one's levers):
        for ``static`` the sizes below it and the first at or above it, which verifies whole trees (a
        larger size would be the same policy); for ``sequoia`` every size."""
        whole = min((n for n in self.sizes if n >= max_nodes), default=max(2, max_nodes))
        sizes = [n for n in self.sizes if n < max_nodes] + [whole]
        if self.family == "sequoia":
            # a Sequoia tree of N nodes drafts only as deep as its shape reaches: a size above the
            # largest tree is another policy (a deeper, narrower tree), so every size is tried
            sizes = sorted(set(sizes) | set(self.sizes))
        suffix = "".join(f"+{lever}" for lever in self.levers)
        return [make_policy(f"{self.family}:{n}{suffix}", self.max_levels_cap) for n in sizes]


# EAGLE-3's draft levels: its default depth=7 drafts the root's top-k, then 7 more levels
EAGLE3_LEVELS = 8

# a fixed policy's nodes (or levels, or chain length) verified in one pass, at most: Sequoia's
# largest trees are 768 nodes (offloaded, the paper's), and its tree program grows with N^2
MAX_TREE_NODES = 1024

# static:auto (and sequoia:auto) try these tree sizes (root included)
STATIC_AUTO_SIZES = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# the families whose FAMILY:auto is a TunedPolicy
TUNED_FAMILIES = ("static", "sequoia")


@dataclass(frozen=True)
class PolicySpec:
    """One entry of the policy grammar: ``name`` with up to ``n_args`` integer parameters (or the
    literal forms in ``grammar``), built by ``build(args, max_levels)``. ``live``: the forms a live
    decode runs ("" for a replay-only policy; None: all of ``grammar``)."""

    grammar: str
    help: str
    build: Callable[[list[int], int], Policy]
    n_args: tuple[int, ...] = (0,)
    live: str | None = None


def _rerank(name: str):
    def build(args: list[int], max_levels: int) -> Policy:
        total, depth = (args + [60, EAGLE3_LEVELS][len(args):])[:2]
        return RerankPolicy(total, depth, name=name if not args else f"{name}:" + ":".join(map(str, args)),
                            drafter_scores=True)
    return build


def _sequoia(args: list[int], max_levels: int) -> Policy:
    """``sequoia:N`` (at most ``max_levels`` levels) or ``sequoia:N:D`` (its own depth bound, as
    ``eagle3:N:D`` keeps its own), named as written."""
    if len(args) == 2 and args[1] < 1:
        raise ValueError(f"policy 'sequoia:{args[0]}:{args[1]}': expected D >= 1 draft levels")
    return SequoiaPolicy(args[0], args[1] if len(args) == 2 else max_levels, name=":".join(["sequoia", *map(str, args)]))


def _specfit(args: list[int], max_levels: int) -> Policy:
    """``specfit`` (``max_levels`` levels at most) or ``specfit:D``, named as written: two depths
    in one run are two policies, each with its own rows."""
    policy = SpecFitPolicy(args[0] if args else max_levels)
    if args:
        policy.name = f"specfit:{args[0]}"
    return policy


POLICIES: dict[str, PolicySpec] = {
    "ar": PolicySpec("ar", "no speculation", lambda a, m: ArPolicy()),
    "chain": PolicySpec("chain:K", "a chain of K draft tokens", lambda a, m: ChainPolicy(a[0]), n_args=(1,)),
    "eagle3": PolicySpec("eagle3[:N[:D]]", f"EAGLE-3's tree: N nodes (60) of D levels ({EAGLE3_LEVELS})", _rerank("eagle3"),
                         n_args=(0, 1, 2)),
    "eagle3-nocache": PolicySpec("eagle3-nocache", "eagle3 with no expert cache (simulator)",
                                 lambda a, m: RerankPolicy(60, EAGLE3_LEVELS, name="eagle3-nocache", cache_capacity=0,
                                                           drafter_scores=True), live=""),
    "static": PolicySpec("static:N (or static:auto)", "the best N nodes of the tree; auto: the best N on the trace "
                         "(simulator)", lambda a, m: RerankPolicy(a[0], min(a[0] - 1, m), name=f"static:{a[0]}"),
                         n_args=(1,), live="static:N"),
    "sequoia": PolicySpec("sequoia:N[:D] (or sequoia:auto)", "Sequoia's static tree of N nodes (at most D levels) from "
                          "positional acceptance rates fitted on a recorded trace; auto: the best N on the trace "
                          "(simulator)", _sequoia, n_args=(1, 2), live="sequoia:N[:D]"),
    "specfit": PolicySpec("specfit[:D]", "exact max-throughput subtree, level stopping (D levels at most)",
                          lambda a, m: _specfit(a, m), n_args=(0, 1)),
    "oracle": PolicySpec("oracle", "knows the verdicts (simulator, an upper bound)", lambda a, m: OraclePolicy(64), live=""),
}
# what `specfit simulate` compares by default
DEFAULT_POLICIES = ("ar", "chain:4", "eagle3", "eagle3-nocache", "static:auto", "specfit", "oracle")


def _lookahead_cache():
    from .experts.lookahead import DraftLookahead
    return DraftLookahead()


def _usage_cache():
    from .experts.lookahead import DraftLookahead
    return DraftLookahead(use_draft=False)


def _prefetch():
    from .experts.prefetch import DraftPrefetch
    # the overlap is learned live; a replay assumes a copy stream that never stalls the drafter
    return DraftPrefetch(efficiency=None, prior_efficiency=1.0)


def _online_acceptance():
    from .experts.acceptance_online import OnlineAcceptance
    return OnlineAcceptance()


# SPEC+LEVER: what each lever adds to any policy (online acceptance: SpecFit only)
LEVERS: dict[str, tuple[str, str, Callable]] = {
    "cache": ("cache_advisor", "evictions by the draft's look-ahead and each expert's recent use", _lookahead_cache),
    "usage": ("cache_advisor", "evictions by each expert's recent use alone (no draft needed)", _usage_cache),
    "prefetch": ("prefetcher", "copies into the link time of drafted levels", _prefetch),
    "online": ("acceptance", "acceptance calibrated online from the verdicts (specfit)", _online_acceptance),
}


# words a narrow help column can wrap between (one "+a/+b/..." word is cut with an ellipsis there)
_LEVERS_HELP = " (levers, added to a policy's name: " + ", ".join(f"+{lever}" for lever in LEVERS) + ")"
POLICY_HELP = ", ".join(spec.grammar for spec in POLICIES.values()) + _LEVERS_HELP
# what `specfit decode` runs: the others need a recorded trace
LIVE_POLICY_HELP = ", ".join(spec.grammar if spec.live is None else spec.live for spec in POLICIES.values()
                             if spec.live != "") + _LEVERS_HELP


def apply_levers(policy: Policy, levers: list[str], spec: str = "") -> Policy:
    """Give ``policy`` the levers named in ``levers`` (keys of :data:`LEVERS`); returns it."""
    for lever in levers:
        if lever not in LEVERS:
            raise ValueError(f"policy {spec!r}: unknown lever {lever!r}; expected one of {sorted(LEVERS)}")
        attribute, _, build = LEVERS[lever]
        if attribute == "acceptance" and not isinstance(policy, SpecFitPolicy):
            raise ValueError(f"policy {spec!r}: +{lever} needs a policy that searches (specfit)")
        if attribute == "prefetcher" and policy.max_levels == 0:
            raise ValueError(f"policy {spec!r}: +{lever} copies experts in the link time of drafted levels, and "
                             f"{policy.name} drafts none; expected a drafting policy (chain:K, static:N, sequoia:N, eagle3, "
                             f"specfit)")
        if attribute == "prefetcher" and isinstance(policy, OraclePolicy):
            # the oracle drafts, and is charged for, only the levels of the prefix it picks in
            # hindsight: copies "while levels are drafted" would use link time no cycle pays for
            raise ValueError(f"policy {spec!r}: +{lever} is not defined for the oracle (it picks the levels it drafts "
                             f"in hindsight, so there is no drafted level's link time to copy in); expected "
                             f"oracle, oracle+cache or oracle+usage")
        setattr(policy, attribute, build())
    if levers:
        policy.name = policy.name + "".join(f"+{lever}" for lever in levers)
    return policy


def is_tuned(spec: str) -> bool:
    """``spec`` names a tuned family (``static:auto``, ``sequoia:auto``, with any levers): the
    simulator keeps its best size, reported as ``static_n``."""
    family, _, rest = str(spec).split("+")[0].strip().partition(":")
    return family in TUNED_FAMILIES and rest == "auto"


def make_policy(spec: str, max_levels: int = 8) -> Policy:
    """A policy from its spec string (see the module docstring and :data:`POLICIES`), with any
    ``+lever`` of :data:`LEVERS` after it (e.g. ``specfit+cache+prefetch``); ``max_levels`` caps
    drafting for ``specfit`` and ``static``."""
    text, *levers = str(spec).strip().split("+")
    text = text.strip()
    levers = [lever.strip() for lever in levers]
    if is_tuned(text):
        return apply_levers(TunedPolicy(text, STATIC_AUTO_SIZES, max_levels, levers), levers, spec)
    return apply_levers(_make_base(text, spec, max_levels), levers, spec)


def _make_base(text: str, spec: str, max_levels: int) -> Policy:
    name, _, rest = text.partition(":")
    entry = POLICIES.get(name) if name != "eagle3-nocache" or not rest else None
    if entry is None:
        raise ValueError(f"policy {spec!r}: expected one of {POLICY_HELP}")
    try:
        args = [int(a) for a in rest.split(":")] if rest else []
    except ValueError:
        raise ValueError(f"policy {spec!r}: expected integer parameters, e.g. chain:4, static:8, eagle3:60:8") from None
    if len(args) not in entry.n_args:
        raise ValueError(f"policy {spec!r}: expected {entry.grammar}")
    if name != "specfit" and any(a > MAX_TREE_NODES for a in args):     # specfit:D has its own bound
        raise ValueError(f"policy {spec!r}: expected parameters of at most {MAX_TREE_NODES} (nodes or levels of one "
                         f"verification pass)")
    return entry.build(args, max_levels)


def choose(policy: Policy, view: CycleView,
           before_level: Callable[[CycleView, int], CycleView] | None = None) -> Selection:
    """Drive ``policy`` over an already drafted tree (the simulator's case): offer it levels
    0, 1, ... of ``view`` until it stops or the tree ends; return its selection, whose
    ``draft_levels`` says how many levels it drafted. ``before_level(view, levels)`` runs when the
    policy has asked for level ``levels + 1``, before it is "drafted" (the driver's prefetch), and
    returns the view to go on with (e.g. with the experts it made resident)."""
    policy.begin_cycle()
    levels = 0
    deepest = view.tree.max_depth
    while levels < deepest and policy.keep_drafting(view.truncated(levels)):
        if before_level is not None:
            view = before_level(view, levels)
        levels += 1
    return policy.select(view.truncated(levels))
