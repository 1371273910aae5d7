"""``specfit traces synth | import-routing | validate | inspect``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import typer

from ..errors import INTERRUPTS, SpecFitError, check_seed, stopped_by
from ..io import check_output, strict_dumps


# synth's and import-routing's draft depth
TREE_DEPTH_HELP = ("Draft levels (default 7, the sample traces' depth; eagle3 drafts 8, replayed on the levels a trace "
                   "holds).")


# a measured sibling overlap this far from --sibling-reuse is said (the routing model clamps it)
SIBLING_REUSE_TOLERANCE = 0.05


def register(app: typer.Typer, traces_app: typer.Typer) -> None:
    traces_app.command("synth")(synth_command)
    traces_app.command("import-routing")(import_routing_command)
    traces_app.command("validate")(validate_command)
    traces_app.command("inspect")(inspect_command)


def synth_command(
    shape: str = typer.Option(..., "--shape", help="Model shape: qwen3-30b-a3b, olmoe-1b-7b or mixtral-8x7b."),
    workload: str = typer.Option("chat", "--workload", help="Drafter confidence preset: chat, math or code "
                                 "(any other name needs --top1-prob)."),
    tokens: int = typer.Option(..., "--tokens", help="Positions (reference tokens) in the trace."),
    out: Path = typer.Option(..., "--out", help="Trace file to write (.parquet)."),
    seed: int = typer.Option(0, "--seed"),
    sequence_tokens: int = typer.Option(128, "--sequence-tokens", help="Positions per sequence (prompt)."),
    tree_width: Optional[int] = typer.Option(None, "--tree-width", help="Drafter top-k: children per expanded node (default 4)."),
    tree_depth: Optional[int] = typer.Option(None, "--tree-depth", help=TREE_DEPTH_HELP),
    top1_prob: Optional[float] = typer.Option(None, "--top1-prob", help="Mean Beta-drawn draft probability at depth 1, "
                                           "the top-1's a bit above (default: the workload's, chat 0.55, math 0.63, "
                                           "code 0.68)."),
    depth_decay: Optional[float] = typer.Option(None, "--depth-decay", help="Per-level factor on the top-1 probability "
                                             "(default: the workload's, chat 0.94, math 0.95, code 0.96)."),
    calibration_exponent: Optional[float] = typer.Option(None, "--calibration-exponent",
                                                         help="Acceptance = draft_prob ** exponent (1 = calibrated drafter; "
                                                              "default 1.15)."),
    popularity_zipf: float = typer.Option(0.7, "--popularity-zipf", help="Zipf exponent of expert popularity per layer."),
    consecutive_reuse: float = typer.Option(0.45, "--consecutive-reuse", help="Target share of a token's experts used by the previous token."),
    token_affinity: float = typer.Option(0.72, "--token-affinity", help="Target overlap of two occurrences of the same token."),
    sibling_reuse: float = typer.Option(0.3, "--sibling-reuse", help="Target overlap of two off-path draft siblings (reached within what the shape's routing allows; the table prints what was)."),
    as_json: bool = typer.Option(False, "--json", help="Print only the trace's statistics as JSON."),
) -> None:
    """Generate a synthetic position-indexed trace with checked routing and acceptance statistics."""
    from .format import write_trace
    from .synth import RoutingParams, WORKLOADS, synthesize, with_drafter_overrides

    try:
        _check_trace_out(out)
        check_seed(seed)
        if workload not in WORKLOADS and top1_prob is None:
            raise SpecFitError(f"--workload: {workload!r} is not a preset ({', '.join(WORKLOADS)}); give --top1-prob "
                               "(and optionally --depth-decay) to describe its drafter")
        try:
            drafter = with_drafter_overrides(workload, width=tree_width, depth=tree_depth, top1_prob=top1_prob,
                                             depth_decay=depth_decay, calibration_exponent=calibration_exponent)
            routing = RoutingParams(popularity_zipf=popularity_zipf, consecutive_reuse=consecutive_reuse,
                                    token_affinity=token_affinity, sibling_reuse=sibling_reuse)
            trace = _with_status(lambda: synthesize(shape, workload, tokens, seed=seed, sequence_tokens=sequence_tokens,
                                                    routing=routing, drafter=drafter), "synthesising", as_json)
        except ValueError as exc:
            raise SpecFitError(str(exc)) from None
        write_trace(trace, out)
    except INTERRUPTS as exc:
        _stopped_unwritten(exc, out)
    _report_written(trace, out, as_json)


def import_routing_command(
    log_file: Path = typer.Argument(..., metavar="LOG", help="Routing log: .npz (expert_ids + sequence_id [+ token_id, "
                                    "generated_token_index, router_weights], or one array per sequence: problem0, "
                                    "problem1, ...), .jsonl or .parquet (one record per token and layer, or per token)."),
    out: Path = typer.Option(..., "--out", help="Trace file to write (.parquet)."),
    shape: Optional[str] = typer.Option(None, "--shape", help="Model shape (default: inferred from layers x top-k)."),
    model: Optional[Path] = typer.Option(None, "--model", help="The model's config.json (or its directory): the "
                                         "shape from its MoE layers, routed experts and top-k."),
    dtype: str = typer.Option("bfloat16", "--dtype", help="With --model: the dtype its experts are offloaded in, "
                              "which sizes an expert's bytes (bfloat16, as on a GPU; float32 as `specfit decode` "
                              "runs on a CPU)."),
    workload: str = typer.Option("chat", "--workload", help="Drafter preset for the synthesised trees: chat, math or code."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Import only the first positions."),
    sequences: Optional[int] = typer.Option(None, "--sequences", help="Import only the first sequences."),
    tree_width: Optional[int] = typer.Option(None, "--tree-width", help="Drafter top-k: children per expanded node (default 4)."),
    tree_depth: Optional[int] = typer.Option(None, "--tree-depth", help=TREE_DEPTH_HELP),
    sibling_reuse: float = typer.Option(0.3, "--sibling-reuse", help="Target overlap of two off-path draft siblings (reached within what the shape's routing allows; the table prints what was)."),
    seed: int = typer.Option(0, "--seed"),
    as_json: bool = typer.Option(False, "--json", help="Print only the trace's statistics as JSON."),
) -> None:
    """Turn a real routing log into a trace: real committed-token experts, synthesised draft trees."""
    from .format import write_trace
    from .importers import check_import_options, import_routing, model_for_log, model_from_config, read_routing_log
    from .synth import WORKLOADS, with_drafter_overrides

    try:
        _check_trace_out(out, log_file)
        if workload not in WORKLOADS:
            raise SpecFitError(f"--workload: expected one of {sorted(WORKLOADS)}, got {workload!r}")
        try:
            drafter = with_drafter_overrides(workload, width=tree_width, depth=tree_depth)
        except ValueError as exc:
            raise SpecFitError(str(exc)) from None
        if shape is not None and model is not None:
            raise SpecFitError("import-routing: pass --shape or --model, not both")
        check_import_options(sequences, max_tokens, seed, sibling_reuse)
        if dtype not in ("bfloat16", "float32") or (dtype != "bfloat16" and model is None):
            raise SpecFitError(f"--dtype: expected bfloat16 or float32 with --model, got {dtype!r}"
                               + ("" if model is not None else " without --model"))
        log = read_routing_log(log_file)
        if sequences is not None:
            keep = np.unique(log.sequence, return_index=True)[1]
            first = log.sequence[np.sort(keep)][:sequences]
            log = log.select(np.flatnonzero(np.isin(log.sequence, first)))
        meta = model_from_config(model, dtype) if model is not None else model_for_log(log, shape)
        trace = _with_status(lambda: import_routing(log, meta, workload=workload,
                                                    drafter=drafter, sibling_reuse=sibling_reuse, seed=seed, max_tokens=max_tokens),
                             "importing", as_json)
        write_trace(trace, out)
    except INTERRUPTS as exc:
        _stopped_unwritten(exc, out)
    _report_written(trace, out, as_json)


def validate_command(trace_file: Path = typer.Argument(..., metavar="FILE", help="Trace file (.parquet).")) -> None:
    """Check a trace file against the schema and every invariant the simulator relies on."""
    from .format import read_trace, validate_trace

    trace = read_trace(trace_file, validate=False)
    counts = validate_trace(trace, source=str(trace_file))
    kind = "position-indexed" if trace.position_indexed else "recorded"
    typer.echo(f"{trace_file}: valid schema-{trace.meta.get('schema_version')} {kind} trace, {counts['cycles']} cycles, "
               f"{counts['nodes']} nodes ({trace.model['name']}: {trace.n_layers} layers x {trace.n_experts} experts, "
               f"top-{trace.top_k})")


def inspect_command(
    trace_file: Path = typer.Argument(..., metavar="FILE", help="Trace file (.parquet)."),
    as_json: bool = typer.Option(False, "--json", help="Print only the summary as JSON."),
) -> None:
    """Summarise a trace: cycles, tree sizes, acceptance by depth, expert unions and reuse."""
    from rich.markup import escape
    from rich.table import Table

    from ..console import table_console
    from .format import read_trace
    from .summary import summarise_trace

    trace = read_trace(trace_file)
    summary = summarise_trace(trace)
    if as_json:
        typer.echo(strict_dumps(summary, indent=2))
        return
    console = table_console()
    head = Table(title=escape(str(trace_file)), show_header=False)
    head.add_column("field")
    head.add_column("value")
    for key in ("model", "workload", "recording", "provenance_real", "provenance_synthesised", "cycles", "sequences",
                "nodes_per_tree", "max_depth", "full_tree_accepted_tokens", "consecutive_reuse", "token_affinity",
                "sibling_reuse", "popularity_skew"):
        value = summary[key]
        head.add_row(key, _figure(value) if isinstance(value, float) else escape(str(value)))
    console.print(head)
    # a rate with the number of trees behind it: 1.000 of 1 tree is no estimate
    depth = Table(title="By draft depth", caption="acceptance_rate: the share of the trees (those whose accepted path "
                                                  "reached the level before) that reach this depth")
    for col in ("depth", "nodes_per_tree", "trees", "acceptance_rate", "union_experts_per_layer"):
        depth.add_column(col, justify="right")
    for row in summary["by_depth"]:
        depth.add_row(str(row["depth"]), f"{row['nodes_per_tree']:.1f}", str(row["trees"]),
                      f"{row['acceptance_rate']:.3f}", f"{row['union_experts_per_layer']:.1f}")
    console.print(depth)
    calib = Table(title="Drafter calibration (draft probability vs share accepted)")
    for col in ("bin", "nodes", "draft_prob", "accept_rate"):
        calib.add_column(col, justify="right")
    for row in summary["calibration"]:
        calib.add_row(row["bin"], str(row["nodes"]), f"{row['draft_prob']:.3f}", f"{row['accept_rate']:.3f}")
    console.print(calib)


def _figure(value: float) -> str:
    """A summary figure: a whole number as one (58 nodes per tree, not 58.000), others to three decimals."""
    return str(int(value)) if value.is_integer() else f"{value:.3f}"


def _check_trace_out(out: Path, source: Path | None = None) -> None:
    """``--out`` as a trace file to write: a ``.parquet`` name (what the trace is), writable, and not
    the routing log it is made from (which the write would replace)."""
    check_output(out, "--out", kind="file")
    if out.suffix != ".parquet":
        raise SpecFitError(f"--out {out}: expected a .parquet file name (a trace is written as Parquet)")
    if source is not None and out.exists() and source.exists() and out.samefile(source):
        raise SpecFitError(f"--out {out}: is the routing log being imported; expected another file (writing the trace "
                           "would replace the log)")


def _stopped_unwritten(exc: BaseException, out: Path) -> None:
    """A Ctrl-C before the trace was written (it is written atomically, whole or not at all)."""
    stopped_by(exc, f"interrupted: no trace was written ({out} is as it was)")


def _with_status(work, what: str, quiet: bool):
    from rich.console import Console

    console = Console(stderr=True)
    if quiet:
        return work()
    with console.status(f"{what} ..."):
        return work()


def _report_written(trace, out: Path, as_json: bool) -> None:
    stats = trace.meta.get("statistics", {})
    if as_json:
        typer.echo(strict_dumps(stats, indent=2))
        return
    from rich.markup import escape
    from rich.table import Table

    from ..console import table_console

    table = Table(title=escape(f"{out}: {trace.n_cycles} positions, {trace.n_nodes / trace.n_cycles:.1f} nodes/tree"))
    table.add_column("statistic")
    table.add_column("target", justify="right")
    table.add_column("measured", justify="right")
    targets = trace.meta.get("parameters", {}).get("targets", {})
    for key in ("popularity_skew", "consecutive_reuse", "token_affinity", "sibling_reuse", "full_tree_accepted_tokens"):
        target = targets.get(key)
        table.add_row(key, "" if target is None else f"{target:.3f}", f"{stats.get(key, float('nan')):.3f}")
    table_console().print(table)
    target, measured = targets.get("sibling_reuse"), stats.get("sibling_reuse")
    if target is not None and measured is not None and abs(measured - target) > SIBLING_REUSE_TOLERANCE:
        typer.echo(f"note: sibling_reuse measured {measured:.3f} against the target {target:.3f}: the routing model "
                   f"reuses a draft sibling's experts at most as often as the token's own preferences leave room for "
                   f"(1 - token_prob per layer), and overlap by chance sets a floor: a target beyond that range is not "
                   f"reached")
    recording = trace.meta.get("recording", {})
    if recording.get("token_ids") == "synthesised":
        typer.echo(f"the log has no token ids: reference tokens are synthesised; predictors that learn from token ids "
                   f"({', '.join(recording.get('unfittable_predictors', []))}) cannot be fitted on this trace")
    if recording.get("router_weights"):
        typer.echo("router weights of the reference path kept (column true_expert_weights)")
    ids = recording.get("source_sequence_ids")
    if ids is not None:
        skipped = recording.get("one_token_sequences_skipped", 0)
        typer.echo(f"{len(ids)} sequences of the log, numbered 0-{len(ids) - 1} in the trace (the log's ids are "
                   f"kept under recording.source_sequence_ids)"
                   + (f"; {skipped} of one token left out (no cycle to make)" if skipped else ""))
