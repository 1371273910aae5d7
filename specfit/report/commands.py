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
    inputs: list[Path] = typer.Argument(..., help="Run directories of decode / simulate (or the demo), profile JSON files."),
    out: Optional[Path] = typer.Option(None, "--out", help="Report directory (default: reports/<first input's name>)."),
    title: str = typer.Option("SpecFit report", "--title"),
) -> None:
    """Render one self-contained HTML report (predicted vs measured, policy comparisons, calibration)."""
    from .build import build_report

    target = out or Path("reports") / (inputs[0].stem if inputs else "report")
    try:
        check_output(target, "--out", kind="dir")
        index = build_report(inputs, target, title=title, say=lambda line: typer.secho(line, err=True))
    except Interrupted as exc:
        stopped(str(exc))
    except INTERRUPTS as exc:
        stopped_by(exc, f"interrupted: no report was written ({target} holds what it held before)")
    typer.echo(f"report written to {index}")
