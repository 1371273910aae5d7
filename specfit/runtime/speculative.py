"""Speculative decoding on the offloaded target: an EAGLE-3 drafter, a policy, tree verification.

:class:`SpeculativeDecoder` drives the cycle of :class:`~specfit.runtime.decoder.Decoder` with

- drafting level by level (:class:`~specfit.runtime.eagle3.DynamicTree`, EAGLE-2/3 expansion);
  after every level the policy of :mod:`specfit.policies` sees a :class:`~specfit.policies.CycleView`
  — the tree so far, the predicted experts of its nodes (:class:`~specfit.runtime.predict.RouterPredictor`),
  the residency of the live expert cache and the cost model — and decides whether to draft
  another level, then which nodes to verify: the same policy objects the simulator replays;
- drafter state kept consistent with the target: after each cycle the accepted tokens are re-run
  through the drafter with the target's own features (as EAGLE-3 does), lazily, at the start of
  the next level 1 (a cycle that drafts nothing — AR, or SpecFit stopping at the root — does not
  pay for it).

:class:`FullTreeDecoder` is the recorder of counterfactual traces: at every position of the greedy
output it drafts the full tree, verifies all of it (so every node's verdict and true experts are
known) and commits exactly one token.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..costmodel import CostModel
from ..experts.calibration import AcceptanceCalibrator
from ..experts.predictors import slots_right
from ..policies import CycleView, Policy, RerankPolicy, SpecFitPolicy
from ..search import uncertainty_price_s
from ..tree import DraftTree
from .decoder import CycleStats, Decoder, DraftInfo, Verification, device_now
from .drafting import DrafterSession, DynamicTree
from .eagle3 import Eagle3Drafter
from .loader import check_drafter
from .model import MoETransformer
from .predict import RouterPredictor

__all__ = ["SpeculativeDecoder", "FullTreeDecoder", "tree_capacity"]


def tree_capacity(top_k: int, levels: int) -> int:
    """Nodes of a dynamic tree after ``levels`` levels, root included: ``top_k`` children of the
    root, then ``top_k`` children of each of the ``top_k`` expanded nodes per level."""
    return 1 + (top_k + (levels - 1) * top_k * top_k if levels > 0 else 0)


class SpeculativeDecoder(Decoder):
    """Speculative decoding with an EAGLE-3 drafter and a policy.

    Args:
        model: the target (its ``capture_layers`` must be the drafter's feature layers).
        drafter: the EAGLE-3 head, on the target's device and dtype (None for a policy that never
            drafts, such as ``ar``: its cycles are still predicted and measured).
        policy: from :func:`specfit.policies.make_policy`; ``max_levels`` bounds drafting.
        cost: the cycle-time model the policy decides with (a profile's).
        predictor: predicts draft nodes' experts (default: the target's routers).
        tree_top_k: EAGLE's top-k: children per expanded node and nodes expanded per level.
        calibrator: maps draft probabilities to acceptance probabilities (None: the drafter's own).
        recorder: receives every cycle (see :class:`specfit.runtime.record.TraceRecorder`).
        price_uncertainty: with the ``specfit`` policy, charge each draft node for the experts the
            predictor has been getting wrong (its measured precision so far this run).
    """

    def __init__(self, model: MoETransformer, drafter: Eagle3Drafter | None, policy: Policy, cost: CostModel,
                 predictor: RouterPredictor | None = None, eos_token_ids=(), tree_top_k: int = 4,
                 temperature: float = 0.0, seed: int = 0, calibrator: AcceptanceCalibrator | None = None,
                 recorder=None, price_uncertainty: bool = True):
        super().__init__(model, eos_token_ids=eos_token_ids, temperature=temperature, seed=seed)
        if tree_top_k < 1:
            raise ValueError(f"tree_top_k: expected >= 1, got {tree_top_k}")
        if drafter is not None:
            check_drafter(model, drafter)
        elif policy.max_levels > 0:
            raise ValueError(f"policy {policy.name!r} drafts: it needs a drafter")
        self.drafter, self.policy, self.cost = drafter, policy, cost
        self.predictor = predictor or RouterPredictor(model)
        # the drafter's states estimate the target's only when they live in the same space
        self.drafter_context = (drafter is not None and drafter.config.hidden_size == model.config.hidden_size
                                and getattr(drafter, "features_in_target_space", True))
        self.tree_top_k = int(tree_top_k)
        self.calibrator = calibrator
        self.recorder = recorder
        self.price_uncertainty = bool(price_uncertainty)
        self._slots_seen = self._slots_right = 0      # expert predictions checked so far, and right
        self.session: DrafterSession | None = None
        self._pending: list[tuple[torch.Tensor, list[int]]] = []   # (features, next tokens) not yet in the drafter
        self._drafter_entries = 0
        self._prompt_len = 0
        self._cycle: tuple[CycleView, DynamicTree | None, DraftInfo] | None = None

    def extra_kv_slots(self) -> int:
        return tree_capacity(self.tree_top_k, self.policy.max_levels) - 1

    # ------------------------------------------------------------------ generation
    def generate(self, prompt_ids, max_new_tokens: int, ignore_eos: bool = False):
        # committed entries, plus the frontier entries of one tree (top-k per level after the first)
        self._drafter_entries = len(prompt_ids) + max_new_tokens + max(self.policy.max_levels - 1, 0) * self.tree_top_k
        self._prompt_len = len(prompt_ids)
        return super().generate(prompt_ids, max_new_tokens, ignore_eos=ignore_eos)

    def prefill(self, prompt_ids: list[int]):
        root, out = super().prefill(prompt_ids)
        self._pending.clear()
        if self.policy.max_levels > 0:
            self.session = DrafterSession(self.drafter, self._drafter_entries)
            # entry i pairs the target's features at position i with the token that followed it
            self._pending.append((out.hidden, list(prompt_ids[1:]) + [root]))
        return root, out

    # ------------------------------------------------------------------ draft and select
    def draft(self, root_token: int, max_levels: int = 0) -> DraftTree:
        """Draft level by level while the policy asks for more; the policy's selection is kept
        for :meth:`select`."""
        info = DraftInfo()
        self.policy.begin_cycle()
        levels_cap = min(self.policy.max_levels, max_levels)
        cached = self.model.offload.cache.resident()
        experts = self._predict(info, [root_token], None)
        view = CycleView(DraftTree(parents=np.array([-1]), path_probs=np.array([1.0]), tokens=np.array([root_token])),
                         experts, cached, self.cost, 0)
        drafting = None
        while (view.draft_levels < levels_cap and self._room_for_level(view)
               and self._timed(info, "search_time_s", self.policy.keep_drafting, view)):
            start = device_now(self.model.device)
            if drafting is None:
                drafting = DynamicTree(self.session, root_token, self._sync_drafter(), self.tree_top_k)
            else:
                drafting.grow()
            info.drafter_time_s += device_now(self.model.device) - start
            new = np.arange(experts.shape[0], len(drafting.tokens))
            parents = [drafting.parents[v] for v in new]
            context = torch.stack([drafting.output_hidden[p] for p in parents]) if self.drafter_context else None
            experts = np.concatenate([experts, self._predict(info, [drafting.tokens[v] for v in new], context)])
            view = CycleView(self._tree(drafting), experts, cached, self.cost, view.draft_levels + 1)
        info.selection = self._timed(info, "search_time_s", self.policy.select, view)
        info.draft_levels = view.draft_levels
        self._cycle = (view, drafting, info)
        return view.tree

    def select(self, tree: DraftTree) -> np.ndarray:
        return self._cycle[2].selection.nodes

    def draft_info(self) -> DraftInfo:
        return self._cycle[2]

    def _room_for_level(self, view: CycleView) -> bool:
        """Whether the next level's nodes still fit the target's KV slots after the committed tokens."""
        k = self.tree_top_k
        added = k if view.draft_levels == 0 else k * k
        return self.cache_len + view.tree.n_nodes + added <= self.model.max_seq_len

    def _predict(self, info: DraftInfo, tokens, context) -> np.ndarray:
        start = time.perf_counter()
        experts = self.predictor.predict(tokens, context)
        info.predict_time_s += time.perf_counter() - start
        return experts

    @staticmethod
    def _timed(info: DraftInfo, name: str, decide, view: CycleView):
        start = time.perf_counter()
        result = decide(view)
        setattr(info, name, getattr(info, name) + time.perf_counter() - start)
        return result

    def _tree(self, drafting: DynamicTree) -> DraftTree:
        """Every node drafted so far, in drafting order (so each level is a prefix of the next
        tree); path probabilities through the acceptance calibrator when there is one."""
        tree = drafting.tree()
        if self.calibrator is None:
            return tree
        edge = self.calibrator.predict_edge(np.exp(self.edge_logprobs(drafting)))
        probs = np.ones(tree.n_nodes)
        for v in range(1, tree.n_nodes):          # parents come first
            probs[v] = probs[tree.parents[v]] * edge[v]
        return DraftTree(parents=tree.parents, path_probs=probs, tokens=tree.tokens)

    @staticmethod
    def edge_logprobs(drafting: DynamicTree) -> np.ndarray:
        """float64 [n] the drafter's log-probability of each node given its parent (root: 0)."""
        cumulative = np.asarray(drafting.log_probs, dtype=np.float64)
        parents = np.asarray(drafting.parents, dtype=np.int64)
        return np.r_[0.0, cumulative[1:] - cumulative[parents[1:]]]

    def _sync_drafter(self):
        """Run the pending committed entries through the drafter; return the newest entry's output,
        whose distribution drafts level 1."""
        features = torch.cat([f for f, _ in self._pending])
        tokens = torch.tensor([t for _, ts in self._pending for t in ts])
        self._pending.clear()
        return self.session.commit(features, tokens)

    # ------------------------------------------------------------------ commit
    def commit(self, tree: DraftTree, verification: Verification) -> list[int]:
        path, bonus = self.accept(tree, verification)
        return self._commit_path(tree, verification, path, bonus)

    def _commit_path(self, tree: DraftTree, verification: Verification, path: np.ndarray, bonus: int) -> list[int]:
        self._root_position = self.cache_len - self._prompt_len
        self._score_predictions(verification)
        keep = self.keep_path(verification, path)
        tokens = [int(t) for t in tree.tokens[path[1:]]] + [bonus]
        if self.session is not None:
            # EAGLE-3 re-runs the accepted tokens with the target's features: each accepted node's
            # features paired with the token that followed it (the last one with the bonus token)
            self._pending.append((verification.hidden[torch.from_numpy(keep).to(verification.hidden.device)], tokens))
        return tokens

    def _score_predictions(self, verification: Verification) -> None:
        """Compare the verified draft nodes' predicted experts with the true ones; with SpecFit,
        price what the predictor gets wrong into the search (as the simulator does)."""
        view, _, info = self._cycle
        drafted = verification.nodes[1:]
        if drafted.size == 0:
            return
        predicted, true = view.experts[drafted], verification.expert_ids[1:]
        info.predicted_slots = int(predicted.size)
        info.predicted_slots_right = slots_right(predicted, true)
        self._slots_seen += info.predicted_slots
        self._slots_right += info.predicted_slots_right
        if self.price_uncertainty and isinstance(self.policy, SpecFitPolicy):
            c = self.model.config
            # the same price as the simulator's (specfit.simulate.sweep), from the precision measured so far
            self.policy.draft_node_s = uncertainty_price_s(self.cost, c.n_layers, c.top_k,
                                                           self._slots_right / self._slots_seen,
                                                           resident_share=self.model.offload.cache.capacity_share)

    def end_cycle(self, tree: DraftTree, verification: Verification, stats: CycleStats) -> None:
        if self.recorder is None:
            return
        view, drafting, _ = self._cycle
        draft_logprob = self.edge_logprobs(drafting) if drafting is not None else np.zeros(1)
        self.recorder.add_cycle(position=self._root_position, tree=tree, draft_logprob=draft_logprob,
                                predicted_experts=view.experts, verification=verification, stats=stats)


class FullTreeDecoder(SpeculativeDecoder):
    """Greedy decoding that verifies the whole drafted tree at every position and commits one
    token per cycle: a position-indexed trace for exact counterfactual replay.

    Every cycle drafts ``max_levels`` levels (fewer where the output ends), verifies every node,
    and commits the root's verdict, so the output is the greedy autoregressive output.
    """

    def __init__(self, model: MoETransformer, drafter: Eagle3Drafter, cost: CostModel, max_levels: int,
                 predictor: RouterPredictor | None = None, eos_token_ids=(), tree_top_k: int = 4,
                 recorder=None):
        # "verify everything": the rerank policy keeping as many nodes as the tree can have
        policy = RerankPolicy(tree_capacity(tree_top_k, max_levels), max_levels, name="full")
        super().__init__(model, drafter, policy, cost, predictor=predictor, eos_token_ids=eos_token_ids,
                         tree_top_k=tree_top_k, recorder=recorder)

    def commit(self, tree: DraftTree, verification: Verification) -> list[int]:
        return self._commit_path(tree, verification, np.array([0]), int(verification.verdicts[0]))
