"""Benchmark: the live drafter's bookkeeping per drafted level, this checkout against another
revision, side by side in one process.

A dynamic tree's level is one drafter pass plus the work around it: the top-k of the pass's
logits, the new nodes' arrays, their path probabilities, the next frontier, its attention mask and
hidden inputs (:class:`specfit.runtime.drafting.TreeDraft`). This times ``grow()`` minus the
drafter's passes, on the bundled model and EAGLE-3 drafter after a prefill, for trees of 7 levels
(top-4), the two revisions' ``TreeDraft`` drafting alternately from the same session, one thread.
The baseline's ``specfit/runtime/drafting.py`` is read with ``git show`` and imported under
another name (it must import the same helpers as this checkout's).

    python benchmarks/bench_draft_level.py --baseline 190e557 [--trees 300] [--busy 1]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from busy import busy_processes
from revision import module_at

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LEVELS, TOP_K = 7, 4


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="git revision whose TreeDraft to compare with")
    parser.add_argument("--trees", type=int, default=300, help="trees drafted by each revision")
    parser.add_argument("--busy", type=int, default=0, help="CPU-bound processes beside the benchmark")
    args = parser.parse_args(argv)

    from specfit.threads import set_cpu_threads

    set_cpu_threads(1)
    from specfit.assets import tiny_moe_dir, tiny_moe_eagle3_dir
    from specfit.costmodel import CostModel
    from specfit.kernel_warmup import warm_up
    from specfit.policies import make_policy
    from specfit.runtime.decoder import Decoder
    from specfit.runtime.drafting import Proposer, TreeDraft
    from specfit.runtime.eagle3 import Eagle3Config, Eagle3Drafter
    from specfit.runtime.loader import load_model

    baseline = module_at(args.baseline, "specfit/runtime/drafting.py", "drafting_baseline", "bench_draft_level")
    arms = {"baseline": baseline.TreeDraft, "this": TreeDraft}
    warm_up()
    config = Eagle3Config.from_file(tiny_moe_eagle3_dir() / "config.json")
    model = load_model(tiny_moe_dir(), cache_experts=4, capture_layers=config.aux_hidden_state_layer_ids)
    drafter = Eagle3Drafter.from_pretrained(tiny_moe_eagle3_dir(), target_embed=model.embed_tokens.weight)
    cost = CostModel(base_s=5e-3, per_node_s=1e-4, hit_s=1e-5, miss_s=1e-4, draft_level_s=1e-3)
    decoder = Decoder(model, Proposer(drafter, TOP_K), make_policy(f"eagle3:16:{TOP_K}"), cost)
    model.setup_kv_cache(256)
    root, _ = decoder.prefill(list(range(5, 45)), 64)
    session = decoder.proposer.session
    root_output = decoder.proposer._sync()

    passes_s = [0.0]
    forward = drafter.forward

    def timed(*a, **k):
        start = time.perf_counter()
        out = forward(*a, **k)
        passes_s[0] += time.perf_counter() - start
        return out

    drafter.forward = timed
    times = {arm: [] for arm in arms}
    with busy_processes(args.busy):
        for trial in range(args.trees):
            order = list(arms) if trial % 2 == 0 else list(arms)[::-1]
            for arm in order:
                tree = arms[arm](session, root, lambda: root_output, TOP_K, LEVELS + 1)
                per_level = []
                for _ in range(LEVELS):
                    before, start = passes_s[0], time.perf_counter()
                    tree.grow()
                    per_level.append(time.perf_counter() - start - (passes_s[0] - before))
                times[arm].append(per_level)
    table = Table(title=f"drafter bookkeeping per level (us, median over {args.trees} trees; grow() minus the "
                        f"drafter's passes), {args.busy} CPU-bound process(es) beside")
    for name in ("arm", *(f"level {i + 1}" for i in range(LEVELS)), "tree (7 levels)"):
        table.add_column(name, justify="left" if name == "arm" else "right")
    for arm, rows in times.items():
        a = 1e6 * np.array(rows)
        table.add_row(f"{arm}" + (f" ({args.baseline})" if arm == "baseline" else ""),
                      *(f"{x:.0f}" for x in np.median(a, axis=0)), f"{np.median(a.sum(axis=1)):.0f}")
    ratio = np.array(times["this"]).sum(axis=1) / np.array(times["baseline"]).sum(axis=1)
    console = Console(width=160)
    console.print(table)
    console.print(f"this / baseline per tree, drafted side by side: median {np.median(ratio):.3f} "
                  f"(quartiles {np.quantile(ratio, 0.25):.3f} - {np.quantile(ratio, 0.75):.3f})")


if __name__ == "__main__":
    main()
