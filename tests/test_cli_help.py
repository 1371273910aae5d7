"""Every command's ``--help`` reads as the terminal wraps it."""

from __future__ import annotations

import inspect

import typer
from typer.testing import CliRunner

from specfit.cli import app


def _commands(command, path: tuple[str, ...] = ()):
    yield path, command
    if hasattr(command, "commands"):     # a group (typer's own click)
        for name, sub in command.commands.items():
            yield from _commands(sub, (*path, name))


def test_every_commands_help_paragraphs_are_wrapped_by_the_terminal_not_the_source():
    # typer joins the lines of a help text's first paragraph but keeps the line breaks of the
    # others: a later paragraph broken in the source prints as ragged lines at any width
    commands = list(_commands(typer.main.get_command(app)))
    assert len(commands) > 10
    for path, command in commands:
        _, *later = inspect.cleandoc(command.help or "").partition("\f")[0].split("\n\n")
        for paragraph in later:
            assert "\n" not in paragraph.strip(), (path, paragraph)
        result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, (path, result.output)


def test_decode_help_prints_its_second_paragraph_as_one_line_at_a_wide_terminal():
    result = CliRunner().invoke(app, ["decode", "--help"], env={"COLUMNS": "250"})
    line = next(line for line in result.output.splitlines() if "Reports, per prompt" in line)
    assert "profile's predictions." in line


def test_calibrate_help_names_every_shape_a_stand_in_can_take():
    from specfit.calibrate.standin import SHAPE_CONFIGS

    calibrate = typer.main.get_command(app).commands["calibrate"]
    shape = next(p for p in calibrate.params if "--shape" in p.opts)
    assert shape.help.endswith(f"{', '.join(SHAPE_CONFIGS)}."), shape.help


def test_simulate_and_plans_help_show_their_defaults_and_examples_whole_at_80_columns(monkeypatch):
    """A help printed to a pipe is 80 columns: long tokens (the policies' default
    `ar,chain:4,eagle...`, `base_s=0.004,mis...`, `static:N|static:...`) were cut short."""
    from typer.testing import CliRunner

    from specfit.cli import app

    monkeypatch.setenv("COLUMNS", "80")
    for command in ("simulate", "plan"):
        text = CliRunner().invoke(app, [command, "--help"], terminal_width=80).output
        lines = [line for line in text.splitlines() if "…" in line]
        # the one cut left: simulate's pair of flag names in the names column
        assert all("--price-uncertai" in line for line in lines), lines
