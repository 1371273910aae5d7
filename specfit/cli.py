"""The ``specfit`` command line (typer): one sub-command per job."""

from __future__ import annotations

import sys

import typer

from . import __version__

app = typer.Typer(
    name="specfit",
    help="Throughput-optimal speculative decoding for MoE models with experts offloaded to host memory.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
traces_app = typer.Typer(help="Record, synthesise, import, validate and inspect traces.", no_args_is_help=True)
app.add_typer(traces_app, name="traces")


def fail(message: str) -> None:
    """Print one clear error line and exit with status 2 (bad input, never a traceback)."""
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def _not_yet(command: str) -> None:
    fail(f"'specfit {command}' is not available yet in this version")


@app.callback(invoke_without_command=True)
def _main(version: bool = typer.Option(False, "--version", help="Print the version and exit.")) -> None:
    if version:
        typer.echo(__version__)
        raise typer.Exit(0)


def main() -> None:  # pragma: no cover - entry point for `python -m specfit`
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
