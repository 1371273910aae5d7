"""Prompt files for ``specfit decode``: JSON Lines, one prompt per line.

Each line is ``{"prompt": "text"}`` (tokenised with the model directory's tokenizer),
``{"input_ids": [1, 2, 3]}``, or a chat, ``{"messages": [{"role": "user", "content": "text"}, ...]}``
with an optional ``"chat_template_kwargs": {...}`` (vLLM's name; e.g. ``{"enable_thinking": false}``
for Qwen3). A chat is rendered with the model directory's chat template, as a server renders it,
with the prompt that opens the assistant's turn, then tokenised without adding special tokens again
(the template writes the BOS a model wants): ``apply_chat_template(messages,
add_generation_prompt=True, tokenize=True)``'s ids. Blank lines are skipped; anything else is an
error naming the file and the line.

Chat templates are Jinja programs, and transformers renders them (the ``chat`` extra): its
sandbox, filters and globals are what a template is written against, and it finds the template
where it saved it (``chat_template.jinja``, which wins over ``tokenizer_config.json``'s
``chat_template``, a string or a list of named templates of which "default" is used).
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import SpecFitError, one_line
from ..io import json_text

__all__ = ["Prompt", "read_prompts"]

KINDS = ("prompt", "input_ids", "messages")
CHAT_EXTRA = "pip install 'specfit[chat]'"


@dataclass(frozen=True)
class Prompt:
    line: int               # 1-based line in the prompts file
    input_ids: list[int]
    text: str | None        # the prompt text when given as text, or a chat as its template rendered it


def read_prompts(path: str | Path, tokenizer=None, vocab_size: int | None = None,
                 model_dir: str | Path | None = None) -> list[Prompt]:
    """Parse and tokenise every prompt of ``path``; token ids are checked against ``vocab_size``.
    ``"messages"`` lines are rendered with ``model_dir``'s chat template."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecFitError(f"{path}: cannot read the prompts file ({exc})") from None
    prompts = []
    chat = _ChatTemplate(model_dir)
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise SpecFitError(f"{where}: not valid JSON ({exc.msg})") from None
        given = [kind for kind in KINDS if kind in record] if isinstance(record, dict) else []
        if len(given) != 1:
            found = " and ".join(f'"{kind}"' for kind in given)
            raise SpecFitError(f'{where}: expected an object with exactly one of "prompt" (text), "input_ids" (a list '
                               f'of token ids) or "messages" (a chat){", got " + found if found else ""}')
        if "chat_template_kwargs" in record and given != ["messages"]:
            raise SpecFitError(f'{where}: "chat_template_kwargs" goes with "messages" (a chat), not with "{given[0]}"')
        if "prompt" in record:
            prompts.append(_from_text(record["prompt"], tokenizer, vocab_size, where, number))
        elif "messages" in record:
            prompts.append(_from_chat(record, tokenizer, vocab_size, chat, where, number))
        else:
            prompts.append(Prompt(number, _token_ids(record["input_ids"], vocab_size, where), None))
    if not prompts:
        raise SpecFitError(f"{path}: no prompts (expected one JSON object per line)")
    return prompts


def _from_text(text, tokenizer, vocab_size: int | None, where: str, number: int) -> Prompt:
    if not isinstance(text, str) or not text:
        raise SpecFitError(f'{where}: "prompt" must be a non-empty string')
    _check_unicode(text, '"prompt"', where)
    _check_tokenizer(tokenizer, "prompt", where)
    return Prompt(number, _tokenised(text, tokenizer, vocab_size, "prompt", "tokenises to no tokens", where), text)


def _from_chat(record: dict, tokenizer, vocab_size: int | None, chat: _ChatTemplate, where: str, number: int) -> Prompt:
    messages = record["messages"]
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise SpecFitError(f'{where}: "messages" must be a non-empty list of {{"role": ..., "content": ...}} objects, '
                           f'got {json_text(messages)}')
    for index, message in enumerate(messages):
        if not isinstance(message.get("role"), str) or not message["role"]:
            raise SpecFitError(f'{where}: "messages"[{index}]: "role" must be a non-empty string (e.g. "user"), '
                               f'got {json_text(message.get("role"))}')
        if not isinstance(message.get("content"), str):
            raise SpecFitError(f'{where}: "messages"[{index}]: "content" must be a string, '
                               f'got {json_text(message.get("content"))}')
        _check_unicode(message["content"], f'"messages"[{index}]: "content"', where)
    kwargs = record.get("chat_template_kwargs", {})
    if not isinstance(kwargs, dict):
        raise SpecFitError(f'{where}: "chat_template_kwargs" must be an object of template variables '
                           f'(e.g. {{"enable_thinking": false}}), got {json_text(kwargs)}')
    _check_tokenizer(tokenizer, "messages", where)
    text = chat.render(messages, kwargs, where)
    _check_unicode(text, "the rendered chat", where)
    # the template wrote the special tokens the model wants (its BOS): none added again
    ids = _tokenised(text, tokenizer, vocab_size, "messages", "renders to no tokens", where, add_special_tokens=False)
    return Prompt(number, ids, text)


class _ChatTemplate:
    """The model directory's chat template, rendered by transformers' tokenizer of that directory
    (local files only), loaded at the first chat."""

    def __init__(self, model_dir: str | Path | None):
        self.model_dir = model_dir
        self._tokenizer = None
        self._call_arguments = frozenset()

    def render(self, messages: list[dict], kwargs: dict, where: str) -> str:
        tokenizer = self._load(where)
        for name in kwargs:
            if name in self._call_arguments:
                raise SpecFitError(f'{where}: "chat_template_kwargs" sets "{name}", an argument of the rendering '
                                   f'itself; expected template variables only (e.g. "enable_thinking")')
        try:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        except ImportError as exc:      # transformers checks for jinja2 (3.1.6 or later) only here
            raise SpecFitError(f'{where}: "messages": rendering the chat template needs {one_line(exc)} '
                               f'({CHAT_EXTRA} installs it)') from None
        except Exception as exc:        # a template raises what it likes (raise_exception, jinja2's errors, ...)
            raise SpecFitError(f'{where}: the chat template of {self.model_dir} failed on "messages": '
                               f'{one_line(exc)}') from None

    def _load(self, where: str):
        if self._tokenizer is not None:
            return self._tokenizer
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise SpecFitError(f'{where}: "messages" is rendered with the model\'s chat template by transformers, '
                               f'which is not installed ({CHAT_EXTRA}); give "prompt" or "input_ids" instead') from None
        if self.model_dir is None:
            raise SpecFitError(f'{where}: "messages" needs the model directory\'s chat template; '
                               f'give "prompt" or "input_ids" instead')
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir), local_files_only=True)
        except Exception as exc:        # whatever the tokenizer class raises on its files
            raise SpecFitError(f"{self.model_dir}: transformers cannot load the tokenizer (tokenizer_config.json, "
                               f"tokenizer.json) that renders the chat template ({one_line(exc)})") from None
        templates = tokenizer.chat_template
        if not templates:
            raise SpecFitError(f'{where}: "messages" needs a chat template, but {self.model_dir} has none (no '
                               f'"chat_template" in tokenizer_config.json, no chat_template.jinja); give "prompt" '
                               f'or "input_ids" instead')
        if isinstance(templates, dict) and "default" not in templates:
            raise SpecFitError(f'{self.model_dir}: the chat templates are named {", ".join(sorted(templates))}; '
                               f'expected one named "default" for "messages"')
        template = templates["default"] if isinstance(templates, dict) else templates
        if not isinstance(template, str):
            raise SpecFitError(f'{self.model_dir}: the chat template must be a Jinja template (a string), '
                               f'got {json_text(template)}')
        # apply_chat_template's own arguments (tokenize, return_dict, ...) would change the call, not the template
        parameters = inspect.signature(tokenizer.apply_chat_template).parameters.values()
        self._call_arguments = frozenset(p.name for p in parameters if p.kind is not p.VAR_KEYWORD) | {"messages"}
        self._tokenizer = tokenizer
        return tokenizer


def _check_unicode(text: str, field: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:      # a lone surrogate ("\\ud800"): valid JSON, not text
        raise SpecFitError(f'{where}: {field} must be valid Unicode text, got an unpaired surrogate at character '
                           f'{exc.start}') from None


def _check_tokenizer(tokenizer, kind: str, where: str) -> None:
    if tokenizer is None:
        raise SpecFitError(f'{where}: "{kind}" needs a tokenizer, but the model directory has no tokenizer.json; '
                           f'give "input_ids" instead')


def _tokenised(text: str, tokenizer, vocab_size: int | None, kind: str, empty: str, where: str,
               add_special_tokens: bool = True) -> list[int]:
    """``text``'s token ids, at least one and each in the model's vocabulary: a tokenizer of
    another model than the weights (or with tokens added past the embedding's rows) gives ids the
    embedding has no row for, an IndexError deep in the first pass."""
    ids = list(tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
    if not ids:
        raise SpecFitError(f'{where}: "{kind}" {empty}')
    bad = [t for t in ids if vocab_size is not None and t >= vocab_size]
    if bad:
        raise SpecFitError(f'{where}: "{kind}" tokenises to token id {bad[0]}, outside the model\'s vocabulary [0, '
                           f'{vocab_size}) (config.json\'s vocab_size): the model directory\'s tokenizer.json has '
                           f'ids the embedding has no row for')
    return ids


def _token_ids(value, vocab_size: int | None, where: str) -> list[int]:
    if not isinstance(value, list) or not value:
        raise SpecFitError(f'{where}: "input_ids" must be a non-empty list of token ids')
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise SpecFitError(f'{where}: "input_ids" must contain integers only')
    bad = [t for t in value if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        raise SpecFitError(f'{where}: "input_ids" has token id {bad[0]} outside the vocabulary [0, {vocab_size})')
    return list(value)
