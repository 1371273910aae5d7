"""Rebuild the bundled tiny MoE target and its EAGLE-3 drafter (``specfit/assets``).

Everything comes from text that ships with Python, so the assets can be rebuilt offline:

- the *docs* workload: the documentation topics of ``pydoc_data`` plus the docstrings of a fixed
  list of standard-library modules;
- the *math* workload: arithmetic word problems from a seeded generator
  (:func:`specfit.assets.corpus.math_problems`).

Stages (``--stage``, default ``all``), each reading the previous one's output from ``--work-dir``:

1. ``target``: a byte-level BPE tokenizer (``tokenizers``), then a Qwen3-MoE model trained with
   ``transformers``' ``Qwen3MoeForCausalLM`` and its load-balancing loss switched on, so routing is
   skewed but not collapsed;
2. ``drafter``: an EAGLE-3 head trained on the frozen target's captured hidden states with the
   published objective: soft targets from the target's distribution over the draft vocabulary,
   several unrolled steps that feed the drafter's own hidden state back (training-time test);
3. ``report``: held-out loss per workload, drafter acceptance, routing statistics, written into
   ``specfit/assets/README.md`` and ``measurements.json``; then the assets are installed.

Deterministic for a given seed, Python and torch version (one thread by default so it can run
beside other work). Outputs are written to a temporary directory and renamed into place.

    nice -n 10 python scripts/train_tiny.py --threads 1 2>&1 | tee build/train_tiny.log
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from specfit.assets import corpus  # noqa: E402

EOS = "<|endoftext|>"


@dataclass(frozen=True)
class Recipe:
    """Every knob of the rebuild; written next to the assets as ``recipe.json``."""

    seed: int = 1234
    # tokenizer
    vocab_size: int = 2048
    # target (Qwen3-MoE)
    hidden_size: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 32
    n_experts: int = 16
    top_k: int = 4
    moe_intermediate_size: int = 128
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    router_aux_loss_coef: float = 0.01
    # target training
    seq_len: int = 256
    batch_size: int = 16
    target_steps: int = 640
    target_lr: float = 2e-3
    warmup_steps: int = 40
    weight_decay: float = 0.05
    math_train_problems: int = 4000
    math_eval_problems: int = 200
    # drafter (EAGLE-3)
    draft_vocab_size: int = 1024
    drafter_intermediate_size: int = 384
    drafter_batch_size: int = 8
    drafter_steps: int = 600
    drafter_lr: float = 2e-3
    ttt_steps: int = 4                 # unrolled steps after the first (so depth-5 chains are trained)
    ttt_step_decay: float = 0.8        # loss weight of unrolled step k: decay ** k (EAGLE-3)
    aux_layers: tuple[int, ...] = (1, 2, 3)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


# ----------------------------------------------------------------- small helpers
def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def replace_dir(built: Path, destination: Path) -> None:
    """Move a finished directory into place: readers never see a half-written asset."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    old = destination.with_name(destination.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if destination.exists():
        destination.rename(old)
    built.rename(destination)
    if old.exists():
        shutil.rmtree(old)


def staging_dir(destination: Path) -> Path:
    destination.parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f".{destination.name}.", dir=destination.parent))
    path.chmod(0o755)   # mkdtemp makes it private; the assets are ordinary package files
    return path


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def windows(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """Cut a token stream into non-overlapping [n, seq_len] training windows."""
    n = len(stream) // seq_len
    return stream[: n * seq_len].reshape(n, seq_len)


# ----------------------------------------------------------------- stage 1: tokenizer + target
def train_tokenizer(texts: list[str], vocab_size: int, out_path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    # single digits keep arithmetic learnable by a tiny model (no "1937" token to memorise)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.save(str(out_path))


def encode_documents(tokenizer, texts: list[str]) -> list[np.ndarray]:
    eos = tokenizer.token_to_id(EOS)
    return [np.array(encoding.ids + [eos], dtype=np.int64) for encoding in tokenizer.encode_batch(texts)]


def epoch_windows(documents: list[np.ndarray], seq_len: int, rng: np.random.Generator) -> np.ndarray:
    """One pass over the documents in a fresh order, packed into windows (EOS between documents)."""
    order = rng.permutation(len(documents))
    return windows(np.concatenate([documents[i] for i in order]), seq_len)


def target_config(recipe: Recipe, tokenizer):
    from transformers import Qwen3MoeConfig

    eos = tokenizer.token_to_id(EOS)
    return Qwen3MoeConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=recipe.hidden_size,
        num_hidden_layers=recipe.n_layers, num_attention_heads=recipe.n_heads,
        num_key_value_heads=recipe.n_kv_heads, head_dim=recipe.head_dim,
        intermediate_size=4 * recipe.hidden_size,   # unused: every layer is MoE
        moe_intermediate_size=recipe.moe_intermediate_size, num_experts=recipe.n_experts,
        num_experts_per_tok=recipe.top_k, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=recipe.max_position_embeddings, rope_theta=recipe.rope_theta,
        rms_norm_eps=1e-6, tie_word_embeddings=False, output_router_logits=True,
        router_aux_loss_coef=recipe.router_aux_loss_coef, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
    )


def train_target(recipe: Recipe, work_dir: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import GenerationConfig, Qwen3MoeForCausalLM

    seed_everything(recipe.seed)
    data = corpus.build(recipe.seed, recipe.math_train_problems, recipe.math_eval_problems)
    log(f"corpus: {sum(map(len, data.train_docs)):,} docs chars, {len(data.train_math):,} math problems "
        f"(held out: {len(data.eval_docs)} docs texts, {len(data.eval_math)} problems)")
    out_dir = work_dir / "target"
    build = staging_dir(out_dir)
    train_tokenizer(data.train_docs + data.train_math, recipe.vocab_size, build / "tokenizer.json")
    (build / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": EOS}, indent=2) + "\n")
    tokenizer = Tokenizer.from_file(str(build / "tokenizer.json"))
    documents = encode_documents(tokenizer, data.train_docs + data.train_math)
    n_tokens = sum(map(len, documents))
    log(f"tokenizer: {tokenizer.get_vocab_size()} tokens; training stream {n_tokens:,} tokens "
        f"= {recipe.target_steps * recipe.tokens_per_step / n_tokens:.1f} epochs")

    config = target_config(recipe, tokenizer)
    model = Qwen3MoeForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    log(f"target: {sum(p.numel() for p in model.parameters()):,} parameters")
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=recipe.target_lr, betas=(0.9, 0.95))
    rng = np.random.default_rng(recipe.seed)
    pending = np.empty((0, recipe.seq_len), dtype=np.int64)
    started = time.time()
    model.train()
    for step in range(recipe.target_steps):
        if len(pending) < recipe.batch_size:
            pending = np.concatenate([pending, epoch_windows(documents, recipe.seq_len, rng)])
        batch, pending = torch.from_numpy(pending[: recipe.batch_size]), pending[recipe.batch_size:]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, recipe.target_steps, recipe.target_lr, recipe.warmup_steps)
        out = model(input_ids=batch, labels=batch)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 50 == 0 or step == recipe.target_steps - 1:
            elapsed_s = time.time() - started
            eta_s = elapsed_s / (step + 1) * (recipe.target_steps - step - 1)
            lm_loss = out.loss.item() - recipe.router_aux_loss_coef * out.aux_loss.item()
            log(f"target step {step:5d}/{recipe.target_steps}  lm loss {lm_loss:.3f}  "
                f"balance loss {out.aux_loss.item():.3f}  {elapsed_s:.0f}s elapsed, ~{eta_s:.0f}s left")

    model.eval()
    model.config.output_router_logits = False   # inference default; the coefficient stays documented
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.eos_token_id,
                                               do_sample=False)
    model.save_pretrained(build)
    replace_dir(build, out_dir)
    log(f"target saved to {out_dir} ({(time.time() - started) / 60:.1f} min of training)")


# ----------------------------------------------------------------- stage 2: drafter
def draft_vocabulary(documents: list[np.ndarray], vocab_size: int, draft_vocab_size: int) -> torch.Tensor:
    """The ``draft_vocab_size`` most frequent training tokens, ascending by id (EAGLE-3's choice)."""
    counts = np.bincount(np.concatenate(documents), minlength=vocab_size)
    # stable sort: ties broken by id, so the choice is deterministic
    keep = np.sort(np.argsort(-counts, kind="stable")[:draft_vocab_size])
    return torch.from_numpy(keep)


class TargetFeatures:
    """The frozen target, run in inference mode to produce the drafter's inputs and soft labels."""

    def __init__(self, target_dir: Path, aux_layers: tuple[int, ...]):
        from transformers import Qwen3MoeForCausalLM

        self.model = Qwen3MoeForCausalLM.from_pretrained(target_dir, attn_implementation="sdpa", dtype=torch.float32)
        self.model.requires_grad_(False).eval()
        self.aux_layers = aux_layers

    @torch.inference_mode()
    def __call__(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Captured features [B, T, 3H] (inputs of the aux layers, low/mid/high) and logits [B, T, V]."""
        out = self.model(input_ids=batch, output_hidden_states=True, output_router_logits=False)
        # hidden_states[i] is the input of decoder layer i (hidden_states[0] = embeddings)
        features = torch.cat([out.hidden_states[layer] for layer in self.aux_layers], dim=-1)
        return features.clone(), out.logits.clone()


def ttt_attention(layer, q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Attention of unrolled step k = len(keys) - 1, for every position at once.

    A step-k query at position t sees the step-0 keys at positions <= t (the committed prefix)
    and, of steps 1..k, only the key at its own position t (its chain of draft ancestors). The
    second part is a per-position dot product, so it is computed as one instead of as a mostly
    masked [n, k * n] block. q: [B, heads, n, hd]; keys/values: per step [B, kv_heads, n, hd].
    Returns [B, n, H] after o_proj, as :meth:`Eagle3Layer.attend` would.
    """
    attn = layer.self_attn
    groups = attn.n_heads // attn.n_kv_heads
    keys = [k.repeat_interleave(groups, dim=1) for k in keys]
    values = [v.repeat_interleave(groups, dim=1) for v in values]
    n = q.shape[-2]
    prefix_scores = torch.matmul(q, keys[0].transpose(-1, -2)) * attn.scale
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    prefix_scores = prefix_scores.masked_fill(~causal, torch.finfo(q.dtype).min)
    chain_scores = [(q * k).sum(-1, keepdim=True) * attn.scale for k in keys[1:]]        # [B, heads, n, 1]
    probs = F.softmax(torch.cat([prefix_scores] + chain_scores, dim=-1), dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs[..., :n], values[0])
    for j, v in enumerate(values[1:]):
        out = out + probs[..., n + j: n + j + 1] * v
    return attn.o_proj(out.transpose(1, 2).flatten(-2))


def ttt_loss(drafter, features: torch.Tensor, input_ids: torch.Tensor, target_logits: torch.Tensor,
             steps: int, step_decay: float) -> tuple[torch.Tensor, list[float]]:
    """EAGLE-3's training-time test on one batch.

    Step 0 at position t reads (embed(x[t+1]), fc(features[t])) and predicts x[t+2]; step k reads
    (embed(x[t+1+k]), the drafter's step-(k-1) output at t) at RoPE position t+k and predicts
    x[t+2+k]. A step-k query attends to the step-0 keys at positions <= t and to its own chain's
    keys of steps 1..k, exactly the keys a depth-k draft node sees at inference. Labels are the
    target's distribution at position t+1+k, restricted to the draft vocabulary.

    Returns the weighted loss and each step's top-1 agreement with the target.
    """
    batch, seq_len = input_ids.shape
    n_pos = seq_len - 1 - steps                           # positions with a label for every step
    embed = drafter.embed(input_ids)
    soft_labels = F.softmax(target_logits[..., drafter.draft_ids], dim=-1)
    hidden = drafter.fc(features[:, :n_pos])
    base_positions = torch.arange(n_pos)
    keys, values = [], []
    total = torch.zeros(())
    agreement = []
    for k in range(steps + 1):
        positions = base_positions + k
        x_embed = embed[:, 1 + k: 1 + k + n_pos]
        q, key, value = drafter.midlayer.project(x_embed, hidden, drafter.rope(positions))
        keys.append(key)
        values.append(value)
        attn = ttt_attention(drafter.midlayer, q, keys, values)
        hidden = drafter.midlayer.finish(hidden, attn)
        logits = drafter.head(hidden)
        labels = soft_labels[:, 1 + k: 1 + k + n_pos]
        loss = -(labels * F.log_softmax(logits, dim=-1)).sum(-1).mean()
        total = total + step_decay ** k * loss
        agreement.append((logits.argmax(-1) == labels.argmax(-1)).float().mean().item())
    return total, agreement


def train_drafter(recipe: Recipe, work_dir: Path) -> None:
    from tokenizers import Tokenizer

    from specfit.runtime.eagle3 import Eagle3Config, Eagle3Drafter

    seed_everything(recipe.seed + 1)
    target_dir = work_dir / "target"
    data = corpus.build(recipe.seed, recipe.math_train_problems, recipe.math_eval_problems)
    tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    documents = encode_documents(tokenizer, data.train_docs + data.train_math)
    target = TargetFeatures(target_dir, recipe.aux_layers)
    target_embed = target.model.get_input_embeddings().weight.detach().clone()
    vocab_size = target_embed.shape[0]
    draft_ids = draft_vocabulary(documents, vocab_size, recipe.draft_vocab_size)
    coverage = float(np.isin(np.concatenate(documents), draft_ids.numpy()).mean())
    log(f"draft vocabulary: {recipe.draft_vocab_size} of {vocab_size} tokens cover {coverage:.1%} of the corpus")

    tc = target.model.config
    config = Eagle3Config(
        hidden_size=tc.hidden_size, target_hidden_size=tc.hidden_size, vocab_size=vocab_size,
        draft_vocab_size=recipe.draft_vocab_size, num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads, head_dim=tc.head_dim,
        intermediate_size=recipe.drafter_intermediate_size, rms_norm_eps=tc.rms_norm_eps,
        rope_theta=recipe.rope_theta, max_position_embeddings=tc.max_position_embeddings,
        aux_hidden_state_layer_ids=recipe.aux_layers,
    )
    drafter = Eagle3Drafter(config, target_embed=target_embed)
    drafter.init_weights(seed=recipe.seed + 1)
    drafter.set_draft_vocabulary(draft_ids)
    parameters = [p for p in drafter.parameters() if p.requires_grad]
    log(f"drafter: {sum(p.numel() for p in parameters):,} trained parameters")
    optimizer = torch.optim.AdamW(parameters, lr=recipe.drafter_lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = np.random.default_rng(recipe.seed + 1)
    pending = np.empty((0, recipe.seq_len), dtype=np.int64)
    started = time.time()
    for step in range(recipe.drafter_steps):
        if len(pending) < recipe.drafter_batch_size:
            pending = np.concatenate([pending, epoch_windows(documents, recipe.seq_len, rng)])
        batch, pending = torch.from_numpy(pending[: recipe.drafter_batch_size]), pending[recipe.drafter_batch_size:]
        features, target_logits = target(batch)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, recipe.drafter_steps, recipe.drafter_lr, recipe.warmup_steps)
        loss, agreement = ttt_loss(drafter, features, batch, target_logits, recipe.ttt_steps, recipe.ttt_step_decay)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        if step % 50 == 0 or step == recipe.drafter_steps - 1:
            elapsed_s = time.time() - started
            eta_s = elapsed_s / (step + 1) * (recipe.drafter_steps - step - 1)
            top1 = " ".join(f"{a:.2f}" for a in agreement)
            log(f"drafter step {step:4d}/{recipe.drafter_steps}  loss {loss.item():.3f}  "
                f"top-1 agreement per step [{top1}]  {elapsed_s:.0f}s elapsed, ~{eta_s:.0f}s left")

    out_dir = work_dir / "drafter"
    build = staging_dir(out_dir)
    drafter.save_pretrained(build)
    replace_dir(build, out_dir)
    log(f"drafter saved to {out_dir} ({(time.time() - started) / 60:.1f} min of training)")


# ----------------------------------------------------------------- stage 3: measure + install
def report(recipe: Recipe, work_dir: Path, assets_dir: Path, timings_min: dict[str, float]) -> None:
    import tokenizers
    import transformers

    from specfit.assets import quality

    target_dir, drafter_dir = work_dir / "target", work_dir / "drafter"
    measurements = quality.measure(target_dir, drafter_dir, recipe.seed, recipe.math_train_problems,
                                   recipe.math_eval_problems, log=log)
    measurements["training_minutes"] = timings_min
    measurements["built_with"] = {"python": platform.python_version(), "torch": torch.__version__,
                                  "transformers": transformers.__version__, "tokenizers": tokenizers.__version__}
    measurements["recipe"] = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(recipe).items()}

    for name, source in (("tiny-moe", target_dir), ("tiny-moe-eagle3", drafter_dir)):
        build = staging_dir(assets_dir / name)
        for path in source.iterdir():
            shutil.copy2(path, build / path.name)
        replace_dir(build, assets_dir / name)
    tmp = assets_dir / ".measurements.json.tmp"
    tmp.write_text(json.dumps(measurements, indent=2) + "\n")
    os.replace(tmp, assets_dir / "measurements.json")
    tmp = assets_dir / ".README.md.tmp"
    tmp.write_text(quality.model_card(measurements))
    os.replace(tmp, assets_dir / "README.md")
    log(f"assets installed in {assets_dir}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", choices=("all", "target", "drafter", "report"), default="all")
    parser.add_argument("--work-dir", type=Path, default=REPO / "build" / "tiny-moe")
    parser.add_argument("--assets-dir", type=Path, default=REPO / "specfit" / "assets")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 when sharing the machine)")
    parser.add_argument("--seed", type=int, default=Recipe.seed)
    parser.add_argument("--target-steps", type=int, default=Recipe.target_steps, help="optimizer steps (smoke tests: a few)")
    parser.add_argument("--drafter-steps", type=int, default=Recipe.drafter_steps, help="optimizer steps (smoke tests: a few)")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    recipe = Recipe(seed=args.seed, target_steps=args.target_steps, drafter_steps=args.drafter_steps)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    (args.work_dir / "recipe.json").write_text(json.dumps(asdict(recipe), indent=2) + "\n")
    timings_path = args.work_dir / "timings.json"
    timings_min = json.loads(timings_path.read_text()) if timings_path.is_file() else {}
    stages = {"target": train_target, "drafter": train_drafter}
    for name, run in stages.items():
        if args.stage in ("all", name):
            started = time.time()
            run(recipe, args.work_dir)
            timings_min[name] = round((time.time() - started) / 60, 1)
            timings_path.write_text(json.dumps(timings_min, indent=2) + "\n")
    if args.stage in ("all", "report"):
        report(recipe, args.work_dir, args.assets_dir, timings_min)


if __name__ == "__main__":
    main()
