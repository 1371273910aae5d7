"""Decoding on the target model, one cycle at a time, with or without a drafter.

A cycle is three stages that hand each other values, as vLLM's proposer / scorer / sampler do:

    draft  -> a :class:`Draft`: the tree drafted level by level while the policy asked for more
              (root alone without a proposer), the predicted experts of its nodes, the policy's
              selection with its predicted outcome, and what drafting cost
    verify -> a :class:`Verification`: one target pass over the selected nodes (tree mask and
              per-node positions), its verdicts, true experts and expert traffic
    commit -> a :class:`Commit`: acceptance (greedy, or tree speculative sampling when
              ``temperature > 0``), KV compaction of the accepted path, the bonus token

The cycles are measured back to back: each from the end of the previous one's learning step to the
end of its own, so the previous cycle's accounting (its row, the trace recorder, the caller's
callback) is in its time, the cycles' measured times add up to the decode's time but for the last
cycle's accounting, and the cost model learns, and prices, all of it (the policy's own overhead per
decision, learned without an online refit, is its draft phase's alone: :attr:`Draft.phase_s`).

Autoregressive decoding is the case without a proposer. After each cycle the policy observes what
verification revealed (:meth:`specfit.policies.Policy.observe`), exactly as the simulator reports
it, and the expert predictor learns the verified nodes' routing. With ``commit_root_only`` the
decoder commits the root's verdict alone whatever was verified: with a policy that verifies every
drafted node, that records the position-indexed trace the simulator replays exactly.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import time
from typing import Callable

import numpy as np
import torch

from .. import kernels
from ..calibrate.online import OnlineCostModel
from ..costmodel import CostModel, expert_union
from ..errors import SpecFitError
from ..experts.calibration import AcceptanceCalibrator
from ..experts.predictors import ExpertPredictor, NodeBatch, slots_right
from ..policies import ArPolicy, CycleView, Observation, Policy
from ..search import packed
from ..tree import DraftTree
from .acceptance import NonFiniteLogits, greedy_accept, sample_accept, sample_token
from . import levers
from .drafting import Proposer, tree_capacity
from .model import ForwardOutput, MoETransformer, causal_mask
from .cycle import Commit, CycleStats, DecodeResult, Draft, Verification
from .offload import OffloadCounters
from .prefill import PREFILL_CHUNK, check_prefill_chunk, prefill_chunks

__all__ = ["Decoder", "device_now", "device_clock", "charged_misses", "check_finite_logits", "greedy_verdicts", "DecodeResult", "Draft", "Verification", "Commit", "CycleStats"]


# the arrays of a tree that is its root alone (shared: the tree holds read-only views of them)
_ROOT_PARENTS, _ROOT_PROBS, _ROOT_DEPTH = np.array([-1]), np.array([1.0]), np.array([0])
_NO_EXPERTS = np.zeros((1, 0, 0), dtype=np.int64)     # the root's, before (or without) predictions
_NO_EXPERTS.setflags(write=False)


class Decoder:
    """Decoding of ``model``, speculative when it has a ``proposer``.

    Args:
        model: the loaded target (with its expert offload attached).
        proposer: drafts the trees (:class:`~specfit.runtime.drafting.Proposer`); None decodes
            autoregressively.
        policy: decides how deep to draft and what to verify (default ``ar``); the same objects
            the simulator replays.
        cost: the cycle-time model the policy decides with (a profile's); None: nothing is
            predicted (autoregressive decoding only).
        predictor: predicts the draft nodes' experts (default: the target's routers).
        eos_token_ids: generation stops after committing one of these (unless ``ignore_eos``).
        temperature: 0 for greedy decoding; above 0 tokens are sampled from the target's
            ``softmax(logits / temperature)`` (lossless tree speculative sampling).
        seed: seeds the sampler (a new generation restarts nothing: the stream continues).
        calibrator: the acceptance calibrator that turns the drafter's probabilities into path
            probabilities (None: the drafter's own).
        recorder: receives every cycle (see :class:`specfit.runtime.record.TraceRecorder`).
        commit_root_only: commit the root's verdict alone every cycle (full-tree recording).
        online_refit: refit the cost model on the run's measured cycles as it goes, the profile
            (``cost``) as the prior, and let the policy decide with it (True: an
            :class:`~specfit.calibrate.online.OnlineCostModel` with its defaults; an instance to
            configure it; False: the profile, frozen).
        pause_gc: no automatic cyclic garbage collection while a generation's cycles run (one
            young-generation collection when they end, inside the decode time). Python's collector
            otherwise stops a cycle at random for up to milliseconds (a full collection: far
            longer; ``benchmarks/RESULTS.md``, "Deterministic noise out of the cycle times"), which is
            noise in every cycle time the cost model learns from and is checked against; the cycles
            themselves leave no reference cycles behind (a test pins it), so nothing accumulates.
            The collector is the process's: an application whose other threads make cyclic
            garbage while a generation runs can pass False.
        prefill_chunk: the prompt runs through the target and the drafter in passes of at most
            this many tokens (:mod:`specfit.runtime.prefill`); 0 runs it in one pass.
    """

    def __init__(self, model: MoETransformer, proposer: Proposer | None = None, policy: Policy | None = None,
                 cost: CostModel | None = None, predictor: ExpertPredictor | None = None, eos_token_ids=(),
                 temperature: float = 0.0, seed: int = 0, calibrator: AcceptanceCalibrator | None = None,
                 recorder=None, commit_root_only: bool = False, online_refit: bool | OnlineCostModel = True,
                 pause_gc: bool = True, prefill_chunk: int = PREFILL_CHUNK):
        if not 0 <= temperature < float("inf"):      # NaN too: it would decode greedily, silently
            raise ValueError(f"temperature: expected >= 0 and finite, got {temperature}")
        if commit_root_only and temperature > 0:
            # a full-tree recording is of the greedy output: its root verdict is the argmax
            raise ValueError(f"commit_root_only: a full-tree recording decodes greedily; got temperature {temperature}")
        policy = policy or ArPolicy()
        if policy.max_levels > 0 and proposer is None:
            raise ValueError(f"policy {policy.name!r} drafts: it needs a proposer (a drafter)")
        if policy.max_levels > 0 and cost is None:
            raise ValueError(f"policy {policy.name!r} decides with a cost model: pass cost")
        self.model, self.proposer, self.policy, self.cost = model, proposer, policy, cost
        self.online: OnlineCostModel | None = None
        if online_refit and cost is not None:
            self.online = online_refit if isinstance(online_refit, OnlineCostModel) else OnlineCostModel(cost)
        self._pending = None                  # the last cycle's counts and full time, for the online fit
        if predictor is None and cost is not None:
            from ..experts.router import RouterPredictor

            predictor = RouterPredictor(model)
        self.predictor = predictor
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.temperature = float(temperature)
        self.rng = np.random.default_rng(seed)
        self.calibrator, self.recorder, self.commit_root_only = calibrator, recorder, bool(commit_root_only)
        self.pause_gc = bool(pause_gc)
        self.prefill_chunk = check_prefill_chunk(prefill_chunk, "prefill_chunk")
        self.top_k = None if proposer is None else (policy.draft_top_k or proposer.top_k)
        self._max_nodes = 1 if proposer is None else tree_capacity(self.top_k, policy.max_levels)   # per tree
        # the drafter's states estimate the target's only when they live in the same space
        self.drafter_context = (proposer is not None and proposer.context_in_target_space
                                and proposer.drafter.config.hidden_size == model.config.hidden_size)
        self._now = device_clock(model.device)   # seconds, after the compute stream's queued work
        self.cache_len = 0                  # committed tokens whose K/V are in the cache
        self._last_known: np.ndarray | None = None   # [L, k] routing of the last committed token the target ran

    # ------------------------------------------------------------------ generation
    def generate(self, prompt_ids, max_new_tokens: int, ignore_eos: bool = False,
                 on_cycle: Callable[[CycleStats, int], None] | None = None) -> DecodeResult:
        """Generate up to ``max_new_tokens`` tokens after ``prompt_ids``, measuring every cycle;
        ``on_cycle(stats, tokens)`` gets each cycle as soon as it is committed, with the tokens it
        added to the output (fewer than it committed when the output ends inside it)."""
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ValueError("prompt_ids: expected at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected >= 1, got {max_new_tokens}")
        committed_slots = len(prompt_ids) + max_new_tokens
        # slots for draft trees stop at the model's positions (drafting stops where they run out);
        # the committed tokens must fit in any case
        tree_slots = 0 if self.proposer is None else tree_capacity(self.top_k, self.policy.max_levels) - 1
        tree_slots = min(tree_slots, max(self.model.config.max_position_embeddings - committed_slots, 0))
        if self.model.max_seq_len < committed_slots + tree_slots:
            self.model.setup_kv_cache(committed_slots + tree_slots)
        totals = OffloadCounters.zeros(self.model.config.n_moe_layers)

        now = self._now
        start = now()
        self.model.offload.cache.begin_prompt()
        try:
            root, prefill = self.prefill(prompt_ids, max_new_tokens)
        finally:                 # a prompt that fails leaves no cache in its prompt phase
            self.model.offload.cache.begin_decode()
        prefill_time_s = now() - start
        totals += prefill.offload

        output, cycle_tokens, cycles = [root], [], []
        stop_reason = "eos" if self._is_eos(root, ignore_eos) else "length"
        decode_bytes_h2d = 0
        expert_bytes = self.model.offload.host.expert_bytes
        # on a CPU with one torch thread the decoding thread does a cycle's work, so the wall time it
        # did not run is time it waited for a CPU (another process had it), but for its wait on the
        # prefetch copies (a worker thread of the offload's)
        sole_thread = self.model.device.type == "cpu" and torch.get_num_threads() == 1
        start = cycle_start = now()
        cpu_start = time.thread_time()
        with gc_paused(self.pause_gc):
            while stop_reason != "eos" and len(output) < max_new_tokens:
                update_s = self._observe_last_cycle()
                # a cycle commits at most depth + 1 tokens: deeper levels could never be used
                draft = self.draft(root, max_levels=max_new_tokens - len(output) - 1)
                selected = now()
                levers.finish_prefetch(self, draft)
                # global mode can evict a later layer's expert within the pass: its check needs the state
                before = copy.deepcopy(self.model.offload.cache) if self.model.offload.cache.mode == "global" else None
                keep = levers.cache_keep(self, draft)
                verification = self.verify(draft.tree, draft.nodes, keep=keep)
                commit = self.commit(draft, verification)
                verified = now()
                stats = CycleStats(position=len(output) - 1, draft=draft, verification=verification,
                                   path=commit.path, edges=commit.edges, committed_tokens=len(commit.tokens),
                                   draft_time_s=selected - cycle_start,
                                   verify_time_s=verified - selected, online=self.online is not None,
                                   update_time_s=update_s)
                self._learn(stats)
                learned, cpu_learned = now(), time.thread_time()
                stats.learn_time_s = learned - verified
                stats.cpu_time_s = cpu_learned - cpu_start
                if sole_thread:
                    stats.waited_s = max(stats.cycle_time_s - stats.cpu_time_s - draft.prefetch_wait_s, 0.0)
                offload = verification.offload
                priced = None if draft.selection is None else (draft.selection.hits, draft.selection.misses)
                # the cycle as the online model learns it: without an expert predictor's refit, a
                # step of one cycle in many (~60 ms of a learned predictor's every 64 cycles), which
                # the speed tracker took for a slower machine (the next cycles over-predicted up to 2.7x)
                refit_s = self.predictor.refit_s if self.predictor is not None else 0.0
                self._pending = ((draft.draft_levels, int(verification.nodes.size), offload.total_hits,
                                  offload.total_misses, stats.cycle_time_s - refit_s), priced, update_s,
                                 draft.drafter_time_s)
                self._account(stats, before, keep)
                cycles.append(stats)
                totals += offload
                decode_bytes_h2d += offload.total_bytes_h2d + draft.prefetched * expert_bytes
                tokens = commit.tokens[: max_new_tokens - len(output)]
                for i, token in enumerate(tokens):
                    if self._is_eos(token, ignore_eos):
                        tokens = tokens[: i + 1]
                        stop_reason = "eos"
                        break
                output.extend(tokens)
                cycle_tokens.append(len(tokens))
                root = tokens[-1]
                if self.recorder is not None:
                    self.recorder.add_cycle(stats)
                if on_cycle is not None:
                    on_cycle(stats, len(tokens))
                _release(stats)
                # the next cycle starts where this one's measured part ended: its accounting above
                # (the union counts, the recorder, the callback) is in the next cycle's time
                cycle_start, cpu_start = learned, cpu_learned
        decode_time_s = now() - start
        return DecodeResult(prompt_ids=prompt_ids, output_ids=output, stop_reason=stop_reason,
                            prefill_time_s=prefill_time_s, decode_time_s=decode_time_s, n_cycles=len(cycle_tokens),
                            offload=totals, decode_bytes_h2d=decode_bytes_h2d, prefill_offload=prefill.offload,
                            cycle_tokens=cycle_tokens, cycles=cycles)

    def prefill(self, prompt_ids: list[int], max_new_tokens: int = 0):
        """Run the prompt; return the first generated token and the prompt's output (its passes
        together: every token's routing and features, the last token's logits, the passes'
        expert traffic). The prompt's K/V stay cached; the proposer's session starts with the
        prompt's features."""
        n = len(prompt_ids)
        out = self._prompt_passes(prompt_ids)
        # NaN logits argmax to token 0: the output would be garbage (or an instant EOS), silently
        check_finite_logits(self.model, out.logits[-1], "the prompt's pass")
        self.cache_len = n
        self._last_known = out.expert_ids[-1]
        if self.predictor is not None:       # the prompt's routing is the first thing a predictor can learn
            self.predictor.update(np.asarray(prompt_ids), out.expert_ids, self.model.config.n_experts)
        if self.recorder is not None:
            self.recorder.add_prefill(out.expert_ids, self.prefill_chunk)
        if self.temperature > 0:
            root = sample_token(out.logits[-1], self.temperature, self.rng)
        else:
            root = int(out.logits[-1].argmax())
        if self.proposer is not None:
            # committed entries, plus the frontier entries of one tree (top-k per level after the first)
            entries = n + max_new_tokens + max(self.policy.max_levels - 1, 0) * self.top_k
            self.proposer.start(prompt_ids, out.hidden, root, entries, chunk=self.prefill_chunk)
        return root, out

    def _prompt_passes(self, prompt_ids: list[int]) -> ForwardOutput:
        """The prompt through the target in passes of at most :attr:`prefill_chunk` tokens, each a
        causal continuation of the KV entries the passes before it wrote; their outputs joined."""
        if not len(prompt_ids):
            raise ValueError("prompt_ids: expected at least one token")
        passes, offload = [], OffloadCounters.zeros(self.model.config.n_moe_layers)
        for start, end in prefill_chunks(len(prompt_ids), self.prefill_chunk):
            out = self.model(prompt_ids[start:end], np.arange(start, end), causal_mask(start, end - start),
                             logits_rows=[end - start - 1])
            offload += out.offload
            passes.append(out)
        if len(passes) == 1:
            return passes[0]
        hidden = None if out.hidden is None else torch.cat([p.hidden for p in passes])
        return ForwardOutput(logits=out.logits, expert_ids=np.concatenate([p.expert_ids for p in passes]),
                             hidden=hidden, offload=offload)

    # ------------------------------------------------------------------ the three stages
    def draft(self, root_token: int, max_levels: int = 0) -> Draft:
        """Draft level by level while the policy asks for more (at most ``max_levels``), then let
        it select the nodes to verify."""
        began = self._now()
        draft = Draft(tree=DraftTree.grown(_ROOT_PARENTS, _ROOT_PROBS, np.array([root_token]), _ROOT_DEPTH),
                      experts=_NO_EXPERTS, edge_logprob=np.zeros(1), nodes=np.zeros(1, dtype=np.int64), selection=None,
                      cached=self.model.offload.cache.resident(read_only=True), cost=self.cost)
        if self.cost is None:                           # nothing to decide with: verify the root
            return draft
        self.policy.begin_cycle()
        draft.experts = self._predict(draft, np.array([root_token]), None)
        view = CycleView(draft.tree, draft.experts, draft.cached, self.cost, 0)
        levels_cap = min(self.policy.max_levels, max_levels)
        tree = None
        prefetcher = self.policy.prefetcher
        if prefetcher is not None:
            prefetcher.begin_cycle()
        while (view.draft_levels < levels_cap and self._room_for_level(view)
               and self._decide(draft, self.policy.keep_drafting, view)):
            if tree is None:
                tree = self.proposer.draft(root_token, levels_cap, self.top_k, self.calibrator)
            if prefetcher is not None:        # copies beside the level about to be drafted
                view = levers.prefetch_level(self, draft, view, prefetcher)
            start, calibrating = self._now(), tree.calibration_s
            level = tree.grow()
            # the drafter's passes with their top-k and tree arrays; the acceptance calibration is bookkeeping
            draft.drafter_time_s += self._now() - start - (tree.calibration_s - calibrating)
            context = level.context if self.drafter_context else None
            draft.experts = np.concatenate([draft.experts, self._predict(draft, level.tokens, context)])
            view = CycleView(tree.tree(), draft.experts, view.cached, self.cost, view.draft_levels + 1)
        if self.online is not None and draft.drafter_time_s > 0:
            # the selection prices the rest of the cycle at the speed its drafter passes showed
            view = CycleView(view.tree, view.experts, view.cached,
                             self.online.within_cycle(draft.drafter_time_s, view.draft_levels), view.draft_levels)
        if tree is not None and self.calibrator is not None:
            # the drafter's own path probabilities beside the calibrated ones (EAGLE's rerank ranks by them)
            view = dataclasses.replace(view, drafter_probs=np.exp(tree.cum_logprob[:tree.n_nodes]))
            draft.drafter_probs = view.drafter_probs
        draft.selection = self._decide(draft, self.policy.select, view)
        draft.cached = view.cached
        draft.nodes, draft.tree, draft.draft_levels = draft.selection.nodes, view.tree, view.draft_levels
        if tree is not None:
            draft.edge_logprob = tree.edge_logprob
        draft.phase_s = self._now() - began
        return draft

    def verify(self, tree: DraftTree, nodes, keep: np.ndarray | None = None) -> Verification:
        """One target pass over ``nodes`` (ancestor-closed, with the root), written to the KV
        slots after the committed tokens in node order; ``keep`` (float [L, E]) orders the expert
        cache's evictions during the pass (the policy's cache advisor)."""
        nodes = np.asarray(nodes, dtype=np.int64)
        mask = tree.attention_mask(nodes, prefix_len=self.cache_len)
        start = self._now()
        self.model.offload.keep = keep
        try:
            # the mask's kernel checked the ids: the positions need no second check on the hot path
            out = self.model(tree.tokens[nodes], self.cache_len + tree.depth[nodes], torch.from_numpy(mask))
        finally:
            self.model.offload.keep = None
        try:
            verdicts = greedy_verdicts(out.logits)
        except NonFiniteLogits:
            check_finite_logits(self.model, out.logits, f"the verification pass after {self.cache_len} tokens")
            raise
        target_time_s = self._now() - start
        return Verification(nodes=nodes, verdicts=verdicts, logits=out.logits, expert_ids=out.expert_ids,
                            hidden=out.hidden, offload=out.offload, target_time_s=target_time_s,
                            transfer_time_s=self.model.offload.pass_transfer_time_s())

    def commit(self, draft: Draft, verification: Verification) -> Commit:
        """Accept a verified path, keep its K/V, hand the accepted entries to the proposer."""
        edges = None
        if self.commit_root_only:
            path, bonus = np.zeros(1, dtype=np.int64), int(verification.verdicts[0])
        elif self.temperature > 0:
            path, bonus, edges = sample_accept(draft.tree, verification.nodes, verification.logits, self.temperature,
                                               self.rng)
        else:
            path, bonus = greedy_accept(draft.tree, verification.nodes, verification.verdicts)
        rows = self.keep_path(verification, path)
        tokens = draft.tree.tokens[path[1:]].tolist() + [bonus]
        self._last_known = verification.expert_ids[rows[-1]]
        if self.proposer is not None:
            # EAGLE-3 re-runs the accepted tokens with the target's features: each accepted node's
            # features paired with the token that followed it (the last one with the bonus token)
            hidden = verification.hidden
            index = torch.from_numpy(rows)
            self.proposer.accept(hidden[index if hidden.device.type == "cpu" else index.to(hidden.device)], tokens)
        return Commit(path=path, rows=rows, tokens=tokens, edges=edges)

    def keep_path(self, verification: Verification, path: np.ndarray) -> np.ndarray:
        """Move the K/V of the verified ``path`` nodes to the slots after the committed tokens;
        return their rows in the verification pass."""
        keep = verification.nodes.searchsorted(path)             # path nodes' indices in the pass
        if keep.size != verification.nodes.size:                 # otherwise the slots are already in place
            self.model.compact_kv(self.cache_len, keep)
        self.cache_len += keep.size
        return keep

    # ------------------------------------------------------------------ helpers
    def _learn(self, stats: CycleStats) -> None:
        """What verification revealed goes to the policy and the predictor, as in the simulator."""
        verification, drafted = stats.verification, stats.verification.nodes[1:]
        if drafted.size:
            predicted, true = stats.draft.experts[drafted], verification.expert_ids[1:]
            stats.predicted_slots, stats.predicted_slots_right = int(predicted.size), slots_right(predicted, true)
        draft = stats.draft
        # the policy's own time this cycle: everything in the draft phase but the drafter's passes
        # (its decisions, the expert predictions, trees and views per level), not the previous
        # cycle's accounting, recording and callback that the cycle's measured time begins with.
        # With the online refit the cost model is fitted on measured cycles, which hold that time
        # already: a policy that priced it on top would count it twice
        decision_time_s = None
        if draft.selection is not None and self.online is None:
            decision_time_s = max(draft.phase_s - draft.drafter_time_s, 0.0)
        # sampling accepts a drafted child of a path node with the target's probability of its token:
        # the outcome a policy that learns acceptance learns from (the walk's edges; greedy decoding's:
        # the verdicts)
        self.policy.observe(Observation(predicted_slots=stats.predicted_slots,
                                        predicted_slots_right=stats.predicted_slots_right,
                                        resident_share=self.model.offload.cache.capacity_share,
                                        tree=draft.tree, verified=verification.nodes, verdicts=verification.verdicts,
                                        draft_levels=draft.draft_levels, decision_time_s=decision_time_s,
                                        edges=stats.edges, **levers.miss_report(draft, verification)))
        levers.observe_union(self, verification)
        if self.predictor is not None and self.predictor.learning:
            nodes = verification.nodes
            last = None if draft.last_known is None else draft.last_known_rows[:nodes.size]
            context = np.concatenate(draft.contexts)[nodes] if draft.contexts else None
            self.predictor.update(stats.draft.tree.tokens[nodes], verification.expert_ids,
                                  self.model.config.n_experts, last_known=last, context=context)

    def _account(self, stats: CycleStats, before, keep=None) -> None:
        """The cycle's union accounting in one pass (:func:`specfit.kernels.evaluate.union_accounting`):
        per layer the true and predicted unions, their overlap and misses against the residency
        the policy saw, and the misses the cache's bookkeeping charges the true experts
        (``before``: the cache before a global-mode pass, which admits layer by layer, with the
        pass's eviction priorities ``keep``)."""
        draft, verification = stats.draft, stats.verification
        if draft.selection is not None and draft.experts.shape[1:] == verification.expert_ids.shape[1:]:
            stats.union_counts = kernels.evaluate.union_accounting(draft.experts, verification.nodes,
                                                                   verification.expert_ids, packed(draft.cached))
            if before is None:
                stats.charged_misses_per_layer = stats.union_counts[kernels.evaluate.TRUE_MISSES]
                return
        stats.charged_misses_per_layer = charged_misses(verification.expert_ids, draft.cached, before, keep)

    def _observe_last_cycle(self) -> float:
        """The online cost model sees the previous cycle (whose time is complete only once its own
        learning has run) before this one is decided: the model that prices a cycle has seen every
        cycle before it. Runs inside the new cycle's time; returns its seconds, which the model is
        handed with this cycle when the next one starts (it prices its own update, see
        :class:`~specfit.calibrate.online.OnlineCostModel`)."""
        if self.online is None or self._pending is None:
            return 0.0
        start = time.perf_counter()
        counts, priced, overhead_s, drafter_s = self._pending
        self.online.observe(*counts, priced=priced, overhead_s=overhead_s, drafter_s=drafter_s)
        self.cost = self.online.cost
        self._pending = None
        return time.perf_counter() - start

    def _predict(self, draft: Draft, tokens: np.ndarray, context) -> np.ndarray:
        start = time.perf_counter()
        n = len(tokens)
        if draft.last_known is None:          # once per cycle: the routing every node's prediction sees
            draft.last_known = last = self._last_known
            # as rows the kernels read in place (two C calls; np.broadcast_to's view costs many Python calls)
            draft.last_known_rows = rows = np.empty((self._max_nodes,) + last.shape, dtype=np.int64)
            rows[...] = last
        if context is not None and context.is_cpu:
            # predictors read host contexts as float32 arrays (a view where they are float32 already)
            context = (context if context.dtype == torch.float32 else context.float()).numpy()
        if self.drafter_context:      # kept for the predictor's update (a probe of the drafter's state)
            draft.contexts.append(np.full((n, self.model.config.hidden_size), np.nan, dtype=np.float32)
                                  if context is None else context if isinstance(context, np.ndarray)
                                  else context.float().cpu().numpy())
        experts = self.predictor.predict(NodeBatch(tokens=tokens, last_known=draft.last_known_rows[:n], context=context))
        draft.predict_time_s += time.perf_counter() - start
        return np.asarray(experts, dtype=np.int64)

    @staticmethod
    def _decide(draft: Draft, decide, view: CycleView):
        start = time.perf_counter()
        result = decide(view)
        draft.search_time_s += time.perf_counter() - start
        return result

    def _room_for_level(self, view: CycleView) -> bool:
        """Whether the next level's nodes still fit the target's KV slots after the committed tokens."""
        added = self.top_k if view.draft_levels == 0 else self.top_k * self.top_k
        return self.cache_len + view.tree.n_nodes + added <= self.model.max_seq_len

    def _is_eos(self, token: int, ignore_eos: bool) -> bool:
        return not ignore_eos and token in self.eos_token_ids


def _release(stats: CycleStats) -> None:
    """Drop what only the cycle itself read (its logits and captured features, the predictions'
    rows of the last known routing and drafter contexts) once its rows, recording and callback
    have it: a generation keeps its cycles, and these held a [nodes, vocab] logits tensor per cycle
    (on the device, under CUDA) to its end: 0.63 MB a cycle of the bundled model's EAGLE-3 tree,
    about 18 MB of Qwen3-30B-A3B's."""
    stats.verification.logits = stats.verification.hidden = None
    stats.draft.last_known_rows, stats.draft.contexts = None, []


def greedy_verdicts(logits: torch.Tensor) -> np.ndarray:
    """int64 [T]: the target's greedy token at each row of ``logits`` [T, V] (the first of tied
    maxima, as ``torch.argmax``), on the host. Host logits numpy reads in place: its argmax over a
    verification pass's logits takes a few microseconds, an order of magnitude less than torch's
    dispatch (``benchmarks/RESULTS.md``, "Stop 26: what removing calls from the live cycle buys").
    A row with no greedy token (a NaN, which both argmaxes take for the maximum, or every logit
    ``-inf``) raises :class:`~specfit.runtime.acceptance.NonFiniteLogits`."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        host = logits.numpy()
        verdicts = host.argmax(axis=-1)
        bad = ~(host[np.arange(verdicts.size), verdicts] > -np.inf)
    else:       # one copy to the host: the rows without a greedy token marked -1
        index = logits.argmax(dim=-1)
        verdicts = torch.where(logits.gather(-1, index[:, None])[:, 0] > -torch.inf, index, -1).cpu().numpy()
        bad = verdicts < 0
    if bad.any():
        raise NonFiniteLogits(f"logits: row {int(bad.argmax())} holds NaN or no logit above -inf")
    return verdicts


def check_finite_logits(model, logits: torch.Tensor, what: str) -> None:
    """One clear error when ``logits`` of ``model`` (``what``: the pass) hold NaN or inf: a
    tensor of the checkpoint holds them, or the dtype overflows."""
    if not bool(torch.isfinite(logits).all()):
        source = getattr(model, "source", None)
        raise SpecFitError(f"target model{f' {source}' if source else ''}: {what} gave NaN or infinite logits; "
                           "expected finite weights (a tensor of the checkpoint holds NaN or inf, or the dtype "
                           "overflows)")


def charged_misses(expert_ids: np.ndarray, cached: np.ndarray, before=None, keep=None) -> np.ndarray:
    """int [L]: misses of the true experts (``expert_ids[node, layer, k]`` of the verified nodes)
    against the residency ``cached[layer, expert]`` before the cycle, as the expert cache's own
    bookkeeping gives them: per layer, the union's experts not resident; in global mode (``before``,
    a copy of the cache before the pass) by admitting each layer's union in order with the pass's
    eviction priorities ``keep`` (a cache advisor's, or None), as the offload does, since an admit
    can evict an expert a later layer then misses."""
    n_experts = cached.shape[1]
    union = expert_union(expert_ids, np.arange(expert_ids.shape[0]), n_experts)
    if before is None:
        return np.count_nonzero(union & ~cached, axis=1).astype(np.int64)
    misses = np.zeros(union.shape[0], dtype=np.int64)
    for layer in range(union.shape[0]):
        row = np.zeros_like(union)
        row[layer] = union[layer]
        misses[layer] = before.admit(row, keep=keep).misses[layer]
    return misses


@contextlib.contextmanager
def gc_paused(pause: bool = True):
    """No automatic cyclic garbage collection inside the block (when ``pause``); one collection of
    the youngest generation when it ends, so what the block left unreachable is freed there and
    then, and the collector's state is as it was before."""
    was_enabled = gc.isenabled()
    if pause:
        gc.disable()
    try:
        yield
    finally:
        if pause and was_enabled:
            gc.enable()
            gc.collect(0)


def device_now(device: torch.device) -> float:
    """Wall-clock seconds, after the device has finished the work queued so far on its compute
    stream (the current one). Not ``torch.cuda.synchronize``, which waits for every stream: for the
    expert copies on the offload's copy stream too, so a clock read just after a prefetch would hold
    the drafter back until its copies landed; compute waits for a copy where it reads one."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return time.perf_counter()


def device_clock(device: torch.device) -> Callable[[], float]:
    """:func:`device_now` for one device, as a function of no arguments (the decoder reads it a
    dozen times per cycle: on the host it is the plain clock)."""
    if device.type != "cuda":
        return time.perf_counter
    return lambda: device_now(device)
