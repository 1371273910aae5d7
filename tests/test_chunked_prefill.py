"""Chunked prefill: the prompt through the target and the drafter in passes of at most
``prefill_chunk`` tokens gives what the one pass gives (logits, greedy output of every policy,
routing) on every attention variant, its accounting adds up over the passes, its recording holds
each pass, and plan's workspace for it grows with the chunk times the prompt, not the prompt squared."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from formats_fixtures import make_family_model
from runtime_fixtures import FAMILIES, VOCAB, load_reference, make_tiny_model
from runtime_fixtures import torch_single_thread  # noqa: F401  (autouse: one intra-op thread)
from specfit.assets import tiny_moe_dir, tiny_moe_eagle3_dir
from specfit.calibrate.presets import resolve_profile
from specfit.calibrate.profile import ModelShape
from specfit.calibrate.standin import random_drafter, random_model, shape_config
from specfit.costmodel import CostModel
from specfit.errors import SpecFitError
from specfit.policies import make_policy
from specfit.runtime.decoder import Decoder
from specfit.runtime.drafting import Proposer
from specfit.runtime.footprint import pass_workspace_bytes
from specfit.runtime.loader import drafter_capture_layers, load_drafter, load_model
from specfit.runtime.model import causal_mask
from specfit.runtime.prefill import PREFILL_CHUNK, prefill_chunks
from specfit.runtime.record import TraceRecorder
from specfit.simulate.plan import MemoryBudget, MemoryModel

POLICIES = ("ar", "chain:3", "static:6", "eagle3:16:4", "eagle3", "specfit", "specfit+cache", "specfit+prefetch")
COST = CostModel(base_s=2e-3, per_node_s=5e-5, hit_s=2e-5, miss_s=2e-4, draft_level_s=3e-4, expert_bytes=24576)
GB = 1e9


def test_a_prompt_is_cut_into_chunks_the_last_one_ragged():
    assert prefill_chunks(12, 5) == [(0, 5), (5, 10), (10, 12)]
    assert prefill_chunks(10, 5) == [(0, 5), (5, 10)]
    assert prefill_chunks(4, 5) == [(0, 4)] == prefill_chunks(4, 0)


# ----------------------------------------------------------------------------- every attention variant
VARIANTS = {family: lambda root, family=family: make_tiny_model(family, root, seed=7) for family in FAMILIES}
VARIANTS["mixtral-sliding_window"] = lambda root: make_tiny_model("mixtral", root, seed=7, sliding_window=5)
VARIANTS["deepseek_v2-lite"] = lambda root: make_family_model("deepseek_v2", root, seed=3)
VARIANTS["deepseek_v2-q_lora"] = lambda root: make_family_model("deepseek_v2", root, seed=3, q_lora_rank=16)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chunked_prompt_passes_match_transformers_full_pass(tmp_path, variant):
    """Each chunk a pass over the KV entries of the ones before it (a sliding window across chunk
    boundaries, MLA's latents absorbed for a chunk over a longer cache): every row's logits are
    transformers' one pass's, and the decoder's chunked prefill decodes as transformers does."""
    model_dir = VARIANTS[variant](tmp_path)
    ids = torch.randint(0, VOCAB, (17,), generator=torch.Generator().manual_seed(1))
    reference = load_reference(model_dir)
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    model = load_model(model_dir, cache_experts=3)
    model.setup_kv_cache(64)
    logits = torch.cat([model(ids[s:e], torch.arange(s, e), causal_mask(s, e - s)).logits
                        for s, e in prefill_chunks(17, 5)])
    assert (logits - expected).abs().max().item() <= 1e-5
    want = reference.generate(ids[None], max_new_tokens=8, do_sample=False)[0, 17:].tolist()
    assert Decoder(model, prefill_chunk=5).generate(ids.tolist(), 8, ignore_eos=True).output_ids == want


# ----------------------------------------------------------------------------- the bundled model
@pytest.fixture(scope="module")
def bundled():
    capture = drafter_capture_layers(tiny_moe_eagle3_dir(), load_model(tiny_moe_dir()).config)
    model = load_model(tiny_moe_dir(), cache_experts=6, capture_layers=capture)
    return model, load_drafter(tiny_moe_eagle3_dir(), model)


def _decoder(model, drafter, spec, chunk, **options):
    policy = make_policy(spec, max_levels=6)
    proposer = Proposer(drafter, 4) if policy.max_levels else None
    return Decoder(model, proposer, policy, COST if policy.max_levels else None, prefill_chunk=chunk, **options)


def _prompt(n, vocab, seed=3):
    return np.random.default_rng(seed).integers(1, vocab, n).tolist()


def test_bundled_model_chunked_prefill_gives_the_one_passs_logits_and_every_policys_output(bundled):
    model, drafter = bundled
    prompt = _prompt(45, model.config.vocab_size)         # chunks of 16: 16, 16, 13
    one, chunked = Decoder(model, prefill_chunk=0), Decoder(model, prefill_chunk=16)
    model.setup_kv_cache(128)
    _, whole = one.prefill(prompt)
    _, parts = chunked.prefill(prompt)
    assert (parts.logits - whole.logits).abs().max().item() <= 1e-5
    assert np.array_equal(parts.expert_ids, whole.expert_ids)
    assert (parts.hidden - whole.hidden).abs().max().item() <= 1e-5
    for spec in POLICIES:
        outputs = {chunk: _decoder(model, drafter, spec, chunk).generate(prompt, 24, ignore_eos=True).output_ids
                   for chunk in (0, 16, 7)}
        assert outputs[16] == outputs[0] == outputs[7], spec


def test_the_drafter_runs_the_prompt_in_chunks_and_drafts_what_the_one_pass_drafts(bundled):
    model, drafter = bundled
    prompt = _prompt(45, model.config.vocab_size, seed=4)
    model.setup_kv_cache(128)
    calls, trees = [], {}
    original = type(drafter).forward

    def counted(self, hidden, *args, **kwargs):
        calls.append(hidden.shape[0])
        return original(self, hidden, *args, **kwargs)

    for chunk in (0, 16):
        decoder = _decoder(model, drafter, "eagle3:16:4", chunk)
        decoder.proposer.warm_lengths = 0
        calls.clear()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(type(drafter), "forward", counted)
            root, _ = decoder.prefill(prompt, 8)
        assert calls == ([44] if chunk == 0 else [16, 16, 12])       # the prompt's entries but the last
        draft = decoder.draft(root, max_levels=3)
        assert draft.draft_levels == 3
        trees[chunk] = (draft.tree.tokens.tolist(), draft.tree.parents.tolist())
    assert trees[16] == trees[0]


def test_chunked_prefill_accounting_and_recording(bundled):
    """The prompt's expert traffic is every pass's (a layer's union per chunk), its time holds
    every pass, and the recording holds each pass's experts per layer, in the order they ran."""
    model, drafter = bundled
    prompt = _prompt(45, model.config.vocab_size, seed=5)
    recorded = {}
    for chunk in (0, 16):
        model.offload.reset()
        recorder = TraceRecorder({}, {}, workload="w", full=False)
        recorder.begin_sequence(0)
        result = _decoder(model, drafter, "eagle3:16:4", chunk, recorder=recorder).generate(prompt, 6, ignore_eos=True)
        recorded[chunk] = recorder._prefill[0]
        union_sizes = np.zeros(model.config.n_moe_layers, dtype=np.int64)
        decoder_routing = _routing(model, prompt)
        for s, e in prefill_chunks(len(prompt), chunk):
            union_sizes += [np.unique(decoder_routing[s:e, layer]).size for layer in range(model.config.n_moe_layers)]
        assert recorded[chunk] == [[np.unique(decoder_routing[s:e, layer]).tolist()
                                    for layer in range(model.config.n_moe_layers)]
                                   for s, e in prefill_chunks(len(prompt), chunk)]
        served = result.prefill_offload.hits + result.prefill_offload.misses
        assert served.tolist() == union_sizes.tolist(), chunk
        assert result.offload.total_misses >= result.prefill_offload.total_misses
        assert result.prefill_time_s > 0
    assert len(recorded[0]) == 1 and len(recorded[16]) == 3


def _routing(model, prompt):
    model.setup_kv_cache(max(model.max_seq_len, len(prompt)))
    return model(prompt, np.arange(len(prompt)), logits_rows=[-1]).expert_ids


def test_prefill_time_covers_every_pass(bundled, monkeypatch):
    model, _ = bundled
    prompt = _prompt(45, model.config.vocab_size, seed=6)
    passes = []
    forward = type(model).forward
    import time

    def slow(self, *args, **kwargs):
        time.sleep(0.05)
        passes.append(1)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", slow)
    result = Decoder(model, prefill_chunk=16).generate(prompt, 1, ignore_eos=True)
    assert len(passes) == 3 and result.prefill_time_s >= 0.15


# ----------------------------------------------------------------------------- a random stand-in
def test_random_stand_in_chunked_prefill_is_lossless_for_every_policy():
    config = shape_config("tiny")
    model = random_model(config, torch.device("cpu"), torch.float32, cache_experts=4)
    drafter = random_drafter(model)
    cost = resolve_profile("pcie5", ModelShape.from_config(config, torch.float32, "tiny")).cost
    prompt = _prompt(300, config.vocab_size, seed=8)     # chunks of 128: 128, 128, 44
    model.setup_kv_cache(400)
    _, whole = Decoder(model, prefill_chunk=0).prefill(prompt)
    _, parts = Decoder(model, prefill_chunk=128).prefill(prompt)
    assert (parts.logits - whole.logits).abs().max().item() <= 1e-4 * whole.logits.abs().max().item()
    for spec in ("ar", "chain:3", "eagle3:16:4", "specfit"):
        policy = make_policy(spec, max_levels=4)
        outputs = []
        for chunk in (0, 128):
            proposer = Proposer(drafter, 4) if policy.max_levels else None
            decoder = Decoder(model, proposer, policy, cost if policy.max_levels else None, prefill_chunk=chunk,
                              online_refit=False)
            outputs.append(decoder.generate(prompt, 12, ignore_eos=True).output_ids)
        assert outputs[1] == outputs[0], spec


# ----------------------------------------------------------------------------- plan's workspace
def test_plans_prompt_workspace_with_chunks_grows_with_the_chunk_times_the_prompt():
    config = shape_config("qwen3-30b-a3b")

    def workspace(prompt, chunk):
        return MemoryModel("qwen3", config, MemoryBudget(80 * GB, context_tokens=prompt, prompt_tokens=prompt,
                                                         prefill_chunk=chunk)).prompt_pass_bytes

    assert MemoryBudget(80 * GB).prefill_chunk == PREFILL_CHUNK        # decode's default, one definition
    for prompt in (2048, 4096):
        assert workspace(prompt, 512) == pass_workspace_bytes(config, torch.bfloat16, 512, prompt - 512, logits_rows=1)
        assert workspace(prompt, 0) == pass_workspace_bytes(config, torch.bfloat16, prompt, 0, logits_rows=1)
    # one pass: the prompt squared; chunks: the chunk times the prompt (32 heads x 8 bytes a score)
    assert workspace(4096, 0) / workspace(2048, 0) > 3.5
    assert workspace(4096, 512) / workspace(2048, 512) < 2.1
    assert workspace(4096, 512) <= 1.1 * 32 * 512 * 4096 * 8 < workspace(4096, 0) / 7
    assert workspace(300, 512) == workspace(300, 0)                    # a prompt within one chunk: one pass


# ----------------------------------------------------------------------------- options
def test_a_bad_prefill_chunk_is_one_error():
    with pytest.raises(SpecFitError, match="--prefill-chunk: expected a number of tokens >= 0"):
        MemoryBudget(GB, prefill_chunk=-1)
    with pytest.raises(ValueError, match="prefill_chunk: expected a number of tokens >= 0"):
        Decoder(load_model(tiny_moe_dir()), prefill_chunk=-3)


def test_a_numpy_integer_chunk_is_a_chunk_and_an_empty_prompt_one_error():
    """A chunk given as a numpy integer (a sweep's value) was refused as not a number of tokens; an
    empty prompt handed to prefill ended in an UnboundLocalError."""
    decoder = Decoder(load_model(tiny_moe_dir()), prefill_chunk=np.int64(16))
    assert decoder.prefill_chunk == 16 and type(decoder.prefill_chunk) is int
    with pytest.raises(ValueError, match="prompt_ids: expected at least one token"):
        decoder.prefill([])


@pytest.mark.parametrize("command", ["decode", "plan"])
def test_the_chunk_options_help_keeps_its_shapes(command):
    """rich read '[heads, chunk, context]' in the help as markup and dropped it ('scores are , not )')."""
    from typer.testing import CliRunner

    from specfit.cli import app

    out = " ".join(CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"}).output.split())
    assert "x chunk x context" in out or "x --prefill-chunk x prompt" in out, out
    assert "are , not" not in out and "scores ." not in out
