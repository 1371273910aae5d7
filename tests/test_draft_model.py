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


# against a regression in model.py (a sliding window measured from cache slots, while a draft model runs one
# position ahead of its slots and a draft tree's nodes sit at their depths): fed in several calls and as a tree,
# the drafter's logits are transformers' over each path at positions 1, 2, ...
def test_a_draft_model_with_a_sliding_window_reads_each_path_as_transformers_does(tmp_path):
    import torch

    from runtime_fixtures import load_reference
    from specfit.runtime.draft_model import ModelDrafter
    from specfit.runtime.loader import load_model

    model_dir = make_tiny_model("mixtral", tmp_path / "drafter", seed=3, sliding_window=2)
    reference = load_reference(model_dir)

    def expected(tokens):
        with torch.no_grad():
            return reference(torch.tensor([tokens]), position_ids=torch.arange(1, len(tokens) + 1)[None]).logits[0, -1]

    def drafter():
        d = ModelDrafter(load_model(model_dir, cache_experts=8, capture_layers=()))
        d.setup_kv_cache(32)
        return d

    tokens = torch.randint(0, 96, (10,), generator=torch.Generator().manual_seed(1)).tolist()
    whole = drafter()(None, tokens, list(range(10))).logits[-1]
    incremental = drafter()
    incremental(None, tokens[:6], list(range(6)))
    for i in range(6, 10):
        last = incremental(None, tokens[i:i + 1], [i]).logits[-1]
    assert (whole - expected(tokens)).abs().max().item() <= 1e-5
    assert (last - expected(tokens)).abs().max().item() <= 1e-5

    # a tree after 6 committed entries: three siblings (slots 6-8), the third's child (slot 9) and grandchild
    # (slot 10); the grandchild's window of 2 leaves out its grandparent, which a slot number would keep
    tree = drafter()
    tree(None, tokens[:6], list(range(6)))
    tree(None, [17, 42, 9], [6, 6, 6], torch.tensor([[True] * 6 + [True, False, False],
                                                     [True] * 6 + [False, True, False],
                                                     [True] * 6 + [False, False, True]]))
    tree(None, [63], [7], torch.tensor([[True] * 6 + [False, False, True, True]]))
    deep = tree(None, [2], [8], torch.tensor([[True] * 6 + [False, False, True, True, True]])).logits[-1]
    assert (deep - expected(tokens[:6] + [9, 63, 2])).abs().max().item() <= 1e-5
