"""``specfit report``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..errors import INTERRUPTS, Interrupted, stopped, stopped_by
from ..io import check_output


def register(app: typer.Typer, traces_app: typer.Typer) -> None:
    app.command(name="report")(report_command)


def report_command(
    inputs: list[Path] = typer.Argument(..., metavar="INPUTS",
                                      help="Run directories of decode, simulate, sweep or plan (or the demo), "
                                      "profile JSON files."),
    out: Optional[Path] = typer.Option(None, "--out", help="Report directory (default: reports/<first input's name>); "
                                       "not a run's output directory (a demo's excepted)."),
    title: Optional[str] = typer.Option(None, "--title", help="The page's title (default: SpecFit report: the inputs' "
                                        "names)."),
) -> None:
    """Render one self-contained HTML report (predicted vs measured, policy comparisons, calibration)."""
    from .build import build_report

    # named after the first input (its absolute name: "." or ".." has none of its own)
    target = out or Path("reports") / ((inputs[0].resolve().stem or "report") if inputs else "report")
    try:
        check_output(target, "--out", kind="dir")
        _check_not_a_run(target)
        earlier = _earlier_inputs(target)
        index = build_report(inputs, target, title=title, say=lambda line: typer.secho(line, err=True))
    except Interrupted as exc:
        stopped(str(exc))
    except INTERRUPTS as exc:
        stopped_by(exc, f"interrupted: no report was written ({target} holds what it held before)")
    if earlier and not _same_inputs(earlier, inputs):
        # the default --out is named after the first input: runs/a and other/a share reports/a
        typer.secho(f"note: {target} held the report of {', '.join(earlier)}; it is replaced (--out names another "
                    "directory)", err=True)
    typer.echo(f"report written to {index}")


def _check_not_a_run(target: Path) -> None:
    """Refuse a ``--out`` that holds a decode, simulate, sweep or plan run (its ``run.json``): the
    report's files would sit among the run's, and stay there, describing the old run, when the run
    is written there again. A demo's directory holds its own report (the demo replaces it)."""
    from ..errors import SpecFitError
    from ..runinfo import RUN_INFO_FILE, read_run_info

    held = (read_run_info(target) or {}).get("kind")
    if isinstance(held, str) and held.split() and held.split()[0] != "demo":
        raise SpecFitError(f"--out {target}: holds a `specfit {held.split()[0]}` run ({RUN_INFO_FILE}); expected a directory "
                           "for the report alone (the default is reports/<first input's name>), not one among the "
                           "run's files, where a rerun would leave it stale")


def _earlier_inputs(target: Path) -> list[str] | None:
    """The inputs of the report already in ``target`` (its ``inputs.json``), or None."""
    import json

    try:
        earlier = json.loads((target / "inputs.json").read_text())
    except (OSError, ValueError):
        return None
    return earlier if isinstance(earlier, list) and all(isinstance(p, str) for p in earlier) else None


def _same_inputs(earlier: list[str], inputs: list[Path]) -> bool:
    return earlier == [str(p) for p in inputs] or [Path(p).resolve() for p in earlier] == [p.resolve() for p in inputs]
