"""What loading costs before the first token: the target and the EAGLE-3 drafter, in fresh
processes, this checkout side by side with a baseline revision (a git worktree of ``--baseline``).

    python benchmarks/bench_load.py --baseline REV [--runs 3] [--head llama-8b|tiny] [--trace PATH]

Rows, each the median of ``--runs`` fresh processes run alternately (baseline, this checkout):

- ``load_model`` of the bundled tiny target: seconds after the imports, and whether it imported
  ``torch._dynamo`` (the meta-device build of an embedding used to);
- ``Eagle3Drafter.from_pretrained`` of a drafter head written once by the benchmark (``--head
  llama-8b``: the shape of an EAGLE-3 head for Llama-3.1-8B, bfloat16, 0.85 GB, the target's
  embedding shared; ``tiny``: the bundled drafter): seconds and peak RSS growth over the call;
- ``specfit decode`` of the bundled model and drafter, ``--policy specfit``, 8 prompts x 16 tokens,
  end to end (the command's wall time: imports, loads, warm-up, decode);
- with ``--trace``, ``read_trace`` of that trace (what ``specfit simulate`` and ``sweep`` start
  with): seconds, peak RSS growth over the call, and the trace's arrays in memory; and
  ``specfit traces inspect`` of it, end to end (the command's wall time).

Everything is written to a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

TARGET = """
import json, sys, time
from specfit.runtime.loader import load_model
from specfit.assets import tiny_moe_dir
t = time.perf_counter()
load_model(tiny_moe_dir())
print(json.dumps({"s": time.perf_counter() - t, "dynamo": "torch._dynamo" in sys.modules}))
"""

# the peak is the process's VmHWM: ru_maxrss would carry over the benchmark's own peak into a
# child it forks (Linux keeps it across exec)
PEAK = """
def peak_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
"""

TRACE = PEAK + """
import json, sys, time
import numpy as np
from specfit.traces.format import read_trace
base = peak_mb()
t = time.perf_counter()
trace = read_trace(sys.argv[1])
s = time.perf_counter() - t
arrays = sum(v.nbytes for v in vars(trace).values() if isinstance(v, np.ndarray))
print(json.dumps({"s": s, "peak_mb": peak_mb() - base, "arrays_mb": arrays / 2**20}))
"""

DRAFTER = PEAK + """
import json, sys, time, warnings
import torch
from specfit.runtime.eagle3 import Eagle3Drafter
warnings.simplefilter("ignore")
head, vocab, hidden = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
embed = torch.ones(vocab, hidden, dtype=torch.bfloat16)
base = peak_mb()
t = time.perf_counter()
Eagle3Drafter.from_pretrained(head, target_embed=embed, dtype=torch.bfloat16)
s = time.perf_counter() - t
print(json.dumps({"s": s, "peak_mb": peak_mb() - base}))
"""

# an EAGLE-3 head for Llama-3.1-8B (the published yuhuili/EAGLE3-LLaMA3.1-Instruct-8B shape)
LLAMA_8B_HEAD = {
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
    "hidden_size": 4096, "target_hidden_size": 4096, "vocab_size": 128256, "draft_vocab_size": 32000,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336,
    "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 2048,
    "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "eagle_aux_hidden_state_layer_ids": [1, 16, 29],
}


def write_head(folder: Path, shape: dict = LLAMA_8B_HEAD) -> None:
    """A random bfloat16 drafter of ``shape`` (a config.json), without an embedding, its draft
    vocabulary every fourth target id."""
    import torch
    from safetensors.torch import save_file

    from specfit.runtime.eagle3_checkpoint import _expected_shapes
    from specfit.runtime.eagle3_config import Eagle3Config

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(shape))
    config = Eagle3Config.from_file(folder / "config.json")
    gen = torch.Generator().manual_seed(0)
    tensors = {name: (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
               for name, shape in _expected_shapes(config).items() if name != "embed_tokens.weight"}
    tensors["d2t"] = torch.arange(0, 4 * config.draft_vocab_size, 4) - torch.arange(config.draft_vocab_size)
    tensors["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool)
    tensors["t2d"][tensors["d2t"] + torch.arange(config.draft_vocab_size)] = True
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def run(tree: Path, args: list[str], env: dict) -> dict:
    """``python args`` in ``tree`` (its ``specfit`` first on the path); its last stdout line as JSON."""
    out = subprocess.run([sys.executable, *args], cwd=tree, env={**env, "PYTHONPATH": str(tree)},
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"bench_load: {args[:2]} in {tree} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def command(tree: Path, args: list[str], env: dict) -> float:
    """Seconds ``specfit args`` takes in ``tree``, end to end."""
    import time

    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "specfit", *args], cwd=tree, env={**env, "PYTHONPATH": str(tree)},
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"bench_load: specfit {args[0]} in {tree} failed:\n{out.stderr[-2000:]}")
    return time.perf_counter() - t


def decode(tree: Path, env: dict) -> dict:
    from specfit.assets import demo_prompts_path, tiny_moe_dir, tiny_moe_eagle3_dir

    return {"s": command(tree, ["decode", "--model", str(tiny_moe_dir()), "--drafter", str(tiny_moe_eagle3_dir()),
                                "--prompts", str(demo_prompts_path()), "--cache-experts", "4", "--policy", "specfit",
                                "--max-new-tokens", "16"], env)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="git revision to compare with (a worktree is made)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--head", choices=["llama-8b", "tiny"], default="llama-8b")
    parser.add_argument("--trace", type=Path, help="a trace file to time read_trace on")
    args = parser.parse_args(argv)

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="bench_load.") as tmp:
        tmp = Path(tmp)
        baseline = tmp / "baseline"
        made = subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(baseline), args.baseline],
                              capture_output=True, text=True)
        if made.returncode != 0:
            raise SystemExit(f"bench_load: --baseline {args.baseline}: {made.stderr.strip()}")
        try:
            if args.head == "tiny":
                from specfit.assets import tiny_moe_eagle3_dir
                head, vocab, hidden = tiny_moe_eagle3_dir(), 2048, 128
            else:
                head, vocab, hidden = tmp / "head", LLAMA_8B_HEAD["vocab_size"], LLAMA_8B_HEAD["hidden_size"]
                write_head(head)
            trees = {args.baseline: baseline, "this checkout": REPO}
            for tree in trees.values():          # warm each tree's numba cache and the page cache
                decode(tree, env)
            rows = {name: {"target": [], "dynamo": [], "drafter": [], "peak": [], "decode": [], "trace": []}
                    for name in trees}
            for _ in range(args.runs):
                for name, tree in trees.items():
                    got = run(tree, ["-c", TARGET], env)
                    rows[name]["target"].append(got["s"])
                    rows[name]["dynamo"].append(got["dynamo"])
                    got = run(tree, ["-c", DRAFTER, str(head), str(vocab), str(hidden)], env)
                    rows[name]["drafter"].append(got["s"])
                    rows[name]["peak"].append(got["peak_mb"])
                    rows[name]["decode"].append(decode(tree, env)["s"])
                    if args.trace:
                        got = run(tree, ["-c", TRACE, str(args.trace.resolve())], env)
                        got["inspect_s"] = command(tree, ["traces", "inspect", str(args.trace.resolve())], env)
                        rows[name]["trace"].append(got)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(baseline)], capture_output=True)

    med = statistics.median
    print(f"median of {args.runs} fresh processes each, alternating; drafter head: {args.head}")
    print("| code | load_model (tiny) s | imports torch._dynamo | drafter from_pretrained s | drafter peak RSS +MB "
          "| specfit decode (8 x 16 tokens) s |")
    print("|---|---:|---|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {med(r['target']):.3f} | {'yes' if any(r['dynamo']) else 'no'} | {med(r['drafter']):.2f} "
              f"| {med(r['peak']):.0f} | {med(r['decode']):.2f} |")
    if args.trace:
        print(f"\nread_trace({args.trace.name}): median of {args.runs} fresh processes each, alternating")
        print("| code | seconds | peak RSS +MB | trace arrays MB | `specfit traces inspect` s |")
        print("|---|---:|---:|---:|---:|")
        for name, r in rows.items():
            print(f"| {name} | {med(x['s'] for x in r['trace']):.2f} | {med(x['peak_mb'] for x in r['trace']):.0f} "
                  f"| {med(x['arrays_mb'] for x in r['trace']):.0f} | {med(x['inspect_s'] for x in r['trace']):.2f} |")


if __name__ == "__main__":
    main()
