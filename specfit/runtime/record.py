"""Recording live decoding as a trace in the simulator's format (:mod:`specfit.traces.format`).

:class:`TraceRecorder` collects, cycle by cycle, what a :class:`~specfit.runtime.decoder.Decoder`
drafted (the whole tree in drafting order, the drafter's log-probabilities, the predicted experts),
what the target said about the verified nodes (verdict, true experts) and the measured times and
bytes, then builds a :class:`~specfit.traces.format.Trace`:

- a *live* trace records the cycles as the policy ran them (verdicts and true experts only for the
  verified nodes);
- a *full* trace comes from a decoder that verifies every drafted node and commits the root's
  verdict alone (``commit_root_only``): one cycle per position of the greedy output — the
  position-indexed trace that :func:`specfit.simulate.replay.replay` replays exactly. Trees are cut
  to the reference tokens that follow their position (after an end-of-sequence token there are none).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import __version__
from ..traces.format import UNKNOWN, Trace
from .decoder import CycleStats
from .prefill import prefill_chunks

__all__ = ["TraceRecorder"]


@dataclass
class _Cycle:
    sequence: int
    position: int
    parent: np.ndarray
    depth: np.ndarray
    token: np.ndarray
    draft_logprob: np.ndarray
    path_prob: np.ndarray
    verdict: np.ndarray
    true_experts: np.ndarray
    predicted_experts: np.ndarray
    verified: np.ndarray
    measured: dict = field(default_factory=dict)


class TraceRecorder:
    """Collects decode cycles into a trace.

    Args:
        model_meta: the trace's ``model`` metadata (name, n_layers, n_experts, top_k,
            expert_bytes, vocab_size).
        drafter_meta, workload: the trace's ``drafter`` and ``workload`` metadata.
        full: the cycles verify every drafted node and commit one token (position-indexed trace).
        recording: extra fields for the ``recording`` metadata (policy, profile, ...).
    """

    def __init__(self, model_meta: dict, drafter_meta: dict, workload: str, full: bool, recording: dict | None = None):
        self.model_meta, self.drafter_meta, self.workload = model_meta, drafter_meta, workload
        self.full = bool(full)
        self.recording = dict(recording or {})
        self.sequence = 0
        self.cycles: list[_Cycle] = []
        self._lengths: dict[int, int] = {}      # sequence -> output tokens (for cutting full trees)
        self._prefill: dict[int, list[list[list[int]]]] = {}   # sequence -> each prompt pass's experts per layer

    def begin_sequence(self, sequence: int) -> None:
        self.sequence = int(sequence)

    def add_prefill(self, expert_ids: np.ndarray, chunk: int = 0) -> None:
        """The prompt's passes: their experts per layer (``expert_ids`` [tokens, L, k], the passes
        of at most ``chunk`` tokens together, :func:`~specfit.runtime.prefill.prefill_chunks`),
        which warmed the expert cache before the sequence's first cycle, one pass after another."""
        L = expert_ids.shape[1]
        self._prefill[self.sequence] = [[np.unique(expert_ids[start:end, layer]).tolist() for layer in range(L)]
                                        for start, end in prefill_chunks(expert_ids.shape[0], chunk)]

    def end_sequence(self, n_output_tokens: int) -> None:
        """The sequence's output is complete: ``n_output_tokens`` tokens, the first from the prefill."""
        self._lengths[self.sequence] = int(n_output_tokens)

    def end_open_sequence(self) -> None:
        """A run stopped within a sequence: its recorded cycles are complete, so it ends at the
        output they committed (a full trace's cycle commits one token, so the output after the
        cycle at position ``p`` has ``p + 2`` tokens; a live trace's cycles need no length)."""
        if self.sequence in self._lengths:
            return
        positions = [c.position for c in self.cycles if c.sequence == self.sequence]
        if positions and self.full:
            self._lengths[self.sequence] = max(positions) + 2

    def add_cycle(self, stats: CycleStats) -> None:
        draft, verification = stats.draft, stats.verification
        tree, predicted_experts, position = draft.tree, draft.experts, stats.position
        draft_logprob = draft.edge_logprob if draft.edge_logprob.size == tree.n_nodes else np.zeros(tree.n_nodes)
        n = tree.n_nodes
        L, k = verification.expert_ids.shape[1:]
        if predicted_experts.shape[1:] != (L, k):      # nothing was predicted: record unknowns
            predicted_experts = np.full((n, L, k), UNKNOWN, dtype=np.int64)
        verdict = np.full(n, UNKNOWN, dtype=np.int64)
        verdict[verification.nodes] = verification.verdicts
        true = np.full((n, L, k), UNKNOWN, dtype=np.int64)
        true[verification.nodes] = verification.expert_ids
        verified = np.zeros(n, dtype=bool)
        verified[verification.nodes] = True
        self.cycles.append(_Cycle(
            sequence=self.sequence, position=int(position), parent=tree.parents, depth=tree.depth, token=tree.tokens,
            draft_logprob=np.asarray(draft_logprob, dtype=np.float64),
            # the schema's path_prob is the drafter's, also where the run decided with calibrated ones
            path_prob=tree.path_probs if draft.drafter_probs is None else draft.drafter_probs, verdict=verdict,
            true_experts=true, predicted_experts=np.asarray(predicted_experts), verified=verified,
            measured={"measured_time_s": stats.cycle_time_s, "measured_draft_s": stats.draft_time_s,
                      "measured_verify_s": stats.verify_time_s,
                      "measured_bytes_h2d": float(stats.offload.total_bytes_h2d)}))

    def __len__(self) -> int:
        return len(self.cycles)

    def trace(self) -> Trace | None:
        """The recorded cycles as a :class:`Trace` (call after the last sequence ended); None when
        there are none (every output ended at its prompt pass's token: no decode cycle ran)."""
        cycles = [self._cut(c) for c in self.cycles if not self.full or self._in_reference(c)]
        if not cycles:
            return None
        sizes = np.array([c.parent.size for c in cycles])
        cat = lambda name: np.concatenate([getattr(c, name) for c in cycles])   # noqa: E731
        meta = {
            "model": dict(self.model_meta),
            "drafter": dict(self.drafter_meta),
            "workload": self.workload,
            "recording": {"kind": "live-full" if self.full else "live", "position_indexed": self.full,
                          "full_verification": self.full, "tool": f"specfit {__version__} decode", **self.recording,
                          # each sequence's prompt passes, in sequence order, one entry per pass (a
                          # prompt in chunks has several): what the cache saw before its cycles
                          "prefill_experts": [p for seq in sorted(self._prefill) for p in self._prefill[seq]],
                          "prefill_pass_counts": [len(self._prefill[seq]) for seq in sorted(self._prefill)],
                          "prefill_sequences": sorted(self._prefill)},
            "provenance": {"real": ["reference tokens", "routing", "draft trees", "draft probabilities", "verdicts",
                                    "predicted experts", "measured times"], "synthesised": []},
        }
        return Trace(
            meta=meta, offsets=np.r_[0, np.cumsum(sizes)].astype(np.int64),
            sequence=np.array([c.sequence for c in cycles], dtype=np.int32),
            position=np.array([c.position for c in cycles], dtype=np.int32),
            parent=cat("parent").astype(np.int16), depth=cat("depth").astype(np.int16),
            token=cat("token").astype(np.int32), draft_logprob=cat("draft_logprob").astype(np.float32),
            path_prob=cat("path_prob").astype(np.float64), verdict=cat("verdict").astype(np.int32),
            true_experts=cat("true_experts").astype(np.int16), predicted_experts=cat("predicted_experts").astype(np.int16),
            verified=cat("verified"),
            measured={name: np.array([c.measured[name] for c in cycles], dtype=np.float64) for name in cycles[0].measured},
        )

    def _in_reference(self, cycle: _Cycle) -> bool:
        # a full trace has one cycle per position whose next token is in the output
        return cycle.position + 1 < self._lengths.get(cycle.sequence, np.iinfo(np.int64).max)

    def _cut(self, cycle: _Cycle) -> _Cycle:
        """A full trace's tree, cut to the depth of the reference tokens left after its position
        (a node past the output's end has no reference token to be verified against; a live run
        that ended there at an EOS drafted past it, so a replay of that cycle verifies fewer
        nodes than the live one did)."""
        if not self.full:
            return cycle
        remaining = self._lengths.get(cycle.sequence, np.iinfo(np.int64).max) - 1 - (cycle.position + 1)
        n = int(np.searchsorted(cycle.depth, remaining, side="right"))     # nodes come in order of depth
        if n == cycle.depth.size:
            return cycle
        return _Cycle(cycle.sequence, cycle.position, cycle.parent[:n], cycle.depth[:n], cycle.token[:n],
                      cycle.draft_logprob[:n], cycle.path_prob[:n], cycle.verdict[:n], cycle.true_experts[:n],
                      cycle.predicted_experts[:n], cycle.verified[:n], cycle.measured)
