"""A hand-made position-indexed trace whose every replay number is worked out in the tests, and
the shipped sample traces."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specfit.traces.format import Trace

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_QWEN3 = ROOT / "traces" / "qwen3-30b-a3b-chat.parquet"
SAMPLE_OLMOE = ROOT / "traces" / "olmoe-1b-7b-real-routing.parquet"


def hand_trace() -> Trace:
    """Reference output 10 11 12 13; one layer, four experts, top-1; trees at positions 0, 1, 2.

    position 0: root 10 (e0) -> A 11 (e1, p .9) -> C 12 (e3, p .8); root -> B 20 (e2, p .05)
    position 1: root 11 (e1) -> 12 (e3, p .5)
    position 2: root 12 (e3) -> 50 (e0, p .4), rejected (the target says 13)
    """
    path_prob = np.array([1.0, 0.9, 0.05, 0.8, 1.0, 0.5, 1.0, 0.4])
    edge = np.array([1.0, 0.9, 0.05, 0.8 / 0.9, 1.0, 0.5, 1.0, 0.4])
    return Trace(
        meta={"model": {"name": "hand", "n_layers": 1, "n_experts": 4, "top_k": 1, "expert_bytes": 1000},
              "drafter": {"name": "hand"}, "workload": "test",
              "recording": {"kind": "synthetic", "position_indexed": True, "full_verification": True},
              "provenance": {"real": [], "synthesised": ["everything"]}},
        offsets=np.array([0, 4, 6, 8]), sequence=np.zeros(3, dtype=np.int32), position=np.arange(3, dtype=np.int32),
        parent=np.array([-1, 0, 0, 1, -1, 0, -1, 0], dtype=np.int16),
        depth=np.array([0, 1, 1, 2, 0, 1, 0, 1], dtype=np.int16),
        token=np.array([10, 11, 20, 12, 11, 12, 12, 50], dtype=np.int32),
        draft_logprob=np.log(edge).astype(np.float32), path_prob=path_prob,
        verdict=np.array([11, 12, 99, 13, 12, 13, 13, 7], dtype=np.int32),
        true_experts=np.array([0, 1, 2, 3, 1, 3, 3, 0], dtype=np.int16).reshape(8, 1, 1),
    )
