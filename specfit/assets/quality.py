"""What the bundled tiny model is worth: held-out loss, drafter acceptance, routing statistics.

Everything runs on SpecFit's own runtime (:mod:`specfit.runtime`), the code path the demo uses:
the target's forward with its expert offload, the EAGLE-3 drafter and its dynamic tree.

Acceptance is measured exactly for greedy decoding without running a decoder: greedy output does
not depend on the drafts, so the target's greedy continuation of a prompt is computed once, and
each simulated cycle drafts from the committed prefix, accepts the longest draft path that
matches the continuation, and commits it plus the bonus token. The mean accepted length counts
the bonus token (EAGLE's tau): 1.0 means no draft token is ever accepted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..policies import rerank
from ..runtime.drafting import DrafterSession, TreeDraft
from ..runtime.eagle3 import Eagle3Drafter
from ..runtime.config import ModelConfig
from ..runtime.loader import check_drafter, drafter_capture_layers, load_model, load_tokenizer
from . import corpus

__all__ = ["DraftShape", "CHAIN", "TREE", "TinyModel", "acceptance", "routing_stats", "measure", "target_parameters",
           "model_card"]

WINDOW_TOKENS = 256          # held-out text is scored in windows of this many tokens
DOCS_PROMPT_TOKENS = 48      # a docs prompt is the start of a held-out text
NEW_TOKENS = 64


@dataclass(frozen=True)
class DraftShape:
    """A drafting setting: ``top_k`` children per expanded node, ``depth`` levels, at most
    ``max_nodes`` nodes kept after reranking (root included)."""

    name: str
    top_k: int
    depth: int
    max_nodes: int


CHAIN = DraftShape("chain depth 4", top_k=1, depth=4, max_nodes=5)
TREE = DraftShape("tree top-4 depth 4, 16 nodes", top_k=4, depth=4, max_nodes=16)


class TinyModel:
    """The target (runtime loader, every expert resident), its tokenizer and its drafter."""

    def __init__(self, target_dir: str | Path, drafter_dir: str | Path):
        target_config = ModelConfig.from_dir(target_dir)
        # the drafter's feature layers in either spelling (top-level or SpecForge's nested key), as the loader reads them
        capture = drafter_capture_layers(drafter_dir, target_config)
        # every expert resident: quality does not depend on the cache, and misses would only cost copies
        self.target = load_model(target_dir, cache_experts=target_config.n_experts, capture_layers=capture)
        self.tokenizer = load_tokenizer(target_dir)
        self.drafter = Eagle3Drafter.from_pretrained(drafter_dir, target_embed=self.target.embed_tokens.weight)
        check_drafter(self.target, self.drafter, source=str(drafter_dir))
        self.eos_ids = set(self.target.config.eos_token_ids)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def run(self, token_ids: list[int]):
        """One pass over ``token_ids`` from an empty cache (logits, experts, captured features)."""
        if self.target.max_seq_len < len(token_ids):
            self.target.setup_kv_cache(max(len(token_ids), 512))
        return self.target(token_ids, np.arange(len(token_ids)))

    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        """The target's greedy continuation (stops after an EOS token)."""
        self.target.setup_kv_cache(len(prompt_ids) + max_new_tokens)
        out = self.target(prompt_ids, np.arange(len(prompt_ids)), logits_rows=[-1])
        generated = [int(out.logits[-1].argmax())]
        while len(generated) < max_new_tokens and generated[-1] not in self.eos_ids:
            position = len(prompt_ids) + len(generated) - 1
            out = self.target([generated[-1]], [position])
            generated.append(int(out.logits[-1].argmax()))
        return generated


# ----------------------------------------------------------------- acceptance
def acceptance(model: TinyModel, prompt_ids: list[int], continuation: list[int], shape: DraftShape) -> list[int]:
    """Tokens committed by each greedy speculative cycle over ``continuation`` (bonus included).

    Cycles whose draft would reach past the end of the continuation are not counted, so every
    counted cycle had the same chance to accept ``shape.depth`` tokens.
    """
    sequence = list(prompt_ids) + list(continuation)
    features = model.run(sequence[:-1]).hidden          # features of every position but the last
    session = DrafterSession(model.drafter, len(sequence) + shape.depth * shape.top_k + 1)
    prompt_len = len(prompt_ids)
    root_output = session.commit(features[:prompt_len], sequence[1: prompt_len + 1])
    committed = prompt_len + 1                           # prompt + the first token from the prefill
    per_cycle = []
    while committed + shape.depth < len(sequence):
        drafting = TreeDraft(session, sequence[committed - 1], lambda out=root_output: out, shape.top_k, shape.depth)
        for _ in range(shape.depth):
            drafting.grow()
        full = drafting.tree()
        tree = full.subtree(rerank(full, shape.max_nodes))
        # the target's greedy token after a node at depth d is sequence[committed + d] on the right path
        verdicts = np.array([sequence[committed + d] for d in tree.depth])
        n_new = len(tree.accepted_path(verdicts))      # accepted draft tokens + the bonus token
        per_cycle.append(n_new)
        new_committed = committed + n_new
        root_output = session.commit(features[committed - 1: new_committed - 1], sequence[committed: new_committed])
        committed = new_committed
    return per_cycle


def bundled_prompt_acceptance(model: TinyModel, shape: DraftShape = CHAIN,
                              new_tokens: int = NEW_TOKENS) -> dict[str, float]:
    """Mean accepted length per workload on the demo prompts (``prompts.jsonl``)."""
    from . import demo_prompts_path

    cycles: dict[str, list[int]] = {}
    for line in demo_prompts_path().read_text().splitlines():
        record = json.loads(line)
        prompt = model.encode(record["prompt"])
        continuation = model.greedy(prompt, new_tokens)
        cycles.setdefault(record["workload"], []).extend(acceptance(model, prompt, continuation, shape))
    return {workload: round(float(np.mean(n)), 3) for workload, n in cycles.items()}


# ----------------------------------------------------------------- routing
def routing_stats(expert_ids: np.ndarray, n_experts: int) -> dict:
    """Per-layer routing statistics of consecutive tokens ``expert_ids`` [T, L, k].

    ``entropy_bits``: entropy of expert popularity (uniform routing: log2(n_experts));
    ``max_share``: the most popular expert's share of all assignments (uniform: 1/n_experts);
    ``reuse``: mean fraction of a token's experts that the previous token also used
    (independent uniform routing: k/n_experts).
    """
    T, L, k = expert_ids.shape
    counts = np.stack([np.bincount(expert_ids[:, layer].ravel(), minlength=n_experts) for layer in range(L)])
    share = counts / counts.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -np.where(share > 0, share * np.log2(share), 0.0).sum(axis=1)
    same = (expert_ids[1:, :, :, None] == expert_ids[:-1, :, None, :]).any(-1).sum(-1) / k   # [T-1, L]
    return {
        "entropy_bits": entropy.round(3).tolist(),
        "entropy_uniform_bits": round(float(np.log2(n_experts)), 3),
        "max_share": share.max(axis=1).round(3).tolist(),
        "uniform_share": round(1.0 / n_experts, 3),
        "reuse": same.mean(axis=0).round(3).tolist(),
        "reuse_independent": round(k / n_experts, 3),
    }


# ----------------------------------------------------------------- everything
def _windows(documents: list[list[int]], size: int) -> list[list[int]]:
    stream = [token for doc in documents for token in doc]
    return [stream[i: i + size] for i in range(0, len(stream) - 1, size) if len(stream[i: i + size]) > 1]


def workload_prompts(data: corpus.Corpus, model: TinyModel, n: int) -> dict[str, list[list[int]]]:
    """Held-out prompts: the start of a docs text; a math question up to "Answer:"."""
    docs = [model.encode(text)[:DOCS_PROMPT_TOKENS] for text in data.eval_docs[:n]]
    math = [model.encode(problem.split("Answer:")[0] + "Answer:") for problem in data.eval_math[:n]]
    return {"docs": docs, "math": math}


def measure(target_dir, drafter_dir, seed: int, n_train_math: int, n_eval_math: int,
            n_prompts: int = 16, log=print) -> dict:
    """Loss, acceptance and routing per workload on held-out data (the numbers of the model card)."""
    model = TinyModel(target_dir, drafter_dir)
    data = corpus.build(seed, n_train_math, n_eval_math)
    eos = next(iter(model.eos_ids))
    held_out = {"docs": data.eval_docs, "math": data.eval_math}
    results: dict = {"workloads": {}}
    for workload, texts in held_out.items():
        documents = [model.encode(text) + [eos] for text in texts]
        losses, tokens, routing = [], 0, []
        for window in _windows(documents, WINDOW_TOKENS):
            out = model.run(window)
            loss = F.cross_entropy(out.logits[:-1].float(), torch.tensor(window[1:]), reduction="sum")
            losses.append(float(loss))
            tokens += len(window) - 1
            routing.append(out.expert_ids)
        loss = sum(losses) / tokens
        stats = routing_stats(np.concatenate(routing), model.target.config.n_experts)
        results["workloads"][workload] = {"held_out_tokens": tokens, "loss": round(loss, 4),
                                          "perplexity": round(float(np.exp(loss)), 2), "routing": stats}
        log(f"{workload}: held-out loss {loss:.3f} (perplexity {np.exp(loss):.1f}) over {tokens} tokens")

    for workload, prompts in workload_prompts(data, model, n_prompts).items():
        continuations = [model.greedy(prompt, NEW_TOKENS) for prompt in prompts]
        entry = results["workloads"][workload]
        entry["acceptance"] = {}
        for shape in (CHAIN, TREE):
            cycles = [n for prompt, cont in zip(prompts, continuations) for n in acceptance(model, prompt, cont, shape)]
            entry["acceptance"][shape.name] = {"mean_accepted_length": round(float(np.mean(cycles)), 3),
                                               "cycles": len(cycles)}
            log(f"{workload}: {shape.name}: mean accepted length {np.mean(cycles):.2f} over {len(cycles)} cycles")
        if workload == "math":
            answers = [problem.rsplit("The answer is ", 1)[1] for problem in data.eval_math[:n_prompts]]
            correct = sum(f"The answer is {answer}" in model.tokenizer.decode(cont)
                          for answer, cont in zip(answers, continuations))
            entry["greedy_answers_correct"] = f"{correct}/{len(answers)}"
    results["bundled_prompts"] = {shape.name: bundled_prompt_acceptance(model, shape) for shape in (CHAIN, TREE)}
    log(f"bundled prompts: {results['bundled_prompts']}")
    results["sizes_bytes"] = {name: sum(p.stat().st_size for p in Path(d).iterdir())
                              for name, d in (("target", target_dir), ("drafter", drafter_dir))}
    results["parameters"] = {
        "target": target_parameters(model.target),
        "drafter": int(sum(p.numel() for p in model.drafter.parameters())),
    }
    return results


def target_parameters(target) -> int:
    """The target's parameters: its modules' plus every routed expert's, which live in the offload
    (only the MoE layers have them)."""
    config = target.config
    return int(sum(p.numel() for p in target.parameters()) + config.n_moe_layers * config.n_experts * config.expert_params)


def model_card(m: dict) -> str:
    """The assets' README (model card) from :func:`measure`'s results."""
    r = m["recipe"]
    w = m["workloads"]
    mb = {k: v / 1e6 for k, v in m["sizes_bytes"].items()}
    lines = [
        "# Bundled tiny MoE + EAGLE-3 drafter",
        "",
        "A small model that behaves like a real one, so `specfit demo` runs speculative decoding with",
        "meaningful acceptance and routing on a laptop, without downloads. It is a toy: it writes",
        "Python-documentation-flavoured prose and solves templated arithmetic word problems.",
        "",
        "| asset | format | size |",
        "|---|---|---|",
        f"| `tiny-moe/` | Hugging Face `Qwen3MoeForCausalLM` (config.json, model.safetensors float32, tokenizer.json) | {mb['target']:.1f} MB |",
        f"| `tiny-moe-eagle3/` | EAGLE-3 (`LlamaForCausalLMEagle3`, `midlayer.*`, `d2t`/`t2d`, no `embed_tokens`: uses the target's) | {mb['drafter']:.1f} MB |",
        "",
        "## Target",
        "",
        f"- {m['parameters']['target'] / 1e6:.2f} M parameters: {r['n_layers']} layers, hidden {r['hidden_size']}, "
        f"{r['n_heads']} query / {r['n_kv_heads']} KV heads of {r['head_dim']}, {r['n_experts']} experts per layer, "
        f"top-{r['top_k']} (renormalised), expert width {r['moe_intermediate_size']}; untied embeddings.",
        f"- Byte-level BPE tokenizer, {r['vocab_size']} tokens, digits split one per token; `<|endoftext|>` (id 0) ends a document.",
        f"- Trained {r['target_steps']} steps x {r['batch_size']} x {r['seq_len']} tokens, AdamW, peak lr {r['target_lr']}, "
        f"load-balancing loss coefficient {r['router_aux_loss_coef']} (`output_router_logits=True`).",
        "",
        "## Corpus (offline, from the Python distribution)",
        "",
        "- **docs**: the `pydoc_data` documentation topics plus docstrings of about 100 standard-library modules; "
        f"every {corpus.HELD_OUT_EVERY}th text is held out.",
        f"- **math**: {r['math_train_problems']} generated arithmetic word problems with worked answers "
        f"(`specfit/assets/corpus.py`, seed {r['seed']}); {r['math_eval_problems']} held-out problems from another seed.",
        "",
        "## Held-out quality",
        "",
        "| workload | tokens | loss (nats) | perplexity | greedy answers correct |",
        "|---|---|---|---|---|",
    ]
    for name, entry in w.items():
        lines.append(f"| {name} | {entry['held_out_tokens']} | {entry['loss']:.3f} | {entry['perplexity']:.1f} | "
                     f"{entry.get('greedy_answers_correct', '-')} |")
    lines += [
        "",
        "## Drafter",
        "",
        f"- One EAGLE-3 layer, {m['parameters']['drafter'] / 1e6:.2f} M parameters, draft vocabulary "
        f"{r['draft_vocab_size']} of {r['vocab_size']} tokens (the most frequent in the corpus).",
        f"- Features: the inputs of target layers {r['aux_layers']} (config `eagle_aux_hidden_state_layer_ids`). "
        "EAGLE-3's default (inputs of layers 2, L/2, L-3) gives 2, 2, 1 for 4 layers, so the three distinct "
        "layers after the first are used, in order low / mid / high.",
        f"- Trained {r['drafter_steps']} steps x {r['drafter_batch_size']} x {r['seq_len']} tokens with the published objective: "
        f"soft targets from the target's distribution over the draft vocabulary, {r['ttt_steps']} unrolled steps feeding "
        f"the drafter's own hidden state back, step k weighted {r['ttt_step_decay']}^k.",
        "",
        f"Mean accepted length per cycle (accepted draft tokens + the bonus token; 1.0 = nothing accepted), greedy, "
        f"{NEW_TOKENS} new tokens after each of 16 held-out prompts per workload:",
        "",
        "| workload | " + " | ".join(w["docs"]["acceptance"]) + " |",
        "|---|" + "---|" * len(w["docs"]["acceptance"]),
    ]
    for name, entry in w.items():
        lines.append(f"| {name} | " + " | ".join(f"{a['mean_accepted_length']:.2f}" for a in entry["acceptance"].values()) + " |")
    lines += [
        "",
        "On the 8 demo prompts (`prompts.jsonl`, also held out), mean accepted length: "
        + "; ".join(f"{shape}: " + ", ".join(f"{w_} {v:.2f}" for w_, v in per.items())
                    for shape, per in m["bundled_prompts"].items()) + ".",
        "",
        "## Routing (held-out text, per layer)",
        "",
        "| workload | popularity entropy (bits) | max expert share | consecutive-token reuse |",
        "|---|---|---|---|",
    ]
    for name, entry in w.items():
        s = entry["routing"]
        lines.append(f"| {name} | {', '.join(map(str, s['entropy_bits']))} | {', '.join(map(str, s['max_share']))} | "
                     f"{', '.join(map(str, s['reuse']))} |")
    any_stats = next(iter(w.values()))["routing"]
    lines += [
        "",
        f"Uniform routing would give {any_stats['entropy_uniform_bits']} bits and a max share of "
        f"{any_stats['uniform_share']}; independent routing a reuse of {any_stats['reuse_independent']}.",
        "",
        "## Rebuild",
        "",
        "    pip install -e '.[dev]'",
        "    nice -n 10 python scripts/train_tiny.py --threads 1 2>&1 | tee build/train_tiny.log",
        "",
        f"Deterministic for a seed (`--seed`, default {r['seed']}), Python and torch version; the docs text "
        "follows the running Python's documentation. Built with "
        + ", ".join(f"{k} {v}" for k, v in m["built_with"].items())
        + ". Training time on 2 shared CPU cores: "
        + ", ".join(f"{k} {v} min" for k, v in m["training_minutes"].items())
        + ". All numbers above are in `measurements.json`.",
        "",
    ]
    return "\n".join(lines)
