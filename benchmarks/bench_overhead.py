"""Benchmark: the live decoder's time outside the model passes, this checkout against another
revision, in alternating fresh processes.

What a cycle spends outside the drafter's and the target's passes is SpecFit's search and the
decoder's bookkeeping (expert predictions, trees and views, acceptance, KV compaction, learning,
the online cost model, the cycle's accounting). Measured as

    1 - (drafter passes + target passes) / decode time

over every prompt of a run, it does not depend on where a revision draws the boundary between
cycles (before stop 25 the accounting between two cycles was in none of them). Each pair runs
``bench_decode.py`` of the baseline (a git worktree of ``--baseline``) and of this checkout, one
after the other, the order alternating; the table has every run and the medians per arm. By
default the runs write no files (``--json``), as ``bench_decode.py`` measures issue 13's goal;
``--with-files`` runs them with ``--out``, as ``specfit decode --out`` runs, where each cycle's row
is built and journaled as it completes (and a baseline too old for ``--json`` can be read).

    python benchmarks/bench_overhead.py --baseline 11bb2da [--pairs 3] [--busy 0] [--with-files]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from specfit.runtime.run_dir import read_decode_cycles  # noqa: E402


def outside_models(run_dir: Path) -> dict[str, tuple[float, float]]:
    """Per policy of a ``bench_decode.py --out`` directory: (share of the decode time outside the
    model passes, decode tokens/s)."""
    import pandas as pd

    cycles = read_decode_cycles(run_dir)
    records = pd.read_json(run_dir / "decode.jsonl", lines=True)
    out = {}
    for policy, rows in records.groupby("policy", sort=False):
        c = cycles[cycles["policy"] == policy]
        decode_s = float(rows["decode_time_s"].sum())
        models_s = float((c["drafter_time_s"] + c["target_time_s"]).sum())
        out[policy] = (1.0 - models_s / decode_s, float(rows["decode_tokens"].sum()) / decode_s)
    return out


def from_json(stdout: str) -> dict[str, tuple[float, float]]:
    """The same per policy from ``bench_decode.py --json``'s rows (printed after its progress lines)."""
    rows = json.loads(stdout[stdout.index("\n[") + 1:] if not stdout.startswith("[") else stdout)
    return {r["policy"]: (float(r["share_outside_models"]), float(r["tokens_per_s"])) for r in rows}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="git revision to compare with (a worktree is made)")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--busy", type=int, default=0, help="CPU-bound processes beside every run")
    parser.add_argument("--policies", default="ar,eagle3,specfit")
    parser.add_argument("--with-files", action="store_true",
                        help="run with --out (rows and journal built as each cycle completes); default: no files")
    args = parser.parse_args(argv)
    if args.pairs < 1:
        raise SystemExit(f"bench_overhead: --pairs: expected >= 1, got {args.pairs}")
    work = Path(tempfile.mkdtemp(prefix="bench_overhead."))
    baseline = work / "baseline"
    made = subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(baseline), args.baseline],
                          capture_output=True, text=True)
    if made.returncode != 0:
        raise SystemExit(f"bench_overhead: --baseline {args.baseline}: {made.stderr.strip()}")
    trees = {"baseline": baseline, "this": REPO}
    policies = args.policies.split(",")
    shares = {arm: {p: [] for p in policies} for arm in trees}
    table = Table(title=f"share of the decode time outside the model passes (tokens/s), {args.busy} CPU-bound "
                        f"process(es) beside, {'with --out' if args.with_files else 'no files'}; "
                        f"baseline {args.baseline}")
    for name in ("pair", "arm", *policies):
        table.add_column(name, justify="left" if name in ("pair", "arm") else "right")
    try:
        for pair in range(args.pairs):
            order = list(trees) if pair % 2 == 0 else list(trees)[::-1]
            for arm in order:
                out = work / f"{arm}-{pair}"
                output = ["--out", str(out)] if args.with_files else ["--json"]
                run = subprocess.run([sys.executable, str(trees[arm] / "benchmarks" / "bench_decode.py"), "--policies",
                                      args.policies, "--busy", str(args.busy), *output],
                                     capture_output=True, text=True, cwd=trees[arm])
                if run.returncode != 0:
                    raise SystemExit(f"bench_overhead: the {arm} run failed:\n{run.stderr[-2000:]}")
                measured = outside_models(out) if args.with_files else from_json(run.stdout)
                for p in policies:
                    shares[arm][p].append(measured[p][0])
                table.add_row(str(pair + 1), arm, *(f"{measured[p][0]:.1%} ({measured[p][1]:.0f})" for p in policies))
                print(f"pair {pair + 1} {arm}: " + ", ".join(f"{p} {measured[p][0]:.1%}" for p in policies), flush=True)
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(baseline)], capture_output=True)
    for arm in trees:
        table.add_row("median", arm, *(f"{np.median(shares[arm][p]):.1%}" for p in policies))
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
