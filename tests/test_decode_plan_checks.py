"""`specfit decode`'s option checks (DecodePlan.validate, and the checks made before any weight is
read): new tokens, cache slots, the run directory's kind."""

from __future__ import annotations

import json

import pytest

from specfit.assets import demo_prompts_path, tiny_moe_dir
from specfit.errors import SpecFitError
from specfit.runtime.decode_job import DecodePlan, _load


class _Loading(Exception):
    """Raised by ``say`` at "loading MODEL": every check before the weights passed."""


def _stop_at_loading(message):
    if message.startswith("loading"):
        raise _Loading(message)


def _plan(**options) -> DecodePlan:
    return DecodePlan(model_dir=tiny_moe_dir(), profile="pcie4",
                      **{"prompts_path": demo_prompts_path(), "cache_experts": 2, "max_new_tokens": 2, **options})


@pytest.mark.parametrize("bad", [0, -3])
def test_decode_refuses_fewer_than_one_new_token(bad):
    with pytest.raises(SpecFitError, match=rf"--max-new-tokens: expected at least 1, got {bad}"):
        _plan(max_new_tokens=bad).validate()


def test_decode_refuses_a_negative_cache():
    with pytest.raises(SpecFitError, match=r"--cache-experts: expected a non-negative number of experts, got -1"):
        _plan(cache_experts=-1).validate()
    _plan(cache_experts=0).validate()


@pytest.mark.parametrize("mode, slots", [("per_layer", 16), ("global", 64)])
def test_decode_cache_experts_up_to_the_slot_limit_and_not_one_more(mode, slots):
    """The bundled model has 16 experts per layer (4 MoE layers): per_layer takes 0..16, global 0..64;
    one more is refused before the model loads."""
    with pytest.raises(_Loading):
        _load(_plan(cache_experts=slots, cache_mode=mode), _stop_at_loading)
    with pytest.raises(SpecFitError, match=rf"--cache-experts: expected 0\.\.{slots} .*got {slots + 1}"):
        _load(_plan(cache_experts=slots + 1, cache_mode=mode), _stop_at_loading)


def test_decode_prompt_plus_new_tokens_may_fill_the_positions_exactly_and_not_one_more(tmp_path):
    from specfit.runtime.config import ModelConfig
    from specfit.runtime.loader import load_tokenizer
    from specfit.runtime.prompts import read_prompts

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Comparisons in Python have the same priority."}) + "\n")
    config = ModelConfig.from_dir(tiny_moe_dir())
    (prompt,) = read_prompts(prompts, load_tokenizer(tiny_moe_dir()), config.vocab_size)
    room = config.max_position_embeddings - len(prompt.input_ids)
    with pytest.raises(_Loading):
        _load(_plan(prompts_path=prompts, max_new_tokens=room), _stop_at_loading)
    with pytest.raises(SpecFitError, match="exceed the model's max_position_embeddings"):
        _load(_plan(prompts_path=prompts, max_new_tokens=room + 1), _stop_at_loading)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_decode_refuses_a_temperature_that_is_not_a_number(bad):
    with pytest.raises(SpecFitError, match=r"--temperature: expected a non-negative number"):
        _plan(temperature=bad).validate()
