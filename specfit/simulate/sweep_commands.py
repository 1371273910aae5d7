"""``specfit sweep`` (a what-if grid on Ray) and ``specfit plan`` (the best setting for a
device-memory budget)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from ..console import speedup_text
from ..errors import INTERRUPTS, Interrupted, SpecFitError, comma_list, stopped, stopped_by
from ..io import strict_dumps
from ..runtime.prefill import PREFILL_CHUNK

# the settings a table may show for a cell (column: header); those the grid varies are shown
_SETTING_COLUMNS = {"trace": "trace", "profile": "profile", "cache_mode": "cache mode", "cache_policy": "eviction",
                    "cache_experts": "cache", "policy": "policy", "predictor": "predictor", "acceptance": "acceptance",
                    "max_levels": "max levels", "price_uncertainty": "priced"}


def register(app: typer.Typer, traces_app: typer.Typer) -> None:
    app.command("sweep")(sweep_command)
    app.command("plan")(plan_command)


def sweep_command(
    ctx: typer.Context,
    spec: Path = typer.Argument(..., metavar="SPEC",
                                help="Sweep spec (.toml, .yaml): traces, profiles, --h2d-scale values, cache sizes and "
                                     "modes, policies, predictors, drafter presets (see simulate/)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Dataset directory (default: runs/<spec name>); "
                                       "rerunning into it skips the cells already there."),
    address: Optional[str] = typer.Option(None, "--address", help="Join this Ray cluster (e.g. auto or "
                                          "HOST:6379) instead of starting Ray on this machine."),
    num_cpus: Optional[int] = typer.Option(None, "--num-cpus", help="CPUs of the local Ray instance "
                                           "(default: this machine's cores)."),
    chunk_cells: Optional[int] = typer.Option(None, "--chunk-cells", help="Cells per Ray task (default: "
                                              "sized from the grid and the workers)."),
    top: int = typer.Option(10, "--top", help="Best cells to list at the end."),
    as_json: bool = typer.Option(False, "--json", help="Print only a JSON list of the rows (one per cell: the "
                                 "columns of `simulate --json` plus the cell's parameters) on stdout."),
) -> None:
    """Run a grid of replays as Ray tasks into one resumable Parquet dataset."""
    from ..runinfo import check_run_dir
    from .dataset import read_results
    from .distributed import execute, require_ray
    from .grid import load_spec

    try:
        for option, value in (("--num-cpus", num_cpus), ("--chunk-cells", chunk_cells), ("--top", top)):
            if value is not None and value < 1:
                raise SpecFitError(f"{option}: expected a positive number, got {value}")
        require_ray()
        parsed = load_spec(spec)
        out_dir = check_run_dir(out or Path("runs") / spec.stem, "sweep")
        run = execute(parsed, out_dir, address, num_cpus, chunk_cells, show_progress=not as_json, ctx=ctx)
        results = read_results(out_dir)
    except Interrupted as exc:
        stopped(str(exc))
    except INTERRUPTS as exc:                 # starting or stopping Ray, reading the results
        _stopped_outside_the_grid(exc, out or Path("runs") / spec.stem)
    if as_json:
        typer.echo(json.dumps(json.loads(results.to_json(orient="records")), indent=2))
        return
    _print_sweep(results, run, out_dir, top)


def _stopped_outside_the_grid(exc: BaseException, out_dir: Path | None) -> None:
    """A Ctrl-C outside the grid's run (which says itself how many cells it kept): every cell
    finished before it is in the dataset, written whole. ``out_dir`` None: a plan stopped before it
    knew its directory (the default is named after the traces' model)."""
    from .dataset import SWEEP_FILE

    if out_dir is None or not (Path(out_dir) / SWEEP_FILE).is_file():
        # stopped while Ray started or a plan synthesised its traces: no grid was recorded yet
        stopped_by(exc, "interrupted before the sweep's first cell: nothing was kept; the same command starts again")
    stopped_by(exc, f"interrupted: the dataset in {out_dir} keeps every cell finished before it; the same command "
                    "resumes from there")


def _print_sweep(results, run, out_dir: Path, top: int) -> None:
    import pandas as pd
    from rich.markup import escape
    from rich.table import Table

    from ..console import table_console
    from ..console import print_table
    from .dataset import LAYER_AHEAD_COLUMNS, LAYER_AHEAD_ROWS, layer_ahead_wide

    console = table_console()
    # a setting's cells that differ only in the layer-ahead what-if: one row, each recount a column
    results, ahead = layer_ahead_wide(results)
    best = results.sort_values("tokens_per_s", ascending=False, kind="stable").head(top)
    shown = [c for c in _SETTING_COLUMNS if c in ("policy", "cache_experts") or results[c].astype(str).nunique() > 1]
    fixed = {_SETTING_COLUMNS[c]: results[c].iloc[0] for c in _SETTING_COLUMNS if c not in shown}
    what = LAYER_AHEAD_ROWS if ahead else "cells"
    table = Table(title=f"best {len(best)} of {len(results)} {what} by tokens/s",
                  caption=escape(", ".join(f"{k} {v}" for k, v in fixed.items())))
    for col in shown:
        table.add_column(_SETTING_COLUMNS[col], justify="right" if col in ("cache_experts", "max_levels") else "left",
                         no_wrap=True)
    for col in ("link GB/s", "tokens/s", "vs ar", "hit rate", "nodes", *ahead):
        table.add_column(col, justify="right", no_wrap=True)
    for _, row in best.iterrows():
        la = ("–" if pd.isna(row[c]) else f"{row[c]:.2f}" for c in ahead)
        table.add_row(*(escape(str(row[c])) for c in shown), f"{row['link_gbps']:.4g}", f"{row['tokens_per_s']:.2f}",
                      speedup_text(row["speedup_vs_ar"], "–"), f"{row['hit_rate']:.2f}", f"{row['nodes_per_cycle']:.1f}",
                      *la)
    print_table(console, table)
    if ahead:
        console.print(LAYER_AHEAD_COLUMNS, markup=False, highlight=False)
    rate = f", {run.computed / run.wall_s:.1f} cells/s on {run.workers} workers" if run.computed and run.wall_s else ""
    console.print(f"{run.computed} cells replayed now, {run.skipped} already in the dataset{rate}; "
                  f"rows in {out_dir}/results/ (Parquet), render with `specfit report {out_dir}`", markup=False,
                  highlight=False)


def plan_command(
    ctx: typer.Context,
    device_memory_gb: float = typer.Option(..., "--device-memory-gb", help="Device memory for the model, its KV "
                                           "cache, the expert cache and staging, the drafter, the passes' "
                                           "workspace and --reserve-gb (GB = 1e9 bytes)."),
    model_shape: Optional[str] = typer.Option(None, "--model-shape", help="Model shape for the memory model "
                                              "(qwen3-30b-a3b, olmoe-1b-7b, mixtral-8x7b) or a config.json; "
                                              "default: the trace's model."),
    traces: list[Path] = typer.Option([], "--trace", help="Position-indexed trace(s) of your workloads; repeat "
                                      "for several. Without one, traces of --model-shape are synthesised."),
    workloads: str = typer.Option("chat", "--workload", help="Comma-separated drafter presets to synthesise "
                                  "traces for when no --trace is given: chat, math, code."),
    tokens: int = typer.Option(128, "--tokens", help="Positions per synthesised trace."),
    profile: str = typer.Option("pcie5", "--profile", help="Preset (pcie4, pcie5, gh200) or profile JSON."),
    h2d_scale: float = typer.Option(1.0, "--h2d-scale", help="What-if: multiply the host-to-device bandwidth "
                                    "(a copy's fixed latency, the intercept of the profile's H2D fit, is kept)."),
    rescale: bool = typer.Option(False, "--rescale", help="Allow a profile measured for another model shape."),
    context_tokens: int = typer.Option(4096, "--context-tokens", help="KV-cache length to reserve (tokens): "
                                       "the prompt and what is generated."),
    prompt_tokens: Optional[int] = typer.Option(None, "--prompt-tokens", help="Longest prompt to plan for "
                                                "(tokens; default: --context-tokens): each of its passes holds "
                                                "attention scores heads x --prefill-chunk x prompt."),
    prefill_chunk: int = typer.Option(PREFILL_CHUNK, "--prefill-chunk", help="The chunk `specfit decode "
                                      "--prefill-chunk` runs the prompt in (the same default): plan sizes the "
                                      "prompt's passes with it; 0: one pass over the whole prompt."),
    reserve_gb: float = typer.Option(1.0, "--reserve-gb", help="Device memory kept for what the estimate leaves "
                                     "out: the CUDA context, the caching allocator's rounding, the MLP blocks' "
                                     "activations (GB)."),
    dtype: str = typer.Option("bfloat16", "--dtype", help="Weight and KV-cache dtype: bfloat16, float16, float32."),
    policies: Optional[str] = typer.Option(None, "--policies", help="Candidate policies (comma-separated, e.g. "
                                           "ar,chain:2 or static:4,eagle3:16:4,specfit:6); default: AR, chains, "
                                           "fixed and EAGLE-3 trees of several widths and depths, specfit."),
    cache_steps: int = typer.Option(4, "--cache-steps", help="Expert-cache sizes to try between none and "
                                    "the most the budget holds."),
    predictor: str = typer.Option("oracle", "--predictor", help="Expert predictor the policies decide with."),
    out: Optional[Path] = typer.Option(None, "--out", help="Sweep directory (default: runs/plan-<model>-<G>gb)."),
    address: Optional[str] = typer.Option(None, "--address", help="Join this Ray cluster."),
    num_cpus: Optional[int] = typer.Option(None, "--num-cpus", help="CPUs of the local Ray instance."),
    top: int = typer.Option(5, "--top", help="Runner-up settings to list (0: the recommendation alone)."),
    as_json: bool = typer.Option(False, "--json", help="Print only the recommendation and runners-up as JSON."),
) -> None:
    """Turn a device-memory budget into candidate settings, replay them as a sweep, print the best."""
    from .distributed import require_ray
    from .plan import MemoryBudget, run_plan

    resolved = []              # the sweep directory, once run_plan knows it (the default is named after the model)
    try:
        if top < 0:                          # 0: the recommendation alone
            raise SpecFitError(f"--top: expected a number of runners-up >= 0, got {top}")
        require_ray()
        budget = MemoryBudget(device_bytes=device_memory_gb * 1e9, context_tokens=context_tokens,
                              reserve_bytes=reserve_gb * 1e9, dtype=dtype, prompt_tokens=prompt_tokens,
                              prefill_chunk=prefill_chunk)
        result = run_plan(budget, model_shape=model_shape, traces=list(traces),
                          workloads=comma_list(workloads, "--workload", "workload"), tokens=tokens,
                          profile=profile, h2d_scale=h2d_scale, rescale=rescale, policies=policies,
                          cache_steps=cache_steps, predictor=predictor, out_dir=out, address=address,
                          num_cpus=num_cpus, show_progress=not as_json, ctx=ctx,
                          on_out_dir=resolved.append)
    except Interrupted as exc:
        stopped(str(exc))
    except INTERRUPTS as exc:                 # starting Ray, synthesising traces, ranking
        _stopped_outside_the_grid(exc, resolved[0] if resolved else None)
    if as_json:
        typer.echo(strict_dumps(result.to_dict(top), indent=2))
        return
    _print_plan(result, top)


def _print_plan(result, top: int) -> None:
    from rich.markup import escape
    from rich.table import Table

    from ..console import table_console
    from ..console import print_table

    console = table_console()
    mem = result.memory
    # the terms of the table's device GB: a row adds its tree's KV entries, its expert cache,
    # while not every expert is cached the staging buffers, and for a policy that drafts the
    # drafter and the larger workspace of its passes
    console.print(f"[bold]{escape(mem.model)}[/bold] in {mem.budget.device_bytes / 1e9:g} GB: dense weights "
                  f"{mem.dense_bytes / 1e9:.2f} GB, KV cache ({mem.budget.context_tokens} tokens) "
                  f"{mem.kv_bytes(0) / 1e9:.2f} GB + {(mem.kv_bytes(1) - mem.kv_bytes(0)) / 1e6:.3f} MB per tree token, "
                  f"staging {mem.staging_bytes(0) / 1e9:.3f} GB while not every expert is cached, "
                  f"workspace (the prompt's largest pass: {mem.prompt_chunk} tokens over a "
                  f"{mem.budget.longest_prompt}-token prompt from --prefill-chunk and --prompt-tokens) "
                  f"{mem.prompt_pass_bytes / 1e9:.2f} GB, for a policy that drafts the drafter (a stand-in EAGLE-3 "
                  f"head and its KV cache) {mem.drafter_bytes(2) / 1e9:.2f} GB and the workspace of its passes where "
                  f"larger (workspace GB), reserve (the CUDA context and allocator rounding) "
                  f"{mem.budget.reserve_bytes / 1e9:.2f} GB; "
                  f"one cached expert per layer {mem.slot_bytes / 1e9:.3f} GB; cached experts per layer tried: "
                  f"{', '.join(map(str, result.cache_sizes))}")
    table = Table(title=escape(f"best settings on {', '.join(result.traces)} ({result.profile})"))
    for col in ("", "policy", "cache/layer", "tokens/s", "vs ar", "tree tokens", "device GB", "expert cache GB",
                "workspace GB"):
        table.add_column(col, justify="left" if col in ("", "policy") else "right", no_wrap=True)
    for i, row in enumerate(result.ranked.head(top + 1).itertuples()):
        policy = f"{row.policy} *" if row.deeper_than_traces else row.policy
        table.add_row("best" if i == 0 else f"#{i + 1}", policy, str(row.cache_experts), f"{row.tokens_per_s:.2f}",
                      speedup_text(row.speedup_vs_ar, "–"), str(row.tree_tokens), f"{row.device_bytes / 1e9:.2f}",
                      f"{row.expert_cache_bytes / 1e9:.2f}", f"{row.workspace_bytes / 1e9:.2f}")
    print_table(console, table)
    if result.ranked.head(top + 1)["deeper_than_traces"].any():
        console.print("* drafts more levels than the traces' trees hold: its figures are those of the levels they hold "
                      "(the note above)")
    best = result.best
    console.print(f"recommended: [bold]{best['policy']}[/bold] with {best['cache_experts']} cached experts per layer: "
                  f"{best['tokens_per_s']:.2f} tokens/s predicted, {best['device_bytes'] / 1e9:.2f} GB of device memory "
                  f"({result.cells} cells in {escape(str(result.out_dir))}/)")
