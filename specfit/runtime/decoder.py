"""Decoding on the target model, one cycle at a time.

A cycle is the unit both autoregressive and speculative decoding share:

    draft  -> a :class:`~specfit.tree.DraftTree` whose root is the last committed token
    select -> the ancestor-closed nodes to verify (a policy's choice)
    verify -> one target pass over those nodes with a tree mask and per-node positions
    commit -> acceptance (greedy, or tree speculative sampling when ``temperature > 0``), KV
              compaction of the accepted path, the bonus token

:class:`Decoder` is the autoregressive case: the tree is the root alone, so every cycle commits
exactly one target token. The speculative decoder (:mod:`specfit.runtime.speculative`) extends it
by overriding :meth:`Decoder.draft`, :meth:`Decoder.select` and :meth:`Decoder.draft_info` (a
drafter and a policy from :mod:`specfit.policies`); :meth:`Decoder.verify`, the acceptance, the
stopping rules and the per-cycle measurements (:class:`CycleStats`) stay here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..search import Selection
from ..tree import DraftTree
from .acceptance import greedy_accept, sample_accept, target_probs
from .model import ForwardOutput, MoETransformer, causal_mask
from .offload import OffloadCounters

__all__ = ["Decoder", "device_now", "DecodeResult", "Verification", "CycleStats", "DraftInfo"]


@dataclass
class Verification:
    """The target's verdicts on the verified nodes of a tree.

    ``nodes`` are the verified node ids (sorted, with the root); ``verdicts[i]`` is the target's
    greedy next token after ``nodes[i]``, ``logits[i]`` its logits there; ``expert_ids[i, layer,
    k]`` its true experts; ``hidden[i]`` its captured features (EAGLE-3's drafter input).
    """

    nodes: np.ndarray
    verdicts: np.ndarray
    logits: torch.Tensor
    expert_ids: np.ndarray
    hidden: torch.Tensor | None
    offload: OffloadCounters
    verify_time_s: float          # the target pass
    transfer_time_s: float        # host-to-device expert copies within it


@dataclass
class DraftInfo:
    """What a cycle's draft phase decided and what it cost, besides the tree itself, and how
    its expert predictions fared once the target had run the verified nodes."""

    draft_levels: int = 0
    selection: Selection | None = None     # the policy's choice with its predicted outcome
    drafter_time_s: float = 0.0            # the drafter's forward passes
    search_time_s: float = 0.0             # the policy's decisions (keep drafting? which nodes?)
    predict_time_s: float = 0.0            # expert predictions for the drafted nodes
    predicted_slots: int = 0               # (layer, rank) slots predicted for verified draft nodes
    predicted_slots_right: int = 0         # ... naming an expert the node really routed to


@dataclass
class CycleStats:
    """Measurements of one decode cycle, next to what the policy predicted for it."""

    nodes_drafted: int
    nodes_verified: int
    committed_tokens: int          # accepted draft tokens + the bonus token
    draft_time_s: float            # from the cycle's start to the selection (drafter, predictions, policy)
    verify_time_s: float           # from the selection to the committed tokens (target pass, acceptance, KV)
    offload: OffloadCounters       # expert traffic of the verification pass
    target_time_s: float           # the target pass alone
    transfer_time_s: float         # its host-to-device copies
    draft: DraftInfo

    @property
    def cycle_time_s(self) -> float:
        return self.draft_time_s + self.verify_time_s

    def row(self) -> dict:
        """One flat row of ``cycles.parquet`` (predicted columns are NaN when nothing was predicted)."""
        sel = self.draft.selection
        nan = float("nan")
        return {
            "draft_levels": self.draft.draft_levels,
            "nodes_drafted": self.nodes_drafted,
            "nodes_verified": self.nodes_verified,
            "hits": self.offload.total_hits,
            "misses": self.offload.total_misses,
            "hits_per_layer": self.offload.hits.tolist(),       # the report's per-layer heat map
            "misses_per_layer": self.offload.misses.tolist(),
            "bytes_h2d": self.offload.total_bytes_h2d,
            "committed_tokens": self.committed_tokens,
            "cycle_time_s": self.cycle_time_s,
            "draft_time_s": self.draft_time_s,
            "verify_time_s": self.verify_time_s,
            "target_time_s": self.target_time_s,
            "transfer_time_s": self.transfer_time_s,
            "drafter_time_s": self.draft.drafter_time_s,
            "search_time_s": self.draft.search_time_s,
            "predict_time_s": self.draft.predict_time_s,
            "predicted_time_s": sel.time_s if sel else nan,
            "predicted_tokens": sel.expected_tokens if sel else nan,
            "predicted_hits": sel.hits if sel else -1,
            "predicted_misses": sel.misses if sel else -1,
            "prediction_precision": (self.draft.predicted_slots_right / self.draft.predicted_slots
                                     if self.draft.predicted_slots else nan),
        }


@dataclass
class DecodeResult:
    """One prompt's generation. Counters cover every target pass, prefill included;
    ``decode_bytes_h2d`` only the passes after the prefill."""

    prompt_ids: list[int]
    output_ids: list[int]
    stop_reason: str                  # "eos", or "length" when max_new_tokens was reached
    prefill_time_s: float
    decode_time_s: float
    n_cycles: int
    offload: OffloadCounters
    decode_bytes_h2d: int
    cycle_tokens: list[int] = field(default_factory=list)   # tokens each decode cycle added to the output
    cycles: list[CycleStats] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        """Decode-phase throughput: tokens committed by the cycles after the prefill per second."""
        committed = sum(self.cycle_tokens)
        return committed / self.decode_time_s if self.decode_time_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": len(self.prompt_ids),
            "output_ids": list(self.output_ids),
            "n_new_tokens": len(self.output_ids),
            "stop_reason": self.stop_reason,
            "prefill_time_s": self.prefill_time_s,
            "decode_time_s": self.decode_time_s,
            "decode_tokens": sum(self.cycle_tokens),
            "tokens_per_s": self.tokens_per_s,
            "n_cycles": self.n_cycles,
            "bytes_h2d": self.offload.total_bytes_h2d,
            "decode_bytes_h2d": self.decode_bytes_h2d,
            "hits": self.offload.total_hits,
            "misses": self.offload.total_misses,
            "hit_rate": self.offload.hit_rate,
        }


class Decoder:
    """Autoregressive decoding of ``model``.

    Args:
        model: the loaded target (with its expert offload attached).
        eos_token_ids: generation stops after committing one of these (unless ``ignore_eos``).
        temperature: 0 for greedy decoding; above 0 tokens are sampled from the target's
            ``softmax(logits / temperature)``.
        seed: seeds the sampler (a new generation restarts nothing: the stream continues).
    """

    def __init__(self, model: MoETransformer, eos_token_ids=(), temperature: float = 0.0, seed: int = 0):
        if temperature < 0:
            raise ValueError(f"temperature: expected >= 0, got {temperature}")
        self.model = model
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.temperature = float(temperature)
        self.rng = np.random.default_rng(seed)
        self.cache_len = 0          # committed tokens whose K/V are in the cache

    # ------------------------------------------------------------------ generation
    def generate(self, prompt_ids, max_new_tokens: int, ignore_eos: bool = False) -> DecodeResult:
        """Generate up to ``max_new_tokens`` tokens after ``prompt_ids``, measuring every cycle."""
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ValueError("prompt_ids: expected at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected >= 1, got {max_new_tokens}")
        committed_slots = len(prompt_ids) + max_new_tokens
        # slots for draft trees stop at the model's positions (drafting stops where they run out);
        # the committed tokens must fit in any case
        tree_slots = min(self.extra_kv_slots(), max(self.model.config.max_position_embeddings - committed_slots, 0))
        self._ensure_kv_slots(committed_slots + tree_slots)
        totals = OffloadCounters.zeros(self.model.config.n_layers)

        start = device_now(self.model.device)
        root, prefill = self.prefill(prompt_ids)
        prefill_time_s = device_now(self.model.device) - start
        totals += prefill.offload

        output, cycle_tokens, cycles = [root], [], []
        stop_reason = "eos" if self._is_eos(root, ignore_eos) else "length"
        decode_bytes_h2d = 0
        start = device_now(self.model.device)
        while stop_reason != "eos" and len(output) < max_new_tokens:
            cycle_start = device_now(self.model.device)
            # a cycle commits at most depth + 1 tokens: deeper levels could never be used
            tree = self.draft(root, max_levels=max_new_tokens - len(output) - 1)
            nodes = self.select(tree)
            info = self.draft_info()
            selected = device_now(self.model.device)
            verification = self.verify(tree, nodes)
            committed = self.commit(tree, verification)
            done = device_now(self.model.device)
            stats = CycleStats(nodes_drafted=tree.n_nodes, nodes_verified=int(np.size(nodes)),
                               committed_tokens=len(committed), draft_time_s=selected - cycle_start,
                               verify_time_s=done - selected, offload=verification.offload,
                               target_time_s=verification.verify_time_s,
                               transfer_time_s=verification.transfer_time_s, draft=info)
            cycles.append(stats)
            totals += verification.offload
            decode_bytes_h2d += verification.offload.total_bytes_h2d
            committed = committed[: max_new_tokens - len(output)]
            for i, token in enumerate(committed):
                if self._is_eos(token, ignore_eos):
                    committed = committed[: i + 1]
                    stop_reason = "eos"
                    break
            output.extend(committed)
            cycle_tokens.append(len(committed))
            root = committed[-1]
            self.end_cycle(tree, verification, stats)
        decode_time_s = device_now(self.model.device) - start
        return DecodeResult(prompt_ids=prompt_ids, output_ids=output, stop_reason=stop_reason,
                            prefill_time_s=prefill_time_s, decode_time_s=decode_time_s, n_cycles=len(cycle_tokens),
                            offload=totals, decode_bytes_h2d=decode_bytes_h2d, cycle_tokens=cycle_tokens,
                            cycles=cycles)

    def prefill(self, prompt_ids: list[int]) -> tuple[int, ForwardOutput]:
        """Run the prompt; return the first generated token and the pass's output. The prompt's
        K/V stay cached."""
        n = len(prompt_ids)
        out = self.model(prompt_ids, np.arange(n), causal_mask(0, n), logits_rows=[n - 1])
        self.cache_len = n
        if self.temperature > 0:
            p = target_probs(out.logits[-1], self.temperature)
            return int(self.rng.choice(p.size, p=p / p.sum())), out
        return int(out.logits[-1].argmax()), out

    # ------------------------------------------------------------------ one cycle
    def extra_kv_slots(self) -> int:
        """KV slots a cycle may need beyond the committed tokens (the verified nodes but the root)."""
        return 0

    def draft(self, root_token: int, max_levels: int = 0) -> DraftTree:
        """The cycle's draft tree, at most ``max_levels`` deep; autoregressive decoding drafts nothing."""
        return DraftTree(parents=np.array([-1]), path_probs=np.array([1.0]), tokens=np.array([root_token]))

    def select(self, tree: DraftTree) -> np.ndarray:
        """The node ids to verify; autoregressive decoding verifies the whole (root-only) tree."""
        return np.arange(tree.n_nodes)

    def draft_info(self) -> DraftInfo:
        """What the last draft phase decided and cost (nothing for autoregressive decoding)."""
        return DraftInfo()

    def end_cycle(self, tree: DraftTree, verification: Verification, stats: CycleStats) -> None:
        """Called once a cycle is committed and measured (e.g. to record it); nothing here."""

    def verify(self, tree: DraftTree, nodes) -> Verification:
        """One target pass over ``nodes`` (ancestor-closed, with the root), written to the KV
        slots after the committed tokens in node order."""
        nodes = np.asarray(nodes, dtype=np.int64)
        prefix_mask = np.ones((nodes.size, self.cache_len), dtype=bool)
        mask = np.concatenate([prefix_mask, tree.attention_mask(nodes)], axis=1)
        start = device_now(self.model.device)
        out = self.model(tree.tokens[nodes], tree.positions(self.cache_len, nodes), torch.from_numpy(mask))
        verdicts = out.logits.argmax(dim=-1).cpu().numpy()
        verify_time_s = device_now(self.model.device) - start
        return Verification(nodes=nodes, verdicts=verdicts, logits=out.logits, expert_ids=out.expert_ids,
                            hidden=out.hidden, offload=out.offload, verify_time_s=verify_time_s,
                            transfer_time_s=self.model.offload.pass_transfer_time_s())

    def accept(self, tree: DraftTree, verification: Verification) -> tuple[np.ndarray, int]:
        """The accepted path (node ids from the root) and the bonus token: greedy at temperature
        0, tree speculative sampling above."""
        if self.temperature > 0:
            return sample_accept(tree, verification.nodes, verification.logits, self.temperature, self.rng)
        return greedy_accept(tree, verification.nodes, verification.verdicts)

    def commit(self, tree: DraftTree, verification: Verification) -> list[int]:
        """Accept a verified path, keep its K/V, and return the committed tokens: the accepted
        draft tokens, then the bonus token."""
        path, bonus = self.accept(tree, verification)
        self.keep_path(verification, path)
        return [int(t) for t in tree.tokens[path[1:]]] + [bonus]

    def keep_path(self, verification: Verification, path: np.ndarray) -> np.ndarray:
        """Move the K/V of the verified ``path`` nodes to the slots after the committed tokens;
        return their rows in the verification pass."""
        keep = np.searchsorted(verification.nodes, path)         # path nodes' indices in the pass
        if keep.size != verification.nodes.size:                 # otherwise the slots are already in place
            self.model.compact_kv(self.cache_len, keep)
        self.cache_len += keep.size
        return keep

    # ------------------------------------------------------------------ helpers
    def _is_eos(self, token: int, ignore_eos: bool) -> bool:
        return not ignore_eos and token in self.eos_token_ids

    def _ensure_kv_slots(self, n_slots: int) -> None:
        if self.model.max_seq_len < n_slots:
            self.model.setup_kv_cache(n_slots)


def device_now(device: torch.device) -> float:
    """Wall-clock seconds, after the device has finished the work queued so far."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
