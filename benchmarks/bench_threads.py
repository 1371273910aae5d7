"""Benchmark: torch's default CPU threads against one thread, with and without a competing process.

On a machine whose cores are shared, torch's intra-op threads (one per core by default) spin-wait
for each other whenever another process takes a core, and every small kernel pays for it. This
runs the two jobs a user runs on the CPU, ``specfit decode`` (the bundled tiny MoE with its EAGLE-3
drafter, ``ar`` and ``specfit``) and ``specfit calibrate --model`` (quick probes), each as a fresh
process, with ``--threads`` set to torch's default (the core count) and to 1, alone and beside one
CPU-bound process (a Python busy loop). The four settings of a job run interleaved, ``--repeat``
rounds, so a change in the machine's load hits them alike; the table gives medians and ratios.

    python benchmarks/bench_threads.py [--repeat 3] [--max-new-tokens 24]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from busy import busy_processes  # noqa: E402
from specfit.assets import demo_prompts_path, tiny_moe_dir, tiny_moe_eagle3_dir  # noqa: E402


def run(argv: list[str], work: Path) -> float:
    """Wall seconds of one ``python -m specfit ...`` process (run in ``work``)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(work / "cache")}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "specfit", *map(str, argv)], check=True, env=env, cwd=work,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def decode_ms_per_cycle(out: Path) -> float:
    summary = json.loads((out / "summary.json").read_text())
    cycles = sum(s["cycles"] for s in summary)
    return 1e3 * sum(s["time_s"] for s in summary) / cycles


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args(argv)
    cores = os.cpu_count() or 1
    work = Path(tempfile.mkdtemp(prefix="bench_threads."))
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(demo_prompts_path().read_text().splitlines(keepends=True)[:2]))
    profile = work / "profile.json"
    run(["calibrate", "--model", tiny_moe_dir(), "--quick", "--threads", "1", "--out", profile], work)

    def decode(threads: int, index: int) -> dict:
        out = work / f"decode-{threads}-{index}"
        seconds = run(["decode", "--model", tiny_moe_dir(), "--drafter", tiny_moe_eagle3_dir(), "--prompts", prompts,
                          "--policies", "ar,specfit", "--cache-experts", "8", "--profile", profile, "--max-new-tokens",
                          str(args.max_new_tokens), "--ignore-eos", "--threads", str(threads), "--out", out], work)
        return {"seconds": seconds, "ms_per_cycle": decode_ms_per_cycle(out)}

    def calibrate(threads: int, index: int) -> dict:
        out = work / f"calibrate-{threads}-{index}.json"
        seconds = run(["calibrate", "--model", tiny_moe_dir(), "--quick", "--threads", str(threads), "--out", out], work)
        return {"seconds": seconds, "holdout_mape": json.loads(out.read_text())["fit"]["holdout"]["mape"]}

    results: dict[tuple[str, int, bool], list[dict]] = {}
    for index in range(args.repeat):
        for job, fn in (("decode", decode), ("calibrate", calibrate)):
            for competing in (False, True):
                for threads in (cores, 1):
                    with busy_processes(1 if competing else 0):
                        results.setdefault((job, threads, competing), []).append(fn(threads, index))

    table = Table(title=f"{cores} cores, {args.repeat} interleaved rounds, medians; load average at the end "
                        f"{os.getloadavg()[0]:.1f}")
    for col in ("job", "competing process", "threads", "wall s", "per cycle ms / held-out MAPE", "vs 1 thread"):
        table.add_column(col, justify="left" if col in ("job",) else "right")
    for (job, threads, competing), rows in results.items():
        wall = statistics.median(r["seconds"] for r in rows)
        one = statistics.median(r["seconds"] for r in results[(job, 1, competing)])
        detail = (f"{statistics.median(r['ms_per_cycle'] for r in rows):.2f} ms" if job == "decode"
                  else f"{statistics.median(r['holdout_mape'] for r in rows):.1%}")
        table.add_row(job, "yes" if competing else "no", str(threads), f"{wall:.1f}", detail, f"{wall / one:.2f}x")
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
