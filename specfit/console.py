"""The console the commands print their tables on."""

from __future__ import annotations

__all__ = ["table_console", "print_table", "PIPE_WIDTH", "figure_text", "speedup_text"]

# rich lays a pipe or a file out at 80 columns: a table of ten numeric columns then cuts its numbers
# short ("(1.37…"); a terminal keeps its own width
PIPE_WIDTH = 160


def table_console():
    """A ``rich`` console on stdout: the terminal's width, or :data:`PIPE_WIDTH` columns when stdout
    is a pipe or a file, so that a table's numbers stay whole in a log."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=PIPE_WIDTH)


def print_table(console, table) -> None:
    """Print ``table`` on ``console`` with every cell whole: at the console's width when the table
    fits in it, else at the table's own width. rich would otherwise fold or cut its cells, figures
    and policy names included (``494…``, ``1289.`` over ``2``): a wide table that scrolls sideways
    beats one whose numbers are cut."""
    from rich.measure import Measurement

    needed = Measurement.get(console, console.options.update_width(_WIDEST_TABLE), table).maximum
    if needed <= console.width:
        console.print(table)
        return
    width = console.width
    console.width = needed
    try:
        console.print(table)
    finally:
        console.width = width


_WIDEST_TABLE = 10_000   # columns a table may take to show its cells unfolded (measuring only)


def _missing(value) -> bool:
    return value is None or value != value           # None, or NaN (of any float type)


def figure_text(value, spec: str, missing: str = "-") -> str:
    """A figure as a table cell: ``value`` in the format ``spec`` (``".2f"``, ``".0%"``), and
    ``missing`` where there is none (NaN, None: a run that completed no cycle has no tokens/s,
    no error and no hit rate)."""
    return missing if _missing(value) else format(value, spec)


def speedup_text(value, missing: str = "-") -> str:
    """A speed-up as a table shows it: ``1.37x``, with a third decimal where two would round a
    loss or a gain to ``1.00x`` (``0.999x``), and ``missing`` where there is none (NaN, None:
    its baseline was not among the policies)."""
    if _missing(value):
        return missing
    text = f"{value:.2f}x"
    return f"{value:.3f}x" if text == "1.00x" and value != 1.0 else text
