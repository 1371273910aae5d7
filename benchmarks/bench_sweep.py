"""``specfit sweep`` on Ray against the same cells run one after another in one process.

Grid (200 cells): the two sample traces x pcie5 at 0.5/1/2/4x its link speed x 5 expert-cache sizes
x 5 policies (ar, chain:2, eagle3:16:4, static:4, specfit). Both sides replay the same cells with
the same :func:`specfit.simulate.grid.run_cell`; the serial side prepares each trace once, the Ray
side runs the real sweep (:func:`specfit.simulate.distributed.run_grid`: prepare tasks, chunks,
Parquet parts) on one local Ray instance with ``--num-cpus`` CPUs: once with cold workers (they
import specfit on their first task), then ``--repeat`` times with warm ones (as on a running
cluster), each warm run right after a serial run, so that a change in a shared machine's load hits
both sides of a pair. Ray's start-up is timed on its own. Every Ray row must equal the serial one.

Overhead per cell = (wall x workers - replay time) / cells: the worker-seconds a cell held beyond
its replay (:func:`run_cell`'s ``replay_s``, the black box :func:`run_sweep` call), including the
trace preparation, scheduling, serialisation, Parquet writes and idle CPUs at the end. On a shared
machine other processes' CPU use shows up in it too (and in the replay times), so it also reports
the CPU seconds of the driver, Ray's daemons and workers against those of the serial run.
Busy share = replay time / (wall x workers); since cells/s = workers x busy share / mean replay
time, ``workers x busy share / the serial run's busy share`` is the ratio of cells/s the sweep
reaches when its replays run as fast as the serial run's (when other processes leave it its CPUs).

An overhead probe repeats the comparison on 400 cells of a 16-position trace (replays of a few tens
of milliseconds), where the per-cell overhead is not lost in the replays' noise.

Then the interruption check: the 200-cell grid as a ``specfit sweep`` subprocess (its own local
Ray), SIGINT after the first part, rerun, SIGKILL of its process group after more parts, rerun to
the end; every cell must be in the dataset once, every part readable, no temporary file left.

    OMP_NUM_THREADS=1 python benchmarks/bench_sweep.py [--num-cpus 2] [--repeat 3] [--skip-interrupt]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SPEC = """
traces = ["{root}/traces/qwen3-30b-a3b-chat.parquet", "{root}/traces/olmoe-1b-7b-real-routing.parquet"]
profiles = "pcie5"
h2d_scale = [0.5, 1, 2, 4]
cache_experts = [0, 8, 16, 24, 32]
policies = ["ar", "chain:2", "eagle3:16:4", "static:4", "specfit"]
"""
PROBE_SPEC = """
traces = ["{trace}"]
profiles = "pcie5"
h2d_scale = [0.5, 1, 2, 4, 8]
cache_experts = [0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60]
policies = ["ar", "chain:1", "chain:2", "static:2", "eagle3:8:3"]
"""


def tree_cpu_s() -> float:
    """CPU seconds (user + system) used so far by this process and every live descendant (the
    Ray daemons and workers of a local instance), from /proc."""
    stats = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                text = (entry / "stat").read_text()
            except OSError:
                continue
            fields = text[text.rindex(")") + 2:].split()
            stats[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))   # ppid, utime + stime
    children = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0, [os.getpid()]
    while todo:
        pid = todo.pop()
        total += stats.get(pid, (0, 0))[1]
        todo += children.get(pid, [])
    return total / os.sysconf("SC_CLK_TCK")


def grid(path: Path, text: str):
    from specfit.simulate.grid import expand, load_spec

    path.write_text(text)
    spec = load_spec(path)
    return spec, expand(spec)


def serial(spec, cells) -> dict:
    from specfit.simulate.distributed import resolve_inputs
    from specfit.simulate.grid import run_cell
    from specfit.simulate.replay import prepare_trace

    start, cpu_start = time.perf_counter(), time.process_time()
    inputs = resolve_inputs(spec, cells)
    prepared, rows = {}, []
    for cell in cells:
        if cell.prepared_key not in prepared:
            prepared[cell.prepared_key] = prepare_trace(cell.trace, inputs.data[cell.trace], cell.predictor,
                                                        cell.acceptance)
        rows.append(run_cell(prepared[cell.prepared_key], cell, inputs.scenarios[cell.scenario_key]))
    return {"wall_s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu_start, "workers": 1,
            "replay_s": sum(r["replay_s"] for r in rows), "rows": rows}


def on_ray(ray, spec, cells, out: Path) -> dict:
    from specfit.simulate.dataset import read_results
    from specfit.simulate.distributed import resolve_inputs, run_grid

    start, cpu_start = time.perf_counter(), tree_cpu_s()
    run = run_grid(spec, cells, resolve_inputs(spec, cells), out, done=set(), ray=ray)
    return {"wall_s": time.perf_counter() - start, "cpu_s": tree_cpu_s() - cpu_start, "replay_s": run.replay_s,
            "workers": run.workers, "chunks": run.chunks, "rows": read_results(out)}


def same_rows(serial_run: dict, ray_run: dict) -> bool:
    reference = {row["cell_id"]: row["tokens_per_s"] for row in serial_run["rows"]}
    rows = ray_run["rows"]
    return len(rows) == len(reference) and np.array_equal(rows["tokens_per_s"].to_numpy(),
                                                          rows["cell_id"].map(reference).to_numpy())


def table(runs: list[tuple[str, dict]], n: int, pairs: bool = False) -> None:
    """One row per run; "vs serial" and the extra CPU against the first run, or with ``pairs``
    against the serial run just before it."""
    print("| run | wall s | cells/s | vs serial | mean replay ms | overhead ms/cell | busy share | "
          "vs serial at its replay speed | CPU s | extra CPU ms/cell |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for i, (name, r) in enumerate(runs):
        base = runs[i - i % 2][1] if pairs else runs[0][1]
        overhead = (r["wall_s"] * r["workers"] - r["replay_s"]) / n
        print(f"| {name} | {r['wall_s']:.1f} | {n / r['wall_s']:.2f} | {base['wall_s'] / r['wall_s']:.2f}x | "
              f"{r['replay_s'] / n * 1e3:.0f} | {overhead * 1e3:.1f} | {busy(r):.3f} | "
              f"{r['workers'] * busy(r) / busy(base):.2f}x | {r['cpu_s']:.1f} | "
              f"{(r['cpu_s'] - base['cpu_s']) / n * 1e3:.1f} |")


def busy(run: dict) -> float:
    """Share of the workers' wall time spent replaying: cells/s = workers x busy / mean replay."""
    return run["replay_s"] / (run["wall_s"] * run["workers"])


def interrupt_check(spec_path: Path, out: Path, n_cells: int, num_cpus: int) -> list[tuple]:
    from specfit.simulate.dataset import done_cell_ids, part_files, read_results

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "specfit", "sweep", str(spec_path), "--out", str(out), "--num-cpus", str(num_cpus)]

    def start():
        # SIGINT back to its default: a shell's background job inherits it ignored
        return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

    def wait_parts(proc, more_than):
        while proc.poll() is None:
            n = len(part_files(out)) if (out / "results").exists() else 0
            if n > more_than:
                return n
            time.sleep(0.02)
        return len(part_files(out))

    def temporaries():
        return len(list(out.rglob("*.tmp")))

    def stopped(proc, how: str) -> tuple:
        if proc.poll() is not None:      # it ended on its own: say why rather than kill nothing
            raise RuntimeError(f"the sweep exited with {proc.returncode} before {how}: "
                               f"{proc.stderr.read().decode()[-2000:]}")
        return proc

    steps = []
    proc = start()
    wait_parts(proc, 0)
    stopped(proc, "SIGINT").send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    if proc.returncode != 130:
        raise RuntimeError(f"SIGINT: the sweep exited with {proc.returncode}: {err.decode()[-2000:]}")
    steps.append(("SIGINT to the driver", proc.returncode, len(done_cell_ids(out)), temporaries()))
    proc = start()
    wait_parts(proc, len(part_files(out)) + 2)
    os.killpg(stopped(proc, "SIGKILL").pid, signal.SIGKILL)
    proc.wait(timeout=60)
    steps.append(("rerun, then SIGKILL to its process group", proc.returncode, len(done_cell_ids(out)), temporaries()))
    kept = len(done_cell_ids(out))
    t = time.perf_counter()
    proc = start()
    proc.communicate(timeout=1800)
    results = read_results(out)      # raises on a cell in two parts or an unreadable part
    steps.append((f"rerun to the end ({time.perf_counter() - t:.0f} s)", proc.returncode, len(results), temporaries()))
    ok = len(results) == n_cells and results["cell_id"].is_unique and proc.returncode == 0 and not temporaries()
    steps.append(("check", "ok" if ok else "FAILED", f"{kept} kept + {n_cells - kept} replayed = {len(results)}", ""))
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-cpus", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3, help="serial / warm-Ray pairs, interleaved")
    parser.add_argument("--skip-interrupt", action="store_true")
    args = parser.parse_args()
    import ray

    from specfit.simulate.replay import prepare_trace
    from specfit.traces.format import write_trace
    from specfit.traces.synth import synthesize

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tiny = synthesize("olmoe-1b-7b", "chat", 16, seed=0, sequence_tokens=8)
        write_trace(tiny, tmp / "tiny.parquet")
        prepare_trace("warm-up", tiny)        # the serial process imports what a preparation needs first
        spec, cells = grid(tmp / "bench.toml", SPEC.format(root=ROOT))
        probe_spec, probe_cells = grid(tmp / "probe.toml", PROBE_SPEC.format(trace=tmp / "tiny.parquet"))
        n, loads = len(cells), [os.getloadavg()[0]]
        t0 = time.perf_counter()
        ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
        init_s = time.perf_counter() - t0
        pairs, probes = [], []
        try:
            cold = on_ray(ray, spec, cells, tmp / "cold")
            # serial and warm Ray interleaved, so a change in the machine's load hits both sides
            for i in range(args.repeat):
                pairs.append((serial(spec, cells), on_ray(ray, spec, cells, tmp / f"warm{i}")))
                loads.append(os.getloadavg()[0])
            for i in range(args.repeat):
                probes.append((serial(probe_spec, probe_cells), on_ray(ray, probe_spec, probe_cells, tmp / f"probe{i}")))
        finally:
            t1 = time.perf_counter()
            ray.shutdown()
            shutdown_s = time.perf_counter() - t1
        identical = all(same_rows(s, r) for s, r in pairs + probes) and same_rows(pairs[0][0], cold)
        print(f"{n} cells, {cold['workers']} Ray workers, {cold['chunks']} chunks of up to {-(-n // cold['chunks'])} "
              f"cells; Ray start-up {init_s:.1f} s, shutdown {shutdown_s:.1f} s; load average (1 min) "
              f"{', '.join(f'{x:.1f}' for x in loads)}; Ray rows identical to the serial ones: {identical}\n")
        rows = []
        for i, (s, r) in enumerate(pairs):
            rows += [(f"serial, one process (pair {i + 1})", s), (f"Ray, warm workers (pair {i + 1})", r)]
        table(rows, n, pairs=True)
        first = pairs[0][0]
        print()
        table([("serial, one process (pair 1)", first), ("Ray, cold workers (first imports)", cold),
               ("Ray, cold, with start-up", {**cold, "wall_s": cold["wall_s"] + init_s})], n)
        print(f"\noverhead probe: {len(probe_cells)} cells of a 16-position trace, {probes[0][1]['chunks']} chunks\n")
        rows = []
        for i, (s, r) in enumerate(probes):
            rows += [(f"serial (pair {i + 1})", s), (f"Ray, warm (pair {i + 1})", r)]
        table(rows, len(probe_cells), pairs=True)
        for name, got in (("200-cell grid", pairs), ("probe", probes)):
            ratios = sorted(s["wall_s"] / r["wall_s"] for s, r in got)
            print(f"\n{name}: Ray / serial cells/s per pair {', '.join(f'{x:.2f}x' for x in ratios)}, "
                  f"median {np.median(ratios):.2f}x")
        if not args.skip_interrupt:
            print("\n| step | exit code | cells in the dataset | temporary files |")
            print("|---|---|---|---|")
            for step in interrupt_check(tmp / "bench.toml", tmp / "interrupted", n, args.num_cpus):
                print("| " + " | ".join(map(str, step)) + " |")


if __name__ == "__main__":
    main()
