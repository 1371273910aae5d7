"""``specfit simulate``: replay traces through policies, cache sizes and hardware profiles."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from ..console import speedup_text
from ..experts.cache import cache_mode_name
from ..errors import INTERRUPTS, Interrupted, SpecFitError, comma_list, stopped, stopped_by
from ..io import repeated_path
from ..runinfo import check_run_dir
from ..policies import DEFAULT_POLICIES, POLICY_HELP, is_tuned


# what `simulate --out` writes (and run.json)
SIMULATE_FILES = ("cycles.parquet", "cycles.csv", "summary.parquet", "summary.csv")


def register(app: typer.Typer, traces_app: typer.Typer) -> None:
    app.command("simulate")(simulate_command)


# what --layer-ahead's prefetchers copy, for the summary's note
LAYER_AHEAD_WORDS = {"ceiling": "the true misses, the ceiling of any next-layer prefetcher",
                     "transition": "ranked by a next-layer transition table fitted on other sequences (a lone "
                                   "sequence: on its other half)",
                     "eam": "MoE-Infinity's matching of the request's expert activation matrix to other sequences' "
                            "(a lone sequence: to its other half's)"}


def _split(values: list[str] | None, option: str, what: str) -> list[str]:
    """The entries of a repeatable comma-separated option (:func:`~specfit.errors.comma_list`)."""
    return [entry for item in (values or []) for entry in comma_list(item, option, what)]


def simulate_command(
    ctx: typer.Context,
    traces: list[Path] = typer.Option(..., "--trace", help="Position-indexed trace file; repeat for several."),
    profiles: list[str] = typer.Option(["pcie4"], "--profile", help="Preset (pcie4, pcie5, gh200) or profile JSON; "
                                       "repeat or comma-separate for several."),
    # defaults and examples as words the help's column can wrap (80 columns cut a long token short)
    policies: str = typer.Option(",".join(DEFAULT_POLICIES), "--policies", help=f"Comma-separated: {POLICY_HELP}.",
                                 show_default=", ".join(DEFAULT_POLICIES)),
    cache_experts: str = typer.Option("0,16,32", "--cache-experts", help="Comma-separated cache sizes (experts per "
                                      "layer, or in total with --cache-mode global)."),
    predictor: str = typer.Option("oracle", "--predictor", help="Expert predictor the policies decide with: oracle, "
                                  "affinity, learned, parent, recorded (fitted ones are cross-fitted on other sequences), "
                                  "router (the target's routers; needs --model), noisy:P (the true experts with "
                                  "each slot wrong with probability 1-P: the precision a predictor would need)."),
    model: Optional[Path] = typer.Option(None, "--model", help="The traced model's directory, for --predictor router."),
    acceptance: str = typer.Option("calibrated", "--acceptance", help="Path probabilities the policies use: "
                                   "calibrated (the acceptance calibrator, "
                                   "cross-fitted) or raw (the drafter's)."),
    cost: Optional[str] = typer.Option(None, "--cost", help="Override cost-model parameters: name=seconds, several comma-separated, e.g. "
                                      "base_s=0.004 or miss_s=2e-4."),
    h2d_scale: float = typer.Option(1.0, "--h2d-scale", help="What-if: multiply the host-to-device bandwidth "
                                    "(a copy's fixed latency, the intercept of the profile's H2D fit, is kept)."),
    rescale: bool = typer.Option(False, "--rescale", help="Allow a profile measured for another model shape "
                                 "(transfer costs scaled by expert bytes)."),
    cache_mode: str = typer.Option("per_layer", "--cache-mode", callback=cache_mode_name,
                                    help="per_layer (or per-layer) or global."),
    cache_policy: str = typer.Option("lru", "--cache-policy", help="Eviction: lru, lfu, fifo or moe-infinity "
                                     "(MoE-Infinity's: the fewest fetches in the request, kept across evictions)."),
    max_levels: int = typer.Option(8, "--max-levels", help="Draft levels at most for specfit, static:N and sequoia:N (specfit:D and sequoia:N:D set their own D)."),
    price_uncertainty: bool = typer.Option(True, "--price-uncertainty/--no-price-uncertainty",
                                           help="specfit prices, per draft node, the experts its predictor gets "
                                                "wrong (from the predictor's precision on the trace).",
                                           show_default="on"),
    layer_ahead: str = typer.Option("none", "--layer-ahead", help="What-if: recount each replay with copies of the "
                                    "next layer's experts made while a layer computes, in link time the pass leaves "
                                    "idle: ceiling (the true misses), transition (a next-layer table), eam "
                                    "(MoE-Infinity's activation-matrix matching); both fitted on other sequences (a "
                                    "lone sequence: on its other half). "
                                    "Policies with cache levers are not recounted."),
    out: Optional[Path] = typer.Option(None, "--out", help="Directory for cycles/summary as Parquet and CSV."),
    as_json: bool = typer.Option(False, "--json", help="Print only a JSON list (one object per trace, profile, "
                                 "cache size and policy) on stdout."),
) -> None:
    """Replay traces through every policy with the same cache and cost model, and compare."""

    from .scenarios import distinct_labels

    try:
        check_run_dir(out, "simulate", files=SIMULATE_FILES)
        cycles, summary, inputs = _simulate(distinct_files("--trace", traces),
                                    distinct_labels(distinct("--profile", _split(profiles, "--profile", "profile"))),
                                    distinct("--policies", _split([policies], "--policies", "policy")),
                                    distinct("--cache-experts", _parse_sizes(cache_experts)), predictor,
                                    acceptance, cost, h2d_scale, rescale, cache_mode, cache_policy, max_levels, as_json,
                                    price_uncertainty, model, per_layer=out is not None, layer_ahead=layer_ahead)
        if out is not None:
            _write_outputs(out, cycles, summary, ctx, inputs)
    except Interrupted as exc:
        stopped(str(exc))
    except INTERRUPTS as exc:
        stopped_by(exc, "interrupted: nothing was written (a simulation writes its files when every replay is done)")
    if as_json:
        records = json.loads(summary.to_json(orient="records"))
        typer.echo(json.dumps(records, indent=2))
        return
    _print_summary(summary, out)


def distinct(option: str, values: list) -> list:
    """``values`` when none is repeated (a repeated one would be replayed twice and its rows collide)."""
    repeated = sorted({str(v) for v in values if values.count(v) > 1})
    if repeated:
        raise SpecFitError(f"{option}: lists {', '.join(repeated)} twice; expected distinct values")
    return values


def distinct_files(option: str, paths: list[Path]) -> list[Path]:
    """``paths`` when no file is named twice (:func:`~specfit.io.repeated_path`)."""
    same = repeated_path(paths)
    if same is not None:
        raise SpecFitError(f"{option}: lists {same} twice; expected distinct traces (their rows would collide)")
    return paths


def _parse_sizes(text: str) -> list[int]:
    fields = comma_list(text, "--cache-experts", "non-negative integer")
    try:
        sizes = [int(v) for v in fields]
    except ValueError:
        raise SpecFitError(f"--cache-experts: expected comma-separated non-negative integers, got {text!r}") from None
    if min(sizes) < 0:                       # comma_list refused an empty list
        raise SpecFitError(f"--cache-experts: expected comma-separated non-negative integers, got {text!r}")
    return sizes


def _simulate(trace_paths, profiles, policies, cache_sizes, predictor, acceptance, cost_text, h2d_scale, rescale,
              cache_mode, cache_policy, max_levels, quiet, price_uncertainty=True, model_dir=None, per_layer=False,
              layer_ahead="none"):
    """Replay every trace, profile, cache size and policy: ``(cycles, summary, inputs)``; the cycles'
    per-layer columns (and the summary's per-layer errors) only with ``per_layer``, when the rows
    are written; each replay recounted with ``layer_ahead``'s windows unless it is ``none``."""
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..calibrate.profile import ModelShape
    from ..experts.cache import ExpertCache
    from ..traces.format import read_trace
    from .grid import file_digest
    from .prepared import check_position_indexed, check_router_model
    from .replay import prepare_trace
    from .scenarios import build_scenario, check_layer_ahead, check_replay_options, unique_names
    from .sweep import check_policies, run_sweep
    from .whatif import parse_overrides

    check_replay_options(predictor, acceptance, cache_mode, cache_policy)
    check_layer_ahead(layer_ahead)
    check_router_model(predictor, model_dir)
    check_policies(policies, max_levels)
    overrides = parse_overrides(cost_text)
    console = Console(stderr=True)
    # a transient bar or spinner leaves a blank line in a pipe or a file: shown on a terminal only
    quiet = quiet or not console.is_terminal
    prepared, scenarios, inputs = [], {}, {"traces": {}, "cost_models": {}}
    names = unique_names(trace_paths)
    for path, name in zip(trace_paths, names):
        trace = read_trace(path, weights=False)
        check_position_indexed(trace, str(path))     # named by its file (prepare knows its label only)
        slots = ExpertCache.slot_limit(trace.n_layers, trace.n_experts, cache_mode)
        if max(cache_sizes) > slots:
            # a what-if where every expert fits (the default sizes go past a small model's experts)
            console.print(f"note: --cache-experts {max(cache_sizes)} is more than {path}'s {slots} experts "
                          f"{'in all' if cache_mode == 'global' else 'per layer'}: replayed with every expert cached",
                          markup=False, highlight=False)
        shape = ModelShape.from_trace_meta(trace.model)
        scenarios[name] = [build_scenario(spec, shape, h2d_scale, overrides, rescale) for spec in profiles]
        # after the options' checks: a refused option is the one line said
        depth = int(trace.depth.max())
        shallow = deeper_than(policies, max_levels, depth, trace)
        if shallow:
            console.print(depth_note(shallow, depth, path), markup=False, highlight=False)
        with console.status(f"preparing {escape(str(path))} ...") if not quiet else _nothing():
            prepared.append(prepare_trace(name, trace, predictor, acceptance, model_dir=model_dir))
        # what the figures were made from, for run.json: a preset's figures are the code's, a
        # profile file may change under its name
        inputs["traces"][name] = {"path": str(Path(path).resolve()), "digest": file_digest(path)}
        inputs["cost_models"][name] = {s.label: s.cost.to_dict() for s in scenarios[name]}
    n_runs = sum(len(scenarios[p.name]) for p in prepared) * len(cache_sizes) * len(policies)
    cycle_frames, summaries = [], []
    with Progress(TextColumn("[bold]simulate"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                  TimeElapsedColumn(), console=console, disable=quiet, transient=True) as bar:
        task = bar.add_task("", total=n_runs)
        for prep in prepared:
            cyc, summ = run_sweep([prep], policies, cache_sizes, scenarios[prep.name], cache_mode=cache_mode,
                                  cache_policy=cache_policy, max_levels=max_levels, price_uncertainty=price_uncertainty,
                                  per_layer=per_layer, layer_ahead=layer_ahead,
                                  progress=lambda what: bar.update(task, advance=1, description=what))
            cycle_frames.append(cyc)
            summaries.append(summ)
    import pandas as pd

    return pd.concat(cycle_frames, ignore_index=True), pd.concat(summaries, ignore_index=True), inputs


def depth_note(shallow: list[str], depth: int, path) -> str:
    """The note for the policies :func:`deeper_than` found deeper than ``path``'s trees (``depth``
    levels): their replay has fewer nodes and less draft time than a live run of them."""
    verb = "drafts" if len(shallow) == 1 else "draft"
    return (f"note: {', '.join(shallow)} {verb} more levels than {path}'s deepest tree ({depth}): replayed on the "
            f"levels it holds, with fewer nodes and less draft time than live (deeper trees: --tree-depth when "
            f"synthesising or importing a trace, decode --max-levels when recording one)")


def deeper_than(policies: list[str], max_levels: int, depth: int, trace=None) -> list[str]:
    """The fixed-depth policies (``chain:K``, ``eagle3:N:D``, ``static:N``; ``sequoia:N`` at the
    depth of its tree under ``trace``'s rates), which live always draft their levels, that draft
    more than ``depth``."""
    from ..policies import ChainPolicy, RerankPolicy, SequoiaPolicy, make_policy
    from ..sequoia import trace_rates

    built = [(spec, make_policy(spec, max_levels)) for spec in policies]
    sequoia = [p for _, p in built if type(p) is SequoiaPolicy]
    if sequoia and trace is not None:
        rates = trace_rates(trace)
        for p in sequoia:
            p.fit(rates)
    fixed = (ChainPolicy, RerankPolicy) + ((SequoiaPolicy,) if trace is not None else ())
    return [spec for spec, p in built if type(p) in fixed and p.max_levels > depth]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _write_outputs(out: Path, cycles, summary, ctx=None, inputs: dict | None = None) -> None:
    """The run's files as one result: a Ctrl-C while they are written waits for the last of them
    (so "nothing was written" stays true of a stopped run); a kill leaves no summary.parquet, which
    a report refuses, never new cycles beside an old summary."""
    from ..io import atomic_write, deferred_interrupt, remove_stale_temporaries, run_dir_lock, write_csv_atomic
    from ..runinfo import write_run_info

    with run_dir_lock(out, "simulate"), \
            deferred_interrupt(f"interrupted while writing: the simulation's files in {out} were completed first"):
        remove_stale_temporaries(out)
        # a rerun into the same directory: the old summary goes first; the summary is written last
        # and marks a complete output
        for name in ("summary.parquet", "summary.csv"):
            (out / name).unlink(missing_ok=True)
        write_run_info(out, "simulate", ctx, **({"inputs": inputs} if inputs else {}))
        for name, frame in (("cycles", cycles), ("summary", summary)):
            atomic_write(out / f"{name}.parquet", lambda tmp, f=frame: f.to_parquet(tmp, index=False))
            write_csv_atomic(out / f"{name}.csv", frame)


def _print_summary(summary, out: Optional[Path]) -> None:
    from rich.markup import escape
    from rich.table import Table

    from ..console import print_table, table_console

    import pandas as pd

    console = table_console()
    ahead = "layer_ahead_tokens_per_s" in summary
    for (trace, profile), group in summary.groupby(["trace", "profile"], sort=False):
        table = Table(title=escape(f"{trace} - {profile} - predictor {group['predictor'].iloc[0]}"))
        # prediction quality: the union the policy priced vs the one charged (1/1 with oracle
        # experts), and predicted vs committed tokens
        for col in ("cache", "policy", "tokens/s", "tokens/cycle", "MB/token", "hit rate", "nodes", "vs ar", "vs eagle3",
                    "union P/R", "pred. tokens err") + (("+LA tokens/s",) if ahead else ()):
            table.add_column(col, justify="right" if col != "policy" else "left", no_wrap=True)
        for _, row in group.iterrows():
            policy = row["policy"] + (f" (N={int(row['static_n'])})" if is_tuned(row["policy"]) else "")
            la = () if not ahead else ("-" if pd.isna(row["layer_ahead_tokens_per_s"])
                                       else f"{row['layer_ahead_tokens_per_s']:.2f}",)
            table.add_row(str(row["cache_experts"]), policy, f"{row['tokens_per_s']:.2f}", f"{row['tokens_per_cycle']:.2f}",
                          f"{row['bytes_per_token'] / 1e6:.1f}", f"{row['hit_rate']:.2f}", f"{row['nodes_per_cycle']:.1f}",
                          speedup_text(row["speedup_vs_ar"]), speedup_text(row["speedup_vs_eagle3"]),
                          f"{row['union_precision']:.2f}/{row['union_recall']:.2f}",
                          f"{row['tokens_bias']:+.1%}", *la)
        print_table(console, table)
    console.print("tokens/s: committed tokens per second of charged cycle time; cache: cached experts (per layer, or in "
                  "all with --cache-mode global); MB/token: 10^6 bytes host-to-device per committed token; hit rate: share "
                  "of the verified union's experts found in the cache; nodes: verified per cycle; vs ar / vs eagle3: "
                  "tokens/s over that policy's at the same cache size; union P/R: precision / recall of the predicted "
                  "expert union; pred. tokens err: predicted over committed tokens, minus 1", markup=False,
                  highlight=False)
    if ahead:
        console.print(f"+LA tokens/s: the same cycles with copies of the next layer's experts made while a layer "
                      f"computes, in link time the pass leaves idle ({summary['layer_ahead'].iloc[0]}: "
                      f"{LAYER_AHEAD_WORDS[summary['layer_ahead'].iloc[0]]}); each copy a miss's transfer, the overrun "
                      f"of a wasted one charged; residency, hits and misses unchanged (a copy waits a layer in a "
                      f"staging buffer); - for a policy with cache levers, whose evictions and prefetches a recount "
                      f"does not rebuild", markup=False, highlight=False)
    if out is not None:
        console.print(f"per-cycle rows and the summary written to {out}/ (cycles|summary).(parquet|csv)", markup=False,
                      highlight=False)
