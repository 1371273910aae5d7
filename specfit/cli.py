"""The ``specfit`` command line (typer): one sub-command per job."""

from __future__ import annotations

import typer
from typer.core import TyperGroup

from . import __version__


class _Commands(TyperGroup):
    """The command group: bad input (:class:`~specfit.errors.SpecFitError`, from any command) and an
    operating-system error that no command expected (a full disk, a file that vanished or turned
    into a directory mid-run) end as one line naming the file, status 2, not a traceback. Files are
    written atomically, so what was complete before it stays whole. A Ctrl-C or a kill that no
    command's own handling met (while it imports torch, or prints its tables) ends in one line too,
    with the stop's status (typer's own exit is status 130 without a word, a SIGTERM's too)."""

    def invoke(self, ctx):
        from .errors import (INTERRUPTS, PEER_ERRORS, Interrupted, SpecFitError, fail, out_of_memory_text, stopped,
                             stopped_by)

        try:
            return super().invoke(ctx)
        except SpecFitError as exc:         # bad input, from any command: its one line, status 2
            fail(str(exc))
        except Interrupted as exc:          # says itself what was kept
            stopped(str(exc))
        except INTERRUPTS as exc:
            stopped_by(exc, "interrupted before the command could say what it kept (its files are written whole or "
                            "not at all: none is half-written)")
        except PEER_ERRORS:
            raise               # a reader that went away (`| head`: click ends quietly), a network's
        except OSError as exc:
            from .io import os_error_text

            fail(os_error_text(exc))
        except (MemoryError, RuntimeError) as exc:
            text = out_of_memory_text(exc, ctx.invoked_subcommand)
            if text is None:
                raise
            fail(text)


app = typer.Typer(
    cls=_Commands,
    name="specfit",
    help="Throughput-optimal speculative decoding for MoE models with experts offloaded to host memory.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
traces_app = typer.Typer(help="Synthesise, import, validate and inspect traces (`specfit decode --record` records "
                         "them).", no_args_is_help=True)
app.add_typer(traces_app, name="traces")


@app.callback(invoke_without_command=True)
def _main(ctx: typer.Context, version: bool = typer.Option(False, "--version", help="Print the version and exit.")) -> None:
    if version:
        typer.echo(__version__)
        raise typer.Exit(0)
    from .errors import stop_on_sigterm

    ctx.call_on_close(stop_on_sigterm())       # a kill stops a command as a Ctrl-C does


# Each feature package owns its commands in ``specfit/<package>/commands.py`` with a
# ``register(app, traces_app)`` function; the CLI only wires them up.
_COMMAND_MODULES = (
    "specfit.runtime.commands",
    "specfit.simulate.commands",
    "specfit.simulate.sweep_commands",
    "specfit.traces.commands",
    "specfit.calibrate.commands",
    "specfit.report.commands",
    "specfit.demo",
)


def _register_all() -> None:
    import importlib

    # a module that fails to import is a broken install: fail loudly rather than drop its command
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(app, traces_app)


_register_all()


if __name__ == "__main__":      # ``python -m specfit.cli``, as before the entry point was specfit/__main__.py
    app()
