"""The prompt's passes: chunked prefill, as inference servers run it.

The prompt goes through the target (and the drafter) in passes of at most :data:`PREFILL_CHUNK`
tokens, each a causal continuation of the KV entries the passes before it wrote. A pass's
attention scores are ``[heads, chunk, keys]`` instead of ``[heads, prompt, prompt]`` (about 8 bytes
a score in bfloat16 with the float32 softmax): at Qwen3-30B-A3B's 32 heads the last 512-token
chunk of a 4096-token prompt holds 0.56 GB where the one pass held 4.4 GB, and of a 16k prompt
2.2 GB where the one pass held 70 GB (:func:`~specfit.runtime.footprint.pass_workspace_bytes`).

Why 512: a chunk of a few hundred tokens already routes to nearly every expert of a layer (512
tokens x 8 of Qwen3's 128 experts), so each chunk streams an uncached layer's experts once, and a
smaller chunk would pay that sweep more often; at 512 the workspace stays well below the weights at
any context these models take, and a prompt of at most 512 tokens runs in one pass, exactly as
without chunking. ``specfit plan`` sizes the prompt's workspace with the same chunk (its
``--prefill-chunk``, as ``specfit decode``'s, defaults to it).
"""

from __future__ import annotations

import numbers

from ..errors import SpecFitError

__all__ = ["PREFILL_CHUNK", "PREFILL_CHUNK_HELP", "prefill_chunks", "largest_prompt_pass", "check_prefill_chunk"]

PREFILL_CHUNK = 512
# (rich reads [..] in a help text as markup: the shapes are written heads x chunk x context)
PREFILL_CHUNK_HELP = ("Run the prompt through the target and the drafter in passes of at most this many tokens "
                      "(chunked prefill: a pass's attention scores are heads x chunk x context, not heads x prompt x "
                      "prompt); 0: one pass.")


def prefill_chunks(n: int, chunk: int) -> list[tuple[int, int]]:
    """The ``(start, end)`` token ranges of a prompt of ``n`` tokens in passes of at most ``chunk``
    (0: one pass)."""
    step = chunk or max(n, 1)
    return [(start, min(start + step, n)) for start in range(0, n, step)]


def largest_prompt_pass(n: int, chunk: int) -> tuple[int, int]:
    """(new tokens, tokens before them) of the largest of a prompt's passes (:func:`prefill_chunks`):
    a whole chunk over every prompt token before it (a bound where the last chunk is ragged), or
    the prompt in one pass."""
    new = min(chunk or n, n)
    return new, n - new


def check_prefill_chunk(chunk, option: str = "--prefill-chunk") -> int:
    """``chunk`` as an int; one clear error where it is not a number of tokens >= 0."""
    if isinstance(chunk, bool) or not isinstance(chunk, numbers.Integral) or chunk < 0:
        raise SpecFitError(f"{option}: expected a number of tokens >= 0 (0: the prompt in one pass), got {chunk!r}")
    return int(chunk)
