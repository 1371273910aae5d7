"""Helpers for tests that run the CLI in process and check its one-line errors."""

from __future__ import annotations

from typer.testing import CliRunner

from specfit.cli import app

runner = CliRunner()


def invoke(*args) -> object:
    """``specfit ARGS`` in process (each argument as a string)."""
    return runner.invoke(app, [str(a) for a in args])


def one_line_error(result, *needles: str) -> str:
    """Exit code 2 and a single 'error: ...' line that names what was wrong; returns the line."""
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert "Traceback" not in result.output
    return lines[0]
