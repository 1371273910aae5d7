"""`Decoder.generate`'s input checks (new tokens, empty prompt, temperature), an EOS first token,
the garbage collector's pause, and each cycle's position."""

from __future__ import annotations

import pytest

from runtime_fixtures import make_tiny_model
from runtime_fixtures import torch_single_thread  # noqa: F401  (autouse: one intra-op thread)
from specfit.runtime.decoder import Decoder
from specfit.runtime.loader import load_model

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_model("olmoe", tmp_path_factory.mktemp("olmoe") / "model", seed=3), cache_experts=4)


@pytest.mark.parametrize("bad", [0, -1])
def test_generate_refuses_fewer_than_one_new_token(model, bad):
    """max_new_tokens < 1 is refused up front, naming the argument (not decoded into a 1-token output)."""
    with pytest.raises(ValueError, match=r"max_new_tokens: expected >= 1"):
        Decoder(model).generate([1, 2, 3], bad)


def test_generate_refuses_an_empty_prompt(model):
    """An empty prompt is refused with the argument's own message, before any pass runs."""
    with pytest.raises(ValueError, match=r"prompt_ids: expected at least one token"):
        Decoder(model).generate([], 4)


def test_gc_paused_leaves_a_disabled_collector_disabled():
    """A caller that disabled the collector itself keeps it disabled after a generation's pause."""
    import gc

    from specfit.runtime.decoder import gc_paused

    was = gc.isenabled()
    gc.disable()
    try:
        with gc_paused(True):
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        if was:
            gc.enable()
    with gc_paused(True):
        assert not gc.isenabled()
    assert gc.isenabled() == was


def test_each_cycle_reports_the_output_position_of_its_root(model):
    """Autoregressive: the prefill makes output[0]; cycle i decodes from output[i], so its position
    is i (the position the trace and the cycles' rows key on; a shifted one misaligns live rows with
    a replay's)."""
    result = Decoder(model).generate([5, 9, 11], 6, ignore_eos=True)
    assert len(result.output_ids) == 6
    assert [c.position for c in result.cycles] == [0, 1, 2, 3, 4]
    assert [c.committed_tokens for c in result.cycles] == [1] * 5


@pytest.mark.parametrize("bad", [-0.5, -1e-9, float("nan"), float("inf")])
def test_decoder_refuses_a_negative_or_non_finite_temperature(model, bad):
    # NaN compares False with 0: it decoded greedily without a word; inf sampled uniformly (and a row
    # with a -inf logit gave NaN, "no distribution")
    with pytest.raises(ValueError, match=r"temperature: expected >= 0"):
        Decoder(model, temperature=bad)


def test_a_full_tree_recording_refuses_to_sample(model):
    # it commits the root's greedy verdict each cycle: after a sampled first token that mixes two outputs
    with pytest.raises(ValueError, match=r"commit_root_only: a full-tree recording decodes greedily; got temperature 0.7"):
        Decoder(model, temperature=0.7, commit_root_only=True)
    assert Decoder(model, commit_root_only=True).commit_root_only


def test_a_prefill_token_that_is_eos_ends_the_generation_without_a_cycle(model):
    """The first token (from the prompt's pass) being EOS stops at once: one token, stop reason
    eos, no cycle (not decoded on past the end of the answer)."""
    prompt = [7, 21, 40]
    first = Decoder(model).generate(prompt, 1).output_ids[0]
    result = Decoder(model, eos_token_ids=[first]).generate(prompt, 5)
    assert result.output_ids == [first] and result.stop_reason == "eos" and result.n_cycles == 0
    assert len(Decoder(model, eos_token_ids=[first]).generate(prompt, 5, ignore_eos=True).output_ids) == 5
