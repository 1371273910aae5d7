"""An independent small draft model as the drafter: any supported MoE architecture that shares the
target's tokenizer.

It plugs into the same level-by-level tree drafting as an EAGLE-3 head
(:mod:`specfit.runtime.drafting`): :class:`DrafterSession` and :class:`TreeDraft` call it exactly
like one (tokens at explicit positions, a mask over its own KV cache, one call per tree level),
but it reads only tokens — the target's features and the
drafter's own outputs that EAGLE-3 feeds back are ignored.

Pairing: the session gives entry i the token x[i+1] at drafter position i (EAGLE-3's layout, where
position i carries the target's features of x[i]); a language model wants x[i+1] at position
i+1, so every position is shifted by one. The prompt's first token is never fed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import SpecFitError
from .drafting import DraftOutput
from .model import MoETransformer, causal_mask

__all__ = ["DraftModelConfig", "ModelDrafter"]


@dataclass(frozen=True)
class DraftModelConfig:
    """What the speculative decoder reads from a drafter's config."""

    hidden_size: int
    vocab_size: int
    draft_vocab_size: int
    aux_hidden_state_layer_ids: tuple[int, ...] | None = None   # reads no target features
    kind: str = "model"


class ModelDrafter:
    """A :class:`MoETransformer` behind the drafter interface of :mod:`specfit.runtime.drafting`."""

    # its hidden states live in its own space: the target's routers cannot read them
    features_in_target_space = False

    def __init__(self, model: MoETransformer):
        self.model = model
        c = model.config
        self.config = DraftModelConfig(hidden_size=c.hidden_size, vocab_size=c.vocab_size, draft_vocab_size=c.vocab_size)
        self.max_seq_len = 0

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def setup_kv_cache(self, max_seq_len: int) -> None:
        self.model.setup_kv_cache(max_seq_len)
        self.max_seq_len = int(max_seq_len)

    def check_target(self, vocab_size: int, hidden_size: int, source: str = "target") -> None:
        if self.config.vocab_size != vocab_size:
            raise SpecFitError(f"draft model: vocabulary of {self.config.vocab_size} tokens, but the {source} has "
                               f"{vocab_size}; a draft model must share the target's tokenizer")

    def to_target_ids(self, draft_token_ids: torch.Tensor) -> torch.Tensor:
        return draft_token_ids        # one vocabulary

    def __call__(self, hidden, input_ids, positions, attn_mask=None, logits_rows=None) -> DraftOutput:
        """Run ``input_ids`` at the session's ``positions`` (shifted by one, see the module
        docstring); without a mask, a linear continuation of the committed slots; ``logits_rows``
        as the target model takes it (all rows by default)."""
        positions = torch.as_tensor(positions, dtype=torch.long)
        if attn_mask is None:
            attn_mask = causal_mask(int(positions[0]), positions.numel())
        out = self.model(input_ids, positions + 1, attn_mask, logits_rows=logits_rows)
        # the tree keeps each node's output to feed its children, which a language model does
        # not need: an empty state per entry
        return DraftOutput(logits=out.logits, hidden=out.logits.new_zeros((out.logits.shape[0], 0)))
