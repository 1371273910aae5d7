"""``specfit calibrate``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..errors import INTERRUPTS, Interrupted, SpecFitError, check_seed, fail, stopped, stopped_by
from ..io import check_output, repeated_path, strict_dumps
from ..threads import THREADS_HELP, set_cpu_threads


# the stand-ins' names (:data:`specfit.calibrate.standin.SHAPE_CONFIGS`, whose module loads torch: seconds
# at every command's start for a help line); tests/test_cli_help.py keeps the two the same
STANDIN_SHAPES = ("qwen3-30b-a3b", "olmoe-1b-7b", "mixtral-8x7b", "qwen1.5-moe-a2.7b", "deepseek-v2-lite", "tiny")


def register(app: typer.Typer, traces_app: typer.Typer) -> None:
    app.command(name="calibrate")(calibrate_command)


def calibrate_command(
    model: Optional[Path] = typer.Option(None, "--model", help="Hugging Face MoE model directory to probe."),
    shape: Optional[str] = typer.Option(None, "--shape", help="Probe random weights of a named shape instead: "
                                        f"{', '.join(STANDIN_SHAPES)}."),
    layers: Optional[int] = typer.Option(None, "--layers", help="With --shape: layers of the stand-in (costs are scaled to the full depth)."),
    drafter: Optional[Path] = typer.Option(None, "--drafter", help="EAGLE-3 drafter directory (its shape sizes the draft probe)."),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda or cuda:N."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float32, bfloat16 or float16 (default: the checkpoint's; "
                                        "bfloat16 for --shape, as the public shapes ship)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Profile JSON to write (default: "
                                       "calibrate/<host>-<device>-<model>.json; with --refit, the --profile's name "
                                       "with -refit, e.g. calibrate/h200-refit.json)."),
    quick: bool = typer.Option(False, "--quick", help="Smaller probe grids (CI, smoke tests)."),
    threads: Optional[int] = typer.Option(None, "--threads", help=THREADS_HELP + "."),
    refit_runs: Optional[list[Path]] = typer.Option(None, "--refit", help="Refit --profile from the cycles of a "
                                                    "`specfit decode --out` run directory instead of probing; repeat "
                                                    "for several (--refit RUN1 --refit RUN2)."),
    profile: Optional[str] = typer.Option(None, "--profile", help="With --refit: the profile to refit (JSON or preset)."),
    rescale: bool = typer.Option(False, "--rescale", help="Allow a profile made for another model shape (transfer costs scaled by expert bytes)."),
    seed: int = typer.Option(0, "--seed"),
    as_json: bool = typer.Option(False, "--json", help="Print only the profile JSON on stdout."),
    report: Optional[Path] = typer.Option(None, "--report", help="Also render the profile's HTML calibration report "
                                          "(probes, fit, held-out errors) into this directory, as `specfit report "
                                          "PROFILE.json` does."),
) -> None:
    """Measure this machine and fit the cycle-time predictor into a hardware profile."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    try:
        from . import calibrate_job       # sklearn, scipy and torch: a Ctrl-C here is an interrupt too

        set_cpu_threads(threads)
        check_seed(seed)
        check_output(out, "--out", kind="file")
        check_output(report, "--report", kind="dir")
        if refit_runs:
            # a refit reads the runs' measured cycles: what only probing uses would be ignored without a word
            probing = [option for option, given in (("--model", model), ("--shape", shape), ("--layers", layers),
                                                    ("--drafter", drafter), ("--dtype", dtype), ("--quick", quick))
                       if given]
            if probing:
                raise SpecFitError(f"--refit: {', '.join(probing)} set(s) what probing measures; a refit fits the "
                                   "cycles of the runs it is given (their model is the one they decoded); drop "
                                   f"{' and '.join(probing)}, or calibrate without --refit")
            path = _refit(refit_runs, profile, out, rescale, seed, as_json)
            _report(path, report, as_json, console)
            return
        if profile is not None:
            raise SpecFitError(f"--profile {profile}: a profile to refit goes with --refit RUN_DIR (the decode runs "
                               "to refit it on); a new calibration takes --model DIR or --shape NAME")
        from ..runtime.devices import resolve_device

        device = str(resolve_device(device))
        if (model is None) == (shape is None):
            raise SpecFitError("calibrate: pass exactly one of --model DIR or --shape NAME")
        if layers is not None and shape is None:
            raise SpecFitError(f"--layers {layers}: sets the depth of a --shape stand-in; a --model is probed with "
                               "all of its layers")
        plan = calibrate_job.CalibrationPlan(model_dir=model, shape=shape, layers=layers, drafter_dir=drafter, device=device,
                                   dtype=dtype, quick=quick, seed=seed)
        plan.validate()
        # the default file is checked as --out is, before the probes (minutes) rather than after them
        path = check_output(out or calibrate_job.planned_profile_path(plan), "--out", kind="file")
        with Progress(TextColumn("[bold]calibrate"), BarColumn(), TextColumn("{task.completed}/{task.total} probes"),
                      TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                      disable=as_json or not console.is_terminal, transient=True) as bar:
            task = bar.add_task("", total=plan.n_steps)
            prof = calibrate_job.calibrate(plan, progress=lambda: bar.update(task, advance=1, description=""),
                                           status=lambda message: bar.update(task, description=message))
        prof.save(path)
    except INTERRUPTS as exc:
        stopped_by(exc, "interrupted: no profile was written (probes are fitted only once they have all run)")
    _report(path, report, as_json, console)
    if as_json:
        typer.echo(strict_dumps(prof.to_dict(), indent=2))
        return
    _summary(prof, path, console)


def _report(profile_path: Path, report_dir: Path | None, quiet: bool, console) -> None:
    """The profile's calibration report (``--report``), rendered from the file just written; the
    profile stays written whatever becomes of the report."""
    if report_dir is None:
        return
    from ..report.build import build_report

    try:
        index = build_report([profile_path], report_dir, title=f"SpecFit calibration: {Path(profile_path).name}",
                             say=lambda line: console.print(line, markup=False, highlight=False))
    except SpecFitError as exc:
        fail(f"{exc} (the profile was written to {profile_path})")
    except Interrupted as exc:              # stopped while the report's files were written: they were completed first
        stopped(f"{exc}; the profile was written to {profile_path}")
    except INTERRUPTS as exc:
        stopped_by(exc, f"interrupted: the profile was written to {profile_path}; no report was written to {report_dir}")
    if not quiet:
        console.print(f"calibration report written to {index}", markup=False, highlight=False)


def _summary(prof, path: Path, console) -> None:
    from rich.table import Table

    from ..console import table_console
    from .fit import at_bound_text
    from .profile import held_out_unit
    from .repeat import rounds_text

    fit = prof.fit
    table = Table(title=f"Profile {path}")
    table.add_column("parameter")
    table.add_column("value", justify="right")
    for name, value in prof.cost.to_dict().items():
        table.add_row(name, f"{value:.4g}" if isinstance(value, float) else str(value))
    h2d = fit.get("h2d") or {}
    table.add_row("H2D bandwidth (GB/s)", f"{h2d.get('gbps', float('nan')):.3g}")
    table.add_row("H2D overhead per copy (s)", f"{h2d.get('overhead_s', float('nan')):.3g}")
    held = fit.get("holdout") or {}
    table.add_row("held-out cycle MAPE", f"{held.get('mape', float('nan')):.1%} over {held.get('n', 0)} {held_out_unit(fit)}")
    table.add_row("held-out max error (s)", f"{held.get('max_abs_err', held.get('max_abs_err_s', float('nan'))):.3g}")
    table.add_row("probe time (s)", f"{fit.get('seconds', 0):.1f}")
    noise = fit.get("probe_noise") or {}
    if noise:
        table.add_row("probe spread over rounds", f"{noise['spread_median']:.1%} median, {noise['spread_p90']:.1%} p90 "
                      f"({rounds_text(noise)})")
    if "fitted" in fit:
        table.add_row("fitted from the passes", ", ".join(fit["fitted"]) or "-")
    for name, prior in (fit.get("at_bound") or {}).items():
        table.add_row(f"at its bound: {name}", at_bound_text(prior))
    for name, held_term in (fit.get("held") or {}).items():
        table.add_row(f"held: {name}", f"{held_term['value']:.4g} ({held_term['at']}): {held_term['reason']}")
    table_console().print(table)
    for warning in fit.get("warnings") or ():
        console.print(f"[yellow]warning:[/yellow] {warning}")


def _refit(run_dirs, profile_spec, out, rescale, seed, as_json) -> Path:
    from rich.table import Table

    from .presets import resolve_profile
    from .calibrate_job import refit, run_shape

    if profile_spec is None:
        fail("--refit: pass --profile (the profile the runs were decoded with)")
    path = out or Path(str(profile_spec)).with_suffix("").with_name(Path(str(profile_spec)).stem + "-refit.json")
    check_output(path, "--out", kind="file")
    for d in run_dirs:
        if not Path(d).is_dir():
            fail(f"--refit {d}: expected a `specfit decode --out` run directory (with cycles.parquet), "
                 f"{'got a file' if Path(d).exists() else 'no such directory'}")
    same = repeated_path(run_dirs, noun="run directory")
    if same is not None:
        fail(f"--refit: lists {same} twice; expected distinct runs (a run's cycles would be fitted twice, and held "
             "out beside their own copies)")
    # the model the runs decoded (run.json): a preset is built for it, a profile of another shape
    # is refused unless --rescale maps it onto it
    shape = next((s for s in map(run_shape, run_dirs) if s is not None), None)
    prof = resolve_profile(profile_spec, shape, rescale=rescale)
    new, comparison = refit(prof, run_dirs, seed=seed)
    new.save(path)
    if as_json:
        typer.echo(strict_dumps({"profile": new.to_dict(), "comparison": comparison}, indent=2))
        return path
    table = Table(title=f"Refit on {comparison['n_cycles']} measured cycles ({comparison['n_holdout']} held out) -> {path}")
    for col in ("", "held-out MAPE", "max abs. error (s)"):
        table.add_column(col, justify="right")
    for label in ("before", "after"):
        e = comparison[label]
        if not e.get("n"):     # too few cycles to hold any out
            table.add_row(f"{label} refit", "-", "-")
            continue
        table.add_row(f"{label} refit", f"{e['mape']:.1%}", f"{e.get('max_abs_err', e.get('max_abs_err_s')):.3g}")
    from ..console import table_console

    table_console().print(table)
    after = comparison["after_params"]
    typer.echo(f"draft level {after['draft_level_s'] * 1e3:.3g} ms, "
               f"per node {after['per_node_s'] * 1e6:.3g} us, hit {after['hit_s'] * 1e6:.3g} us, "
               f"miss {after['miss_s'] * 1e6:.3g} us, base {after['base_s'] * 1e3:.3g} ms")
    for warning in new.fit.get("warnings") or ():
        typer.echo(f"warning: {warning}", err=True)
    return path
