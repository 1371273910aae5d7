"""Prompt files for ``specfit decode``: JSON Lines, one prompt per line.

Each line is ``{"prompt": "text"}`` (tokenised with the model directory's tokenizer) or
``{"input_ids": [1, 2, 3]}``. Blank lines are skipped; anything else is an error naming the file
and the line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import SpecFitError

__all__ = ["Prompt", "read_prompts"]


@dataclass(frozen=True)
class Prompt:
    line: int               # 1-based line in the prompts file
    input_ids: list[int]
    text: str | None        # the prompt text when given as text


def read_prompts(path: str | Path, tokenizer=None, vocab_size: int | None = None) -> list[Prompt]:
    """Parse and tokenise every prompt of ``path``; token ids are checked against ``vocab_size``."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecFitError(f"{path}: cannot read the prompts file ({exc})") from None
    prompts = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise SpecFitError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(record, dict) or ("prompt" in record) == ("input_ids" in record):
            raise SpecFitError(f'{where}: expected an object with exactly one of "prompt" (text) or "input_ids" (a list of token ids)')
        if "prompt" in record:
            prompts.append(_from_text(record["prompt"], tokenizer, where, number))
        else:
            prompts.append(Prompt(number, _token_ids(record["input_ids"], vocab_size, where), None))
    if not prompts:
        raise SpecFitError(f"{path}: no prompts (expected one JSON object per line)")
    return prompts


def _from_text(text, tokenizer, where: str, number: int) -> Prompt:
    if not isinstance(text, str) or not text:
        raise SpecFitError(f'{where}: "prompt" must be a non-empty string')
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:      # a lone surrogate ("\\ud800"): valid JSON, not text
        raise SpecFitError(f'{where}: "prompt" must be valid Unicode text, got an unpaired surrogate at character '
                           f'{exc.start}') from None
    if tokenizer is None:
        raise SpecFitError(f'{where}: "prompt" needs a tokenizer, but the model directory has no tokenizer.json; '
                           f'give "input_ids" instead')
    ids = tokenizer.encode(text).ids
    if not ids:
        raise SpecFitError(f'{where}: "prompt" tokenises to no tokens')
    return Prompt(number, list(ids), text)


def _token_ids(value, vocab_size: int | None, where: str) -> list[int]:
    if not isinstance(value, list) or not value:
        raise SpecFitError(f'{where}: "input_ids" must be a non-empty list of token ids')
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise SpecFitError(f'{where}: "input_ids" must contain integers only')
    bad = [t for t in value if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        raise SpecFitError(f'{where}: "input_ids" has token id {bad[0]} outside the vocabulary [0, {vocab_size})')
    return list(value)
