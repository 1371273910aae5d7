"""Chat prompts for ``specfit decode``: a ``"messages"`` line is rendered with the model's chat
template and tokenised as ``transformers``' ``apply_chat_template(..., add_generation_prompt=True,
tokenize=True)`` tokenises it, and each bad line is one error naming the file, the line and the field."""

from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

from runtime_fixtures import torch_single_thread  # noqa: F401  (autouse: one intra-op thread)
from specfit.assets import tiny_moe_dir, tiny_moe_eagle3_dir
from specfit.cli import app
from specfit.errors import SpecFitError
from specfit.runtime.loader import load_tokenizer
from specfit.runtime.prompts import read_prompts

transformers = pytest.importorskip("transformers")
runner = CliRunner()

# Qwen's ChatML, as Qwen3 writes it: a system turn first, <think> closed at once without thinking
CHATML = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role != 'system' or not loop.first %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""
# Mistral-Instruct's (Llama-2 style): the template writes the BOS, which the tokenizer also adds to plain text
LLAMA = ("{{ bos_token }}{% for message in messages %}"
         "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
         "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
         "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
         "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
         "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")
BOS = "<|endoftext|>"     # the bundled tokenizer's one special token (id 0), the BOS of the Llama-style copy

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 12 + 30?"},
        {"role": "assistant", "content": "42."}, {"role": "user", "content": "And doubled?"}]
TURNS = [{"role": "user", "content": "What is 12 + 30?"}, {"role": "assistant", "content": "42."},
         {"role": "user", "content": "And doubled?"}]


def chat_model(root, style, template=None, jinja=None):
    """A copy of the bundled model whose tokenizer has a chat template: ``style`` "chatml" (with
    <|im_start|> and <|im_end|> added as special tokens) or "llama" (a BOS the tokenizer adds itself)."""
    from tokenizers import Tokenizer, processors

    root.mkdir(parents=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (root / name).symlink_to(tiny_moe_dir() / name)
    tokenizer = Tokenizer.from_file(str(tiny_moe_dir() / "tokenizer.json"))
    config = json.loads((tiny_moe_dir() / "tokenizer_config.json").read_text())
    if style == "chatml":
        tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    else:
        tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
        config["bos_token"] = BOS
    tokenizer.save(str(root / "tokenizer.json"))
    config["chat_template"] = template if template is not None else (CHATML if style == "chatml" else LLAMA)
    if config["chat_template"] is False:
        del config["chat_template"]
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (root / "chat_template.jinja").write_text(jinja)
    return root


def write_prompts(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def ours(model_dir, tmp_path, line):
    return read_prompts(write_prompts(tmp_path / "prompts.jsonl", [line]), load_tokenizer(model_dir),
                        model_dir=model_dir)[0]


def reference(model_dir, messages, tokenize=True, **kwargs):
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=tokenize,
                                         **({"return_dict": False} if tokenize else {}), **kwargs)


@pytest.mark.parametrize("style, messages", [("chatml", CHAT), ("llama", TURNS)])
def test_chat_token_ids_equal_transformers_apply_chat_template(tmp_path, style, messages):
    model_dir = chat_model(tmp_path / "model", style)
    prompt = ours(model_dir, tmp_path, {"messages": messages})
    assert prompt.input_ids == reference(model_dir, messages)
    assert prompt.text == reference(model_dir, messages, tokenize=False)
    assert prompt.text.endswith("<|im_start|>assistant\n" if style == "chatml" else "And doubled? [/INST]")


def test_the_bos_the_template_writes_is_not_added_again(tmp_path):
    model_dir = chat_model(tmp_path / "model", "llama")
    prompt = ours(model_dir, tmp_path, {"messages": TURNS[:1]})     # no assistant turn: no EOS (also id 0)
    assert prompt.input_ids[0] == 0 and prompt.input_ids.count(0) == 1
    # what tokenising the rendered text as a "prompt" line gives: the tokenizer's BOS before the template's
    assert load_tokenizer(model_dir).encode(prompt.text).ids[:2] == [0, 0]


def test_chatml_control_tokens_are_single_tokens(tmp_path):
    model_dir = chat_model(tmp_path / "model", "chatml")
    ids = ours(model_dir, tmp_path, {"messages": CHAT}).input_ids
    tokenizer = load_tokenizer(model_dir)
    assert ids.count(tokenizer.token_to_id("<|im_start|>")) == 5 and ids.count(tokenizer.token_to_id("<|im_end|>")) == 4


def test_chat_template_kwargs_reach_the_template(tmp_path):
    model_dir = chat_model(tmp_path / "model", "chatml")
    thinking = ours(model_dir, tmp_path, {"messages": CHAT})
    plain = ours(model_dir, tmp_path, {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}})
    assert thinking.text.endswith("<|im_start|>assistant\n")
    assert plain.text == thinking.text + "<think>\n\n</think>\n\n"
    assert plain.input_ids == reference(model_dir, CHAT, enable_thinking=False)


def test_a_chat_template_jinja_file_wins_over_the_tokenizer_config(tmp_path):
    jinja = "{% for m in messages %}<<{{ m.role }}>> {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<<assistant>>{% endif %}"
    model_dir = chat_model(tmp_path / "model", "chatml", jinja=jinja)
    prompt = ours(model_dir, tmp_path, {"messages": CHAT})
    assert prompt.text.startswith("<<system>> You are terse.\n") and prompt.text.endswith("<<assistant>>")
    assert prompt.input_ids == reference(model_dir, CHAT)
    # and a chat_template.jinja alone, as transformers 5 saves a tokenizer
    alone = chat_model(tmp_path / "alone", "chatml", template=False, jinja=jinja)
    assert ours(alone, tmp_path, {"messages": CHAT}).text == prompt.text


def test_named_templates_use_the_default_one(tmp_path):
    named = [{"name": "tool_use", "template": "TOOLS{{ messages[0].content }}"}, {"name": "default", "template": CHATML}]
    model_dir = chat_model(tmp_path / "model", "chatml", template=named)
    prompt = ours(model_dir, tmp_path, {"messages": CHAT})
    assert prompt.text == ours(chat_model(tmp_path / "plain", "chatml"), tmp_path, {"messages": CHAT}).text
    assert prompt.input_ids == reference(model_dir, CHAT)


@pytest.mark.parametrize("style, line, message", [
    ("chatml", {"messages": []}, ':1: "messages" must be a non-empty list of {"role": ..., "content": ...} objects'),
    ("chatml", {"messages": "hi"}, ':1: "messages" must be a non-empty list of {"role": ..., "content": ...} objects'),
    ("chatml", {"messages": [{"role": "user", "content": "a"}, "b"]}, ':1: "messages" must be a non-empty list of'),
    ("chatml", {"messages": [{"content": "hi"}]}, ':1: "messages"[0]: "role" must be a non-empty string (e.g. "user"), got null'),
    ("chatml", {"messages": [{"role": "", "content": "hi"}]}, ':1: "messages"[0]: "role" must be a non-empty string (e.g. "user"), got \'\''),
    ("chatml", {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": 3}]},
     ':1: "messages"[1]: "content" must be a string, got 3'),
    ("chatml", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
     ':1: "messages"[0]: "content" must be a string, got a list'),
    ("chatml", {"messages": [{"role": "user", "content": "a\ud800"}]},
     ':1: "messages"[0]: "content" must be valid Unicode text, got an unpaired surrogate at character 1'),
    ("chatml", {"messages": CHAT, "chat_template_kwargs": ["enable_thinking"]},
     ':1: "chat_template_kwargs" must be an object of template variables (e.g. {"enable_thinking": false}), got a list'),
    ("chatml", {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}},
     ':1: "chat_template_kwargs" sets "tokenize", an argument of the rendering itself; expected template variables only'),
    ("chatml", {"messages": CHAT, "chat_template_kwargs": {"messages": []}}, ':1: "chat_template_kwargs" sets "messages"'),
    ("chatml", {"prompt": "hi", "messages": CHAT},
     ':1: expected an object with exactly one of "prompt" (text), "input_ids" (a list of token ids) or "messages" (a '
     'chat), got "prompt" and "messages"'),
    ("chatml", {"input_ids": [1], "messages": CHAT}, ':1: expected an object with exactly one of'),
    ("chatml", {"prompt": "hi", "chat_template_kwargs": {}}, ':1: "chat_template_kwargs" goes with "messages" (a chat), not with "prompt"'),
    ("llama", {"messages": CHAT}, ':1: the chat template of {model} failed on "messages": Conversation roles must alternate'),
    ("llama", {"messages": [{"role": "user", "content": "{{ 7 * 6 }}"}, {"role": "tool", "content": "b"}]},
     ':1: the chat template of {model} failed on "messages": Only user and assistant roles are supported!'),
])
def test_a_bad_chat_line_is_one_error_naming_the_line_and_the_field(tmp_path, style, line, message):
    model_dir = chat_model(tmp_path / "model", style)
    prompts = write_prompts(tmp_path / "prompts.jsonl", [line])
    result = runner.invoke(app, ["decode", "--model", str(model_dir), "--prompts", str(prompts), "--cache-experts", "2",
                                 "--device", "cpu"])
    assert result.exit_code == 2, result.output
    assert str(prompts) + message.replace("{model}", str(model_dir)) in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output


@pytest.mark.parametrize("template, message", [
    (False, ':1: "messages" needs a chat template, but {model} has none (no "chat_template" in tokenizer_config.json, '
            'no chat_template.jinja); give "prompt" or "input_ids" instead'),
    ("{% for m in messages %}{{ m.content }", ':1: the chat template of {model} failed on "messages": '),
    ([{"name": "tool_use", "template": CHATML}, {"name": "rag", "template": CHATML}],
     'the chat templates are named rag, tool_use; expected one named "default" for "messages"'),
    (5, "{model}: the chat template must be a Jinja template (a string), got 5"),
    ("{% if false %}x{% endif %}", ':1: "messages" renders to no tokens'),
    ("{{ '\ud800' }}", ':1: the rendered chat must be valid Unicode text, got an unpaired surrogate at character 0'),
])
def test_a_model_without_a_usable_chat_template_is_one_error(tmp_path, template, message):
    model_dir = chat_model(tmp_path / "model", "chatml", template=template)
    with pytest.raises(SpecFitError) as raised:
        ours(model_dir, tmp_path, {"messages": CHAT})
    assert message.replace("{model}", str(model_dir)) in str(raised.value) and "\n" not in str(raised.value)


def test_a_chat_needs_transformers_and_says_how_to_install_it(tmp_path, monkeypatch):
    model_dir = chat_model(tmp_path / "model", "chatml")
    monkeypatch.setitem(sys.modules, "transformers", None)       # `import transformers` raises ImportError
    with pytest.raises(SpecFitError, match=r'prompts\.jsonl:1: "messages" is rendered with the model\'s chat template by '
                                           r'transformers, which is not installed \(pip install \'specfit\[chat\]\'\); '
                                           r'give "prompt" or "input_ids" instead$'):
        ours(model_dir, tmp_path, {"messages": CHAT})
    # the other lines need no transformers
    assert ours(model_dir, tmp_path, {"prompt": "hi"}).input_ids == load_tokenizer(model_dir).encode("hi").ids


def test_a_chat_needs_jinja2_and_says_how_to_install_it(tmp_path, monkeypatch):
    from transformers.utils import chat_template_utils

    model_dir = chat_model(tmp_path / "model", "chatml", template=CHATML + "{# a template compiled in this test only #}")
    monkeypatch.setattr(chat_template_utils, "is_jinja_available", lambda: False)
    with pytest.raises(SpecFitError, match=r'prompts\.jsonl:1: "messages": rendering the chat template needs '
                                           r'apply_chat_template requires jinja2 .* \(pip install \'specfit\[chat\]\' '
                                           r'installs it\)$'):
        ours(model_dir, tmp_path, {"messages": CHAT})


def test_a_tokenizer_transformers_cannot_load_is_named(tmp_path):
    model_dir = chat_model(tmp_path / "model", "chatml")
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config)[:-1])       # cut short
    with pytest.raises(SpecFitError, match=rf"^{model_dir}: transformers cannot load the tokenizer \(tokenizer_config\.json, "
                                           r"tokenizer\.json\) that renders the chat template \(Expecting"):
        ours(model_dir, tmp_path, {"messages": CHAT})


def test_a_chat_without_a_tokenizer_or_a_model_directory_is_refused(tmp_path):
    model_dir = chat_model(tmp_path / "model", "chatml")
    prompts = write_prompts(tmp_path / "prompts.jsonl", [{"messages": CHAT}])
    with pytest.raises(SpecFitError, match=r'"messages" needs a tokenizer, but the model directory has no '
                                           r'tokenizer\.json; give "input_ids" instead$'):
        read_prompts(prompts, None, model_dir=model_dir)
    with pytest.raises(SpecFitError, match=r'"messages" needs the model directory\'s chat template'):
        read_prompts(prompts, load_tokenizer(model_dir))


def test_decode_of_a_chat_speculates_the_autoregressive_output_and_records_it(tmp_path, monkeypatch):
    from specfit.traces.format import read_trace

    monkeypatch.chdir(tmp_path)
    model_dir = chat_model(tmp_path / "model", "llama")
    lines = [{"messages": TURNS}, {"messages": TURNS[:1]}, {"prompt": "def add(a, b):"}]
    prompts = write_prompts(tmp_path / "prompts.jsonl", lines)
    out = tmp_path / "run"
    result = runner.invoke(app, ["decode", "--model", str(model_dir), "--drafter", str(tiny_moe_eagle3_dir()),
                                 "--policies", "ar,eagle3,specfit", "--prompts", str(prompts), "--cache-experts", "4",
                                 "--device", "cpu", "--max-new-tokens", "12", "--ignore-eos", "--profile", "pcie4",
                                 "--record", str(tmp_path / "trace.parquet"), "--record-full", "--out", str(out),
                                 "--json"])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert records == [json.loads(line) for line in (out / "decode.jsonl").read_text().splitlines()]
    outputs = {policy: [r["output_ids"] for r in records if r["policy"] == policy] for policy in ("ar", "eagle3", "specfit")}
    assert outputs["eagle3"] == outputs["ar"] and outputs["specfit"] == outputs["ar"]
    # and the drafter speculates on a chat: fewer cycles than tokens
    assert sum(r["n_cycles"] for r in records if r["policy"] == "eagle3") < sum(r["decode_tokens"] for r in records
                                                                                if r["policy"] == "eagle3")
    text_tokens = len(load_tokenizer(model_dir).encode("def add(a, b):").ids)
    assert [r["prompt_tokens"] for r in records if r["policy"] == "ar"] == [
        len(reference(model_dir, TURNS)), len(reference(model_dir, TURNS[:1])), text_tokens]
    assert read_trace(tmp_path / "trace.parquet").n_cycles > 0


@pytest.mark.parametrize("line, kind", [({"messages": TURNS}, "messages"), ({"prompt": "<|im_start|>hi"}, "prompt")])
def test_a_token_past_the_models_vocabulary_is_one_error(tmp_path, line, kind):
    """The ChatML copy's <|im_start|> and <|im_end|> are ids 2048 and 2049, past the bundled model's
    2048 embedding rows: a decode ended in the embedding's IndexError traceback."""
    model_dir = chat_model(tmp_path / "model", "chatml")
    prompts = write_prompts(tmp_path / "prompts.jsonl", [line])
    result = runner.invoke(app, ["decode", "--model", str(model_dir), "--prompts", str(prompts), "--cache-experts", "2",
                                 "--device", "cpu", "--max-new-tokens", "2", "--profile", "pcie4"])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert (f'prompts.jsonl:1: "{kind}" tokenises to token id 2048, outside the model\'s vocabulary [0, 2048)'
            in result.output)
