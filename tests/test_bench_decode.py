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


def test_repeated_runs_that_sample_do_not_compare_their_outputs(monkeypatch, capsys):
    """``--temperature``: each policy's runs sample their own tokens, so the table says the outputs
    were not compared (greedy runs must be identical), and prints predicted tokens per cycle."""
    from types import SimpleNamespace

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    decode = bench_module("bench_decode")
    rates = {"ar": 100.0, "specfit": 120.0}

    def run(specs):
        spec = specs[0]
        summary = {"policy": spec, "tokens_per_s": rates[spec], "time_per_cycle_s": 0.01,
                   "tokens_per_cycle": 2.0 if spec == "specfit" else 1.0, "predicted_tokens_per_cycle": 1.9}
        outputs = [[1, 2, 3]] if spec == "ar" else [[4, 5, 6]]             # sampled: they differ
        return SimpleNamespace(summaries=[summary], records=[{"output_ids": o} for o in outputs],
                               policies=[SimpleNamespace()])

    decode.repeated(["ar", "specfit"], 2, run, sampled=True)
    out = capsys.readouterr().out
    assert "outputs sampled (--temperature): not compared" in out and "greedy outputs" not in out
    assert "| specfit | 120.0 | 120.0-120.0 | 1.200 |" in out and "| 2.00 (1.90) |" in out
    decode.repeated(["ar", "specfit"], 1, run)
    assert "greedy outputs identical across every run: no" in capsys.readouterr().out
