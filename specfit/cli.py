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


# Each feature package owns its commands in ``specfit/<package>/commands.py`` with a
# ``register(app, traces_app)`` function; the CLI only wires them up.
_COMMAND_MODULES = (
    "specfit.runtime.commands",
    "specfit.simulate.commands",
    "specfit.traces.commands",
    "specfit.calibrate.commands",
    "specfit.report.commands",
    "specfit.demo",
)


def _register_all() -> None:
    import importlib

    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.register(app, traces_app)


_register_all()


def main() -> None:  # pragma: no cover - entry point for `python -m specfit`
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
