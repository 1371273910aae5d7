"""An independent small draft model (any supported MoE architecture, same tokenizer) as the
drafter: lossless output for every policy, and one clear error for a mismatched vocabulary."""

import json

import pytest
from typer.testing import CliRunner

from runtime_fixtures import make_tiny_model, torch_single_thread  # noqa: F401  (autouse fixture)
from specfit.cli import app
from specfit.runtime import drafting

PROMPTS = [[3, 17, 42, 7], [5, 5, 9], [60, 1, 2, 3, 4, 5]]


@pytest.fixture(autouse=True)
def _one_thread(torch_single_thread):  # noqa: F811  (the imported fixture, requested by name)
    yield


def decode(tmp_path, target, drafter, policies, profile="pcie4"):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    result = CliRunner().invoke(app, ["decode", "--model", str(target), "--drafter", str(drafter), "--policies",
                                      policies, "--prompts", str(prompts), "--cache-experts", "3", "--max-new-tokens",
                                      "12", "--ignore-eos", "--profile", profile, "--rescale", "--json"])
    return result


def test_a_draft_model_of_another_family_drafts_losslessly(tmp_path, monkeypatch):
    # with the warm-up a GPU runs (each catch-up length once, in the first prefill), here on the CPU
    monkeypatch.setattr(drafting, "WARM_LENGTHS", {"cpu": 5})
    target = make_tiny_model("qwen3_moe", tmp_path / "target", seed=0)
    drafter = make_tiny_model("olmoe", tmp_path / "drafter", seed=1)   # same vocabulary, other family
    result = decode(tmp_path, target, drafter, "ar,chain:3,eagle3:12:3,specfit")
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    by_policy = {}
    for r in records:
        by_policy.setdefault(r["policy"], []).append(r["output_ids"])
    assert set(by_policy) == {"ar", "chain:3", "eagle3:12:3", "specfit"}
    for outputs in by_policy.values():
        assert outputs == by_policy["ar"]


def test_the_target_as_its_own_draft_model_is_accepted(tmp_path):
    target = make_tiny_model("qwen3_moe", tmp_path / "target", seed=0)
    result = decode(tmp_path, target, target, "ar,chain:3")
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    chain = [r for r in records if r["policy"] == "chain:3"]
    ar = [r for r in records if r["policy"] == "ar"]
    assert [r["output_ids"] for r in chain] == [r["output_ids"] for r in ar]
    # a drafter that is the target proposes the target's own next tokens: most are accepted, so
    # chain:3 needs far fewer cycles than ar's one per token
    assert sum(r["n_cycles"] for r in chain) < 0.6 * sum(r["n_cycles"] for r in ar)


def test_a_draft_model_with_another_vocabulary_is_one_clear_error(tmp_path):
    target = make_tiny_model("qwen3_moe", tmp_path / "target", seed=0)
    drafter = make_tiny_model("qwen3_moe", tmp_path / "drafter", seed=1, vocab_size=80)
    result = decode(tmp_path, target, drafter, "specfit")
    assert result.exit_code == 2
    assert "must share the target's tokenizer" in result.output
    assert "Traceback" not in result.output
