"""Benchmark: autoregressive decoding of a small random Qwen3-MoE checkpoint on the CPU with the
experts offloaded, for expert caches of 0, half and all experts per layer.

Writes a random safetensors checkpoint (per-expert tensor names, as the hub stores them), then
runs each cache size in a fresh process so that its peak resident memory (RSS) is its own, and
prints, per cache size: decode tokens/s, bytes copied host-to-"device" per decoded token, the
expert cache's hit rate, device bytes held for experts, and peak RSS next to the checkpoint size.

On the CPU the "device" is host memory too, so the expert slots add to RSS: a cache of all
experts holds a second copy of every expert that has been used. Routing of a random model is
close to uniform, so hit rates are a lower bound for real models, whose routing is correlated.

    python benchmarks/bench_runtime.py [--layers 8] [--experts 32] [--new-tokens 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from safetensors.torch import save_file


def write_random_checkpoint(model_dir: Path, layers: int, experts: int, top_k: int, hidden: int,
                            expert_width: int, vocab: int, seed: int = 0) -> int:
    """A Qwen3-MoE directory (config.json + model.safetensors) with random weights; returns its bytes."""
    heads, kv_heads, head_dim = 8, 2, hidden // 8
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": vocab,
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "num_experts": experts,
        "num_experts_per_tok": top_k, "moe_intermediate_size": expert_width, "rms_norm_eps": 1e-6,
        "rope_theta": 1e6, "max_position_embeddings": 4096, "norm_topk_prob": True,
        "tie_word_embeddings": False, "torch_dtype": "float32", "eos_token_id": None,
    }
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(shape, generator=generator) * 0.1

    tensors = {"model.embed_tokens.weight": rand(vocab, hidden), "lm_head.weight": rand(vocab, hidden),
               "model.norm.weight": torch.ones(hidden)}
    for layer in range(layers):
        p = f"model.layers.{layer}."
        tensors.update({
            p + "input_layernorm.weight": torch.ones(hidden), p + "post_attention_layernorm.weight": torch.ones(hidden),
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": torch.ones(head_dim), p + "self_attn.k_norm.weight": torch.ones(head_dim),
            p + "mlp.gate.weight": rand(experts, hidden),
        })
        for expert in range(experts):
            e = f"{p}mlp.experts.{expert}."
            tensors[e + "gate_proj.weight"] = rand(expert_width, hidden)
            tensors[e + "up_proj.weight"] = rand(expert_width, hidden)
            tensors[e + "down_proj.weight"] = rand(hidden, expert_width)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    return (model_dir / "model.safetensors").stat().st_size


def _rss_bytes() -> int:
    """Current resident set size of this process."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux reports KiB


def run_one(model_dir: str, cache_experts: int, prompts: list[list[int]], new_tokens: int, threads: int) -> dict:
    """Load and decode in this (fresh) process; return the measurements."""
    torch.set_num_threads(threads)
    from specfit.runtime.decoder import Decoder
    from specfit.runtime.loader import load_model

    # the first random init on the meta device imports ~70 MB of torch internals, once per
    # process; count them in the baseline, not in the model's footprint
    torch.nn.Embedding(1, 1, device="meta")
    rss_before_load = _rss_bytes()
    start = time.perf_counter()
    model = load_model(model_dir, cache_experts=cache_experts)
    load_time_s = time.perf_counter() - start
    decoder = Decoder(model)
    decoder.generate(prompts[0], 4, ignore_eos=True)      # warm-up: first-call kernel setup
    model.offload.reset()                                 # measure from an empty cache
    decode_tokens = decode_time_s = decode_bytes = hits = misses = 0
    for prompt in prompts:
        result = decoder.generate(prompt, new_tokens, ignore_eos=True)
        decode_tokens += sum(result.cycle_tokens)
        decode_time_s += result.decode_time_s
        decode_bytes += result.decode_bytes_h2d
        hits += result.offload.total_hits
        misses += result.offload.total_misses
    return {
        "cache_experts": cache_experts, "load_time_s": load_time_s,
        "tokens_per_s": decode_tokens / decode_time_s, "bytes_h2d_per_token": decode_bytes / decode_tokens,
        "hit_rate": hits / (hits + misses), "device_expert_bytes": model.offload.device_bytes,
        "host_expert_bytes": model.offload.host.nbytes, "rss_before_load_bytes": rss_before_load,
        "peak_rss_bytes": _peak_rss_bytes(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--expert-width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (1: the tiny kernels do not gain from more, and shared machines lose)")
    args = parser.parse_args()

    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, args.vocab, (args.prompt_tokens,), generator=generator).tolist()
               for _ in range(args.prompts)]
    cache_sizes = (0, args.experts // 2, args.experts)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        checkpoint_bytes = write_random_checkpoint(model_dir, args.layers, args.experts, args.top_k, args.hidden,
                                                   args.expert_width, args.vocab)
        # one fresh process per cache size: ru_maxrss is a per-process high-water mark
        context = multiprocessing.get_context("spawn")
        rows = []
        for cache_experts in cache_sizes:
            with context.Pool(1) as pool:
                rows.append(pool.apply(run_one, (str(model_dir), cache_experts, prompts, args.new_tokens, args.threads)))

    mb = 1e6
    console = Console(width=140)
    console.print(f"python benchmarks/bench_runtime.py --layers {args.layers} --experts {args.experts} --top-k {args.top_k} "
                  f"--hidden {args.hidden} --expert-width {args.expert_width} --vocab {args.vocab} --prompts {args.prompts} "
                  f"--prompt-tokens {args.prompt_tokens} --new-tokens {args.new_tokens} --threads {args.threads}")
    console.print(f"checkpoint {checkpoint_bytes / mb:.0f} MB, {rows[0]['host_expert_bytes'] / mb:.0f} MB of experts")
    table = Table(title="AR decode on CPU, random Qwen3-MoE, experts offloaded")
    for name in ("cache experts/layer", "tokens/s", "MB H2D/token", "hit rate", "device expert MB", "peak RSS MB",
                 "RSS growth MB", "growth / ckpt", "host part / ckpt"):
        table.add_column(name, justify="right")
    for row in rows:
        growth = row["peak_rss_bytes"] - row["rss_before_load_bytes"]
        # on the CPU the "device" slots are host memory too; the rest is what stays on the host
        host_part = growth - row["device_expert_bytes"]
        table.add_row(str(row["cache_experts"]), f"{row['tokens_per_s']:.1f}", f"{row['bytes_h2d_per_token'] / mb:.2f}",
                      f"{row['hit_rate']:.3f}", f"{row['device_expert_bytes'] / mb:.0f}", f"{row['peak_rss_bytes'] / mb:.0f}",
                      f"{growth / mb:.0f}", f"{growth / checkpoint_bytes:.2f}", f"{host_part / checkpoint_bytes:.2f}")
    console.print(table)


if __name__ == "__main__":
    main()
