"""`specfit demo`'s plan validation and its prompt selection (no demo run)."""

from __future__ import annotations

import json

import pytest

from specfit.demo import DemoPlan, _prompts_file
from specfit.errors import SpecFitError
from specfit.runtime.config import ModelConfig
from specfit.assets import tiny_moe_dir


def test_demo_cache_experts_accepts_every_expert_and_refuses_one_more(tmp_path):
    """0..n_experts per layer is the bundled model's range: n_experts is fine, n_experts + 1 is
    refused before anything runs (not left to fail inside the model load minutes later)."""
    n = ModelConfig.from_dir(tiny_moe_dir()).n_experts
    DemoPlan(out_dir=tmp_path / "ok", cache_experts=n).validate()
    DemoPlan(out_dir=tmp_path / "ok0", cache_experts=0).validate()
    with pytest.raises(SpecFitError, match=rf"--cache-experts: expected 0\.\.{n} .*got {n + 1}"):
        DemoPlan(out_dir=tmp_path / "bad", cache_experts=n + 1).validate()


def test_demo_refuses_more_new_tokens_than_the_bundled_model_has_positions_before_anything_runs(tmp_path):
    """The longest bundled prompt and --max-new-tokens must fit the model's positions: refused in
    validate(), not by the decode after the calibration and the warm-up (and after a rerun has
    cleared the last report)."""
    positions = ModelConfig.from_dir(tiny_moe_dir()).max_position_embeddings
    DemoPlan(out_dir=tmp_path / "ok", max_new_tokens=positions // 2).validate()
    with pytest.raises(SpecFitError, match="--max-new-tokens: expected at least 2"):    # no cycle to record
        DemoPlan(out_dir=tmp_path / "one", max_new_tokens=1).validate()
    with pytest.raises(SpecFitError, match=rf"--max-new-tokens: expected at most \d+ .*{positions} positions.*got "
                                           rf"{positions}"):
        DemoPlan(out_dir=tmp_path / "bad", max_new_tokens=positions).validate()


@pytest.mark.parametrize("bad", [0, -2])
def test_demo_plan_refuses_fewer_than_one_prompt(tmp_path, bad):
    with pytest.raises(SpecFitError, match=rf"n_prompts: expected at least 1, got {bad}"):
        DemoPlan(out_dir=tmp_path / "d", n_prompts=bad).validate()


@pytest.mark.parametrize("n_prompts, per_workload", [(1, 1), (2, 1), (3, 2), (4, 2)])
def test_demo_prompts_file_takes_the_first_ceil_n_over_workloads_of_each(tmp_path, n_prompts, per_workload):
    """n_prompts split over the bundled workloads, rounded up: every workload is represented and
    at least n_prompts prompts are decoded (n_prompts=1 must not give an empty prompts file)."""
    path = _prompts_file(DemoPlan(out_dir=tmp_path, n_prompts=n_prompts), tmp_path)
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    workloads = [r["workload"] for r in records]
    assert len(records) >= n_prompts
    assert {w: workloads.count(w) for w in set(workloads)} == {"docs": per_workload, "math": per_workload}


def test_quick_takes_16_new_tokens_by_default_and_two_prompts():
    assert DemoPlan(quick=True).max_new_tokens == 16
    assert DemoPlan().max_new_tokens == 48
    assert DemoPlan(quick=True).n_prompts == 2


def test_quick_keeps_a_max_new_tokens_given():
    assert DemoPlan(quick=True, max_new_tokens=40).max_new_tokens == 40
    assert DemoPlan(quick=True, max_new_tokens=8).max_new_tokens == 8
    assert DemoPlan(quick=False, max_new_tokens=48).max_new_tokens == 48
