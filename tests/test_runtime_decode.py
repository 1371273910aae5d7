"""Autoregressive decoding: token-for-token equal to ``transformers``' greedy ``generate``, and
the ``specfit decode`` command."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from runtime_fixtures import FAMILIES, N_EXPERTS, VOCAB, load_reference, make_tiny_model
from runtime_fixtures import torch_single_thread  # noqa: F401  (autouse: one intra-op thread)
from specfit.cli import app
from specfit.runtime.decoder import Decoder, Draft
from specfit.runtime.loader import load_model
from specfit.tree import DraftTree

pytest.importorskip("transformers")

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return {family: make_tiny_model(family, tmp_path_factory.mktemp(family), seed=7) for family in FAMILIES}


def _prompts():
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in (1, 5, 13)]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_output_equals_transformers_generate(model_dirs, family):
    reference = load_reference(model_dirs[family])
    expected = []
    for prompt in _prompts():
        generated = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
        expected.append(generated[0, len(prompt):].tolist())
    for cache_experts in (0, 3, N_EXPERTS):
        decoder = Decoder(load_model(model_dirs[family], cache_experts=cache_experts))
        for prompt, want in zip(_prompts(), expected):
            result = decoder.generate(prompt, NEW_TOKENS, ignore_eos=True)
            assert result.output_ids == want, f"cache_experts={cache_experts}, prompt of {len(prompt)} tokens"


def test_greedy_output_equals_transformers_generate_bfloat16(model_dirs):
    reference = load_reference(model_dirs["qwen3_moe"], torch.bfloat16)
    decoder = Decoder(load_model(model_dirs["qwen3_moe"], dtype="bfloat16", cache_experts=2))
    for prompt in _prompts():
        want = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):]
        assert decoder.generate(prompt, NEW_TOKENS, ignore_eos=True).output_ids == want.tolist()


def test_generation_stops_after_eos(model_dirs):
    decoder = Decoder(load_model(model_dirs["olmoe"], cache_experts=2))
    prompt = _prompts()[1]
    full = decoder.generate(prompt, NEW_TOKENS).output_ids
    eos = full[5]
    first = full.index(eos)
    stopping = Decoder(decoder.model, eos_token_ids=[eos])
    result = stopping.generate(prompt, NEW_TOKENS)
    assert result.output_ids == full[: first + 1] and result.stop_reason == "eos"
    ignoring = stopping.generate(prompt, NEW_TOKENS, ignore_eos=True)
    assert ignoring.output_ids == full and ignoring.stop_reason == "length"


def test_decode_counters_add_up(model_dirs):
    model = load_model(model_dirs["mixtral"], cache_experts=3)
    result = Decoder(model).generate(_prompts()[2], NEW_TOKENS, ignore_eos=True)
    assert len(result.output_ids) == NEW_TOKENS
    assert result.n_cycles == NEW_TOKENS - 1 and sum(result.cycle_tokens) == NEW_TOKENS - 1
    assert result.offload.total_bytes_h2d == result.offload.total_misses * model.offload.host.expert_bytes
    assert 0 < result.decode_bytes_h2d <= result.offload.total_bytes_h2d
    assert result.offload.total_hits + result.offload.total_misses > 0
    record = result.to_dict()
    assert record["hit_rate"] == pytest.approx(record["hits"] / (record["hits"] + record["misses"]))
    # the decode_ fields are the cycles' alone: the prompt's pass is in the totals only
    hits, misses = (sum(getattr(c.offload, f"total_{n}") for c in result.cycles) for n in ("hits", "misses"))
    assert (record["decode_hits"], record["decode_misses"]) == (hits, misses)
    assert record["decode_hit_rate"] == pytest.approx(hits / (hits + misses))
    assert record["hits"] == hits + result.prefill_offload.total_hits
    assert record["misses"] == misses + result.prefill_offload.total_misses
    assert record["bytes_h2d"] == result.offload.total_bytes_h2d == record["misses"] * model.offload.host.expert_bytes
    assert record["tokens_per_s"] > 0


def test_outputs_that_first_differ_at_tied_logits_differ_within_rounding(model_dirs):
    """In a 16-bit dtype a tree verification pass rounds apart from a one-token pass, so a policy can
    commit the other of two near-tied tokens: ``specfit decode`` tells that from a decoding fault by
    the target's logits at the outputs' first difference."""
    from specfit.runtime.decode_job import rounding_ties
    from specfit.runtime.prompts import Prompt

    model = load_model(model_dirs["qwen3_moe"], cache_experts=N_EXPERTS)
    prompt = _prompts()[1]
    ar = Decoder(model).generate(prompt, 8, ignore_eos=True).output_ids
    logits = model(prompt + ar[:3], np.arange(len(prompt) + 3)).logits[-1]
    tied = next(t for t in range(VOCAB) if t != ar[3])
    far = int(logits.argmin())
    with torch.no_grad():            # token ``tied`` gets ``ar[3]``'s logit everywhere: an exact tie
        model.lm_head.weight[tied] = model.lm_head.weight[ar[3]]
    prompts = [Prompt(line=1, input_ids=[0], text=None), Prompt(line=2, input_ids=prompt, text=None)]
    records = [{"index": 0, "output_ids": [5, 6]}, {"index": 1, "output_ids": ar}] * 2
    records[3] = {"index": 1, "output_ids": ar[:3] + [tied] + ar[5:]}
    assert rounding_ties(model, prompts, records) == ([2], [2])
    records[3] = {"index": 1, "output_ids": ar[:3] + [far] + ar[5:]}
    assert rounding_ties(model, prompts, records) == ([2], [])


def test_a_policys_fault_is_not_hidden_behind_another_policys_earlier_rounding_tie(model_dirs):
    """Three policies: one parts from ar at a tie, another later at a token far from the best. The
    outputs' joint first difference was the tie, and the run said "within rounding"; every two
    outputs are checked where they part."""
    from specfit.runtime.decode_job import rounding_ties
    from specfit.runtime.prompts import Prompt

    model = load_model(model_dirs["qwen3_moe"], cache_experts=N_EXPERTS)
    prompt = _prompts()[1]
    ar = Decoder(model).generate(prompt, 12, ignore_eos=True).output_ids
    tied = next(t for t in range(VOCAB) if t != ar[3])
    with torch.no_grad():            # token ``tied`` gets ``ar[3]``'s logit everywhere: an exact tie
        model.lm_head.weight[tied] = model.lm_head.weight[ar[3]]
    far = int(model(prompt + ar[:8], np.arange(len(prompt) + 8)).logits[-1].argmin())
    prompts = [Prompt(line=4, input_ids=prompt, text=None)]
    tie = {"index": 0, "output_ids": ar[:3] + [tied] + ar[4:]}
    fault = {"index": 0, "output_ids": ar[:8] + [far] + ar[9:]}
    assert rounding_ties(model, prompts, [{"index": 0, "output_ids": ar}, tie]) == ([4], [4])
    assert rounding_ties(model, prompts, [{"index": 0, "output_ids": ar}, tie, fault]) == ([4], [])
    assert rounding_ties(model, prompts, [fault, tie, {"index": 0, "output_ids": ar}]) == ([4], [])



def test_a_rounding_tie_is_checked_against_the_targets_best_logit_on_the_logits_scale(model_dirs):
    """Two outputs part at a tie only where both tokens are within ROUNDING_TIE_UNITS float32 units
    (2**-20 at the least) of the target's best logit, on the logits' scale: two tokens tied with each
    other below the best are a fault; a gap of 2e-6 of the scale is a tie, one of 8e-6 is not. An
    output that stops where another goes on is no tie, and the check grows a KV cache too short."""
    from specfit.runtime.decode_job import rounding_ties
    from specfit.runtime.prompts import Prompt

    model = load_model(model_dirs["qwen3_moe"], cache_experts=N_EXPERTS)
    prompt = _prompts()[1]
    ar = Decoder(model).generate(prompt, 8, ignore_eos=True).output_ids
    prompts = [Prompt(line=6, input_ids=prompt, text=None)]
    with torch.no_grad():           # logits four times larger: the same greedy tokens
        model.lm_head.weight *= 4.0
    logits = model(prompt + ar[:3], np.arange(len(prompt) + 3)).logits[-1]
    best, scale = float(logits[ar[3]]), float(logits.abs().max())
    assert int(logits.argmax()) == ar[3] and best > 0
    low, other = (int(t) for t in logits.argsort()[:2])
    original = model.lm_head.weight[ar[3]].clone()

    def parted(token):
        return [{"index": 0, "output_ids": ar}, {"index": 0, "output_ids": ar[:3] + [token] + ar[4:]}]

    near = next(t for t in range(VOCAB) if t not in (ar[3], low, other))
    for gap, tie in ((2e-6, True), (8e-6, False)):
        with torch.no_grad():        # token ``near``'s logit ``gap`` of the logits' scale below the best
            model.lm_head.weight[near] = original * (1 - gap * scale / best)
        model.setup_kv_cache(1)
        assert rounding_ties(model, prompts, parted(near)) == ([6], [6] if tie else []), gap
    with torch.no_grad():            # two tokens far below the best, tied with each other
        model.lm_head.weight[other] = model.lm_head.weight[low]
    ties = [{"index": 0, "output_ids": ar[:3] + [t] + ar[4:]} for t in (low, other)]
    assert rounding_ties(model, prompts, ties) == ([6], [])
    assert rounding_ties(model, prompts, [{"index": 0, "output_ids": ar}, {"index": 0, "output_ids": ar[:5]}]) == ([6], [])

def test_verify_and_commit_accept_the_matching_path(model_dirs):
    """The cycle primitives the speculative decoder builds on: a tree whose first branch is the
    target's own continuation is accepted along that branch, the KV cache is compacted, and
    decoding continues exactly as the plain autoregressive run."""
    model = load_model(model_dirs["qwen3_moe"], cache_experts=3)
    prompt = _prompts()[1]
    plain = Decoder(model).generate(prompt, 8, ignore_eos=True).output_ids

    decoder = Decoder(model)
    model.setup_kv_cache(len(prompt) + 16)
    root, _ = decoder.prefill(prompt)
    # root -> plain[1] -> plain[2] is the target's own continuation; the wrong siblings (nodes 1
    # and 3) are verified too and must be dropped
    wrong = (plain[1] + 1) % VOCAB
    tree = DraftTree(parents=np.array([-1, 0, 0, 2, 2]), path_probs=np.array([1.0, 0.9, 0.5, 0.4, 0.3]),
                     tokens=np.array([root, wrong, plain[1], wrong, plain[2]]))
    draft = Draft(tree=tree, experts=np.zeros((5, 0, 0), dtype=np.int64), edge_logprob=np.zeros(5),
                  nodes=np.arange(tree.n_nodes), selection=None)
    verification = decoder.verify(tree, draft.nodes)
    committed = decoder.commit(draft, verification)
    assert committed.path.tolist() == [0, 2, 4] and [root] + committed.tokens == plain[:4]
    assert decoder.cache_len == len(prompt) + 3
    # continue autoregressively from the compacted cache
    token, output = committed.tokens[-1], [root] + committed.tokens
    while len(output) < 8:
        draft = decoder.draft(token)                  # no proposer: the root alone
        token = decoder.commit(draft, decoder.verify(draft.tree, draft.nodes)).tokens[-1]
        output.append(token)
    assert output == plain


# ----------------------------------------------------------------- the command
runner = CliRunner()


def _write_prompts(path, lines):
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


@pytest.fixture(autouse=True)
def in_tmp_dir(tmp_path, monkeypatch):
    """Without --profile, decode calibrates this machine into ./calibrate/: keep that out of the repo."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture()
def cli_model(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    model_dir = make_tiny_model("qwen3_moe", tmp_path / "model", seed=7)
    vocab = {f"w{i}": i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(model_dir / "tokenizer.json"))
    return model_dir


def test_decode_command_json_output_matches_the_decoder(cli_model, tmp_path):
    prompts = _write_prompts(tmp_path / "prompts.jsonl", [{"input_ids": [3, 1, 4, 1, 5]}, "", {"prompt": "w9 w2 w6"}])
    out_dir = tmp_path / "out"
    result = runner.invoke(app, ["decode", "--model", str(cli_model), "--prompts", str(prompts), "--max-new-tokens", "6",
                                 "--cache-experts", "2", "--device", "cpu", "--json", "--out", str(out_dir)])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 2
    records = [json.loads(line) for line in lines]
    assert [r["line"] for r in records] == [1, 3]

    decoder = Decoder(load_model(cli_model, cache_experts=2))
    for record, prompt in zip(records, ([3, 1, 4, 1, 5], [9, 2, 6])):
        assert record["output_ids"] == decoder.generate(prompt, 6).output_ids
        assert record["text"] == " ".join(f"w{t}" for t in record["output_ids"])
        assert record["prompt_tokens"] == len(prompt)
        for key in ("tokens_per_s", "bytes_h2d", "hit_rate", "hits", "misses"):
            assert key in record
    written = [json.loads(line) for line in (out_dir / "decode.jsonl").read_text().splitlines()]
    assert written == records
    # no temporary file left (the lock a second run into it would meet stays, as a sweep's does)
    assert sorted(p.name for p in out_dir.iterdir()) == [".lock", "cycles.parquet", "decode.jsonl", "run.json",
                                                         "summary.json"]


def test_decode_command_prints_a_summary_table(cli_model, tmp_path):
    prompts = _write_prompts(tmp_path / "prompts.jsonl", [{"input_ids": [7, 8]}])
    result = runner.invoke(app, ["decode", "--model", str(cli_model), "--prompts", str(prompts), "--max-new-tokens", "3",
                                 "--cache-experts", "0", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "tokens/s" in result.stdout and "hit rate" in result.stdout


@pytest.mark.parametrize("lines,args,message", [
    (["{bad json"], [], "prompts.jsonl:1: not valid JSON"),
    ([{"input_ids": [1]}, {"prompt": ""}], [], 'prompts.jsonl:2: "prompt" must be a non-empty string'),
    ([{"prompt": "a\ud800b"}], [], 'prompts.jsonl:1: "prompt" must be valid Unicode text, got an unpaired surrogate'),
    ([{"input_ids": []}], [], 'prompts.jsonl:1: "input_ids" must be a non-empty list'),
    ([{"input_ids": [1, 500]}], [], "token id 500 outside the vocabulary"),
    ([{"text": "hi"}], [], 'exactly one of "prompt"'),
    ([{"input_ids": [1]}], ["--policy", "specfit"], "needs a drafter"),
    ([{"input_ids": [1]}], ["--policy", "nonsense"], "--policy: policy 'nonsense'"),
    ([{"input_ids": [1]}], ["--policy", "ar,chain:2"], "--policy: expected one policy, got 'ar,chain:2'; several are passed as --policies ar,chain:2"),
    ([{"input_ids": [1]}], ["--cache-experts", "-1"], "--cache-experts: expected a non-negative"),
    ([{"input_ids": [1]}], ["--cache-experts", "1000"], "--cache-experts: expected 0..8 ("),
    ([{"input_ids": [1]}], ["--cache-experts", "1000", "--cache-mode", "global"], "experts in all, as --cache-mode global counts them), got 1000"),
    ([{"input_ids": [1]}], ["--policy", "specfit", "--max-levels", "0"],
     "--max-levels: expected >= 1 draft levels for --policy specfit, got 0"),
    # a fixed tree drafts --max-levels levels (N - 1 at most): none would be ar, not one level drafted anyway
    ([{"input_ids": [1]}], ["--policy", "static:8", "--max-levels", "0"],
     "--max-levels: expected >= 1 draft levels for --policy static:8, got 0"),
    ([{"input_ids": [1]}], ["--policies", "ar,sequoia:8", "--max-levels", "0"],
     "--max-levels: expected >= 1 draft levels for --policy sequoia:8, got 0"),
    ([{"input_ids": [1]}], ["--policy", "specfit", "--max-levels", "1000000000000"],
     "--max-levels: expected at most 32767 draft levels for --policy specfit, got 1000000000000"),
    ([{"input_ids": [1]}], ["--max-new-tokens", "1000"], "exceed the model's max_position_embeddings"),
    ([{"input_ids": [1]}], ["--dtype", "int4"], "--dtype: expected one of float32, bfloat16, float16"),
    ([{"input_ids": [1]}], ["--prefill-chunk", "-1"], "--prefill-chunk: expected a number of tokens >= 0"),
])
def test_decode_command_bad_input_is_one_line(cli_model, tmp_path, lines, args, message):
    prompts = _write_prompts(tmp_path / "prompts.jsonl", lines)
    argv = ["decode", "--model", str(cli_model), "--prompts", str(prompts), "--device", "cpu"]
    argv += args if "--cache-experts" in args else args + ["--cache-experts", "2"]
    result = runner.invoke(app, argv)
    assert result.exit_code == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output


def test_decode_command_text_prompt_without_tokenizer(tmp_path):
    model_dir = make_tiny_model("olmoe", tmp_path / "no_tokenizer")
    prompts = _write_prompts(tmp_path / "prompts.jsonl", [{"prompt": "hello"}])
    result = runner.invoke(app, ["decode", "--model", str(model_dir), "--prompts", str(prompts), "--cache-experts", "1"])
    assert result.exit_code == 2
    assert "needs a tokenizer" in result.stderr
