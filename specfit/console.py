"""The console the commands print their tables on."""

from __future__ import annotations

__all__ = ["table_console", "PIPE_WIDTH"]

# rich lays a pipe or a file out at 80 columns: a table of ten numeric columns then cuts its numbers
# short ("(1.37…"); a terminal keeps its own width
PIPE_WIDTH = 160


def table_console():
    """A ``rich`` console on stdout: the terminal's width, or :data:`PIPE_WIDTH` columns when stdout
    is a pipe or a file, so that a table's numbers stay whole in a log."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=PIPE_WIDTH)
