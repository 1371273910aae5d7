"""``bench_decode.py --warmup-prompts held-out``: the warm-up's prompts are of the measured
prompts' workloads, from the bundled model's held-out text, and none of them is measured."""

from __future__ import annotations

import json

from bench_helpers import BENCHMARKS, bench_module

from specfit.assets import demo_prompts_path
from specfit.assets.corpus import HELD_OUT_EVERY, build, docs_texts


def test_held_out_warmup_prompts_are_of_both_workloads_and_none_is_measured(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))            # bench_decode.py imports its neighbour busy.py
    decode = bench_module("bench_decode")
    measured = [json.loads(line) for line in demo_prompts_path().read_text().splitlines() if line.strip()]
    path = decode.held_out_prompts(tmp_path / "w.jsonl", demo_prompts_path(), per_workload=4)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["workload"] for r in records] == ["docs"] * 4 + ["math"] * 4
    assert not {r["prompt"][:40] for r in records} & {r["prompt"][:40] for r in measured}
    # the docs prompts open held-out texts (every HELD_OUT_EVERY-th), never a training text
    held = docs_texts()[::HELD_OUT_EVERY]
    for r in records[:4]:
        assert len(r["prompt"]) == 150 and any(t.startswith(r["prompt"]) for t in held)
    # the math prompts are questions, shaped like the demo's, of no training problem
    train = {q.split("\nAnswer:")[0] for q in build(1234, 4000, 0).train_math}
    for r in records[4:]:
        assert r["prompt"].startswith("Question: ") and r["prompt"].endswith("\nAnswer:")
        assert r["prompt"].removesuffix("\nAnswer:") not in train
    assert len({r["prompt"] for r in records}) == 8
