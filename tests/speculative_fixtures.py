"""EAGLE-3 drafters for the tiny random targets of :mod:`runtime_fixtures`, saved in the
published checkpoint format.

A random drafter almost never guesses the target's next token, which would leave acceptance,
KV compaction and the drafter's re-run of accepted tokens untested. :func:`make_drafter` can
therefore fit the drafter's ``lm_head`` to the target's greedy continuations of given prompts, in
closed form (ridge regression on the drafter's normalised hidden states, which a wide random layer
makes rich enough to memorise them): both the first draft level (entries fed with the target's
features) and the second (entries fed with the drafter's own output) are fitted, so decoding those
prompts accepts multi-token paths.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specfit.runtime.decoder import Decoder
from specfit.runtime.drafting import Proposer
from specfit.runtime.eagle3 import Eagle3Config, Eagle3Drafter
from specfit.runtime.loader import load_model
from specfit.runtime.model import causal_mask


def speculative_decoder(model, drafter, policy, cost, tree_top_k: int = 4, **options) -> Decoder:
    """The decoder of ``policy`` with ``drafter`` as its proposer (none for a policy that never drafts)."""
    proposer = Proposer(drafter, tree_top_k) if policy.max_levels else None
    return Decoder(model, proposer, policy, cost, **options)


def drafter_config(model, draft_vocab_size: int | None = None, **overrides) -> Eagle3Config:
    c = model.config
    fields = dict(hidden_size=c.hidden_size, target_hidden_size=c.hidden_size, vocab_size=c.vocab_size,
                  draft_vocab_size=draft_vocab_size or c.vocab_size, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=2 * c.hidden_size, rope_theta=10000.0,
                  aux_hidden_state_layer_ids=tuple(model.capture_layers))
    fields.update(overrides)
    return Eagle3Config(**fields)


def make_drafter(model_dir: Path, drafter_dir: Path, seed: int = 0, fit_prompts=None, new_tokens: int = 32,
                 hidden_size: int | None = None, draft_vocab_size: int | None = None,
                 layer_prefix: str = "midlayer.") -> Path:
    """A random EAGLE-3 head for the target in ``model_dir``, saved to ``drafter_dir``.

    With the target's hidden size (the default) the head shares the target's embedding; with
    another ``hidden_size`` it owns one. With ``fit_prompts`` its ``lm_head`` is fitted to the
    target's greedy continuations of those prompts (``new_tokens`` each)."""
    model = load_model(model_dir, cache_experts=model_config_experts(model_dir))
    H = hidden_size or model.config.hidden_size
    config = drafter_config(model, draft_vocab_size, hidden_size=H, intermediate_size=2 * H, head_dim=max(16, H // 8))
    shared = H == model.config.hidden_size
    drafter = Eagle3Drafter(config, target_embed=model.embed_tokens.weight if shared else None)
    drafter.init_weights(seed, std=0.2 if shared else 0.5)
    generator = torch.Generator().manual_seed(seed)
    # a spread-out draft vocabulary: every target token when it is as large, else a random subset
    ids = torch.randperm(config.vocab_size, generator=generator)[: config.draft_vocab_size].sort().values
    drafter.set_draft_vocabulary(ids)
    drafter.eval()
    if fit_prompts:
        _fit_lm_head(model, drafter, fit_prompts, new_tokens)
    drafter.save_pretrained(drafter_dir, layer_prefix=layer_prefix)
    return Path(drafter_dir)


def model_config_experts(model_dir: Path) -> int:
    from specfit.runtime.config import ModelConfig

    return ModelConfig.from_dir(model_dir).n_experts


def greedy_continuation(model, prompt: list[int], new_tokens: int) -> list[int]:
    """``prompt`` followed by the target's greedy continuation (full recomputation per token)."""
    sequence = list(prompt)
    model.setup_kv_cache(len(prompt) + new_tokens + 1)
    for _ in range(new_tokens):
        n = len(sequence)
        sequence.append(int(model(sequence, np.arange(n), causal_mask(0, n)).logits[-1].argmax()))
    return sequence


@torch.inference_mode()
def _fit_lm_head(model, drafter: Eagle3Drafter, prompts, new_tokens: int, ridge: float = 1e-2) -> None:
    rows, targets = [], []
    for prompt in prompts:
        sequence = greedy_continuation(model, prompt, new_tokens)
        n = len(sequence)
        full = model(sequence, np.arange(n), causal_mask(0, n))
        greedy = full.logits.argmax(-1)
        # level 1: entry i pairs the target's features at i with token i + 1 and drafts token i + 2
        drafter.setup_kv_cache(2 * n)
        level1 = drafter(full.hidden[: n - 1], torch.tensor(sequence[1:]), torch.arange(n - 1))
        # level 2: entry (output of entry i, token i + 2) at position i + 1, seeing entries 0..i and
        # itself, drafts token i + 3 — as a level-2 node of a draft tree does
        m = n - 2
        mask = torch.zeros(m, n - 1 + m, dtype=torch.bool)
        mask[:, : n - 1] = torch.ones(m, n - 1, dtype=torch.bool).tril()
        mask[torch.arange(m), n - 1 + torch.arange(m)] = True
        level2 = drafter(level1.hidden[:m], torch.tensor(sequence[2:]), torch.arange(1, m + 1), mask)
        rows += [drafter.norm(level1.hidden[: n - 2]), drafter.norm(level2.hidden[: n - 3])]
        targets += [greedy[1: n - 1], greedy[2: n - 1]]
    X = torch.cat(rows).double()
    target_ids = torch.cat(targets)
    draft_index = torch.full((model.config.vocab_size,), -1, dtype=torch.long)
    draft_index[drafter.draft_ids] = torch.arange(drafter.config.draft_vocab_size)
    keep = draft_index[target_ids] >= 0
    X = X[keep]
    Y = torch.zeros(X.shape[0], drafter.config.draft_vocab_size, dtype=torch.float64)
    Y[torch.arange(X.shape[0]), draft_index[target_ids[keep]]] = 1.0
    W = torch.linalg.solve(X.T @ X + ridge * torch.eye(X.shape[1], dtype=torch.float64), X.T @ Y).T
    drafter.lm_head.weight.copy_((W * 8.0).float())     # sharpen: confident drafts, as trained heads are
