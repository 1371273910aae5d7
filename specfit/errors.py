"""Bad user input: the one exception type, and the CLI's way of reporting it.

The command group (``specfit.cli``) catches :class:`SpecFitError` from every command and calls
:func:`fail`, which prints the message as one line (no traceback) and exits with status 2; a Ctrl-C
ends in :func:`stopped` (status 130) with what the command kept. A ``kill`` (SIGTERM) stops a
command the same way (:func:`stop_on_sigterm`), with status 143.
"""

from __future__ import annotations

__all__ = ["SpecFitError", "Interrupted", "INTERRUPTS", "interrupted", "fail", "stopped", "stopped_by", "one_line",
           "check_seed", "comma_list", "stop_on_sigterm", "sigterm_stops", "note_stop_signal"]


class SpecFitError(ValueError):
    """Bad input: a message naming the file, the field and what was expected."""


class Interrupted(KeyboardInterrupt):
    """A run stopped by the user (Ctrl-C) after saving what it had: the message says what was kept
    and where; the CLI prints it and exits with status 130."""


# what a Ctrl-C can arrive as (see :func:`interrupted`); catch these, then check
INTERRUPTS = (KeyboardInterrupt, SystemError)
# operating-system errors about a peer (a reader that went away, a network), not about a file
PEER_ERRORS = (BrokenPipeError, ConnectionError, TimeoutError)


def interrupted(exc: BaseException) -> bool:
    """Whether ``exc`` is a Ctrl-C: a KeyboardInterrupt, or the SystemError that a compiled (numba)
    function's dispatcher raises when the KeyboardInterrupt is raised during its call ("returned a
    result with an exception set", the KeyboardInterrupt as its cause). Without this a Ctrl-C that
    lands in a kernel ends in a traceback, and a decode loses the save of its complete cycles."""
    while exc is not None:
        if isinstance(exc, KeyboardInterrupt):
            return True
        if not isinstance(exc, SystemError):
            return False
        exc = exc.__cause__ or exc.__context__
    return False


_stop_status = [130]       # 128 + the signal that stopped the command: SIGINT's, or SIGTERM's once one arrived


def note_stop_signal(signum: int) -> None:
    """Record the signal a stop came from, for :func:`stopped`'s exit status."""
    _stop_status[0] = 128 + int(signum)


def _on_sigterm(signum, frame):
    note_stop_signal(signum)
    raise KeyboardInterrupt


def stop_on_sigterm():
    """Make a SIGTERM (``kill``, a job scheduler's stop) stop the command as a Ctrl-C does: what it
    completed is saved and said, then it exits with status 143. Only in the main thread and only
    where SIGTERM still has its default action (a host that installed its own keeps it). Returns a
    function that restores the previous handler."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return lambda: None
    signal.signal(signal.SIGTERM, _on_sigterm)
    _stop_status[0] = 130

    def restore() -> None:
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    return restore


def sigterm_stops() -> bool:
    """Whether a SIGTERM now stops the command as a Ctrl-C does (:func:`stop_on_sigterm`)."""
    import signal

    return signal.getsignal(signal.SIGTERM) is _on_sigterm


def fail(message: str) -> None:
    """Print one clear error line and exit with status 2 (bad input, never a traceback)."""
    import typer

    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def stopped(message: str) -> None:
    """Say what a run stopped by Ctrl-C kept (or that it kept nothing) and exit with status 130
    (143 when a SIGTERM stopped it)."""
    import typer

    typer.secho(message, err=True)
    raise typer.Exit(_stop_status[0]) from None


def stopped_by(exc: BaseException, message: str) -> None:
    """In ``except INTERRUPTS as exc``: a Ctrl-C ends in :func:`stopped` with ``message`` (what
    the run kept); any other exception goes on."""
    if not interrupted(exc):
        raise exc
    stopped(message)


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (Arrow's and others' can span several; the CLI prints one)."""
    return " ".join(str(exc).split())


def comma_list(text: str, option: str, what: str = "entry", example: str = "") -> list[str]:
    """The entries of a comma-separated option, stripped. One rule for every option: none at all,
    or an empty entry (``ar,,specfit``, a trailing comma), is one line naming the option."""
    entries = [entry.strip() for entry in str(text).split(",")]
    example = f" (e.g. {example})" if example else ""
    if not any(entries):
        raise SpecFitError(f"{option}: expected at least one {what}, comma-separated{example}")
    if not all(entries):
        plural = what[:-1] + "ies" if what.endswith("y") else what + "s"
        raise SpecFitError(f"{option}: an empty entry in {text!r}; expected {plural} separated by single commas{example}")
    return entries


def check_seed(seed, option: str = "--seed") -> None:
    """numpy's and torch's generators take a non-negative integer seed: refuse another before any
    work (``option``: where the seed was given, e.g. a field of a sweep spec)."""
    import numbers

    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise SpecFitError(f"{option}: expected a non-negative integer, got {seed!r}")


# what needs less memory, per command (the options named are that command's own)
_LESS_MEMORY = {
    "decode": ("a smaller --cache-experts or --prefill-chunk, fewer or shorter prompts, or a smaller model need less "
               "(`specfit plan` estimates a model's memory)"),
    "calibrate": "a smaller --shape or fewer --layers need less",
    "demo": "a smaller --cache-experts or --quick needs less",
}


def out_of_memory_text(exc: BaseException, command: str | None = "decode") -> str | None:
    """One line for an allocation that failed (torch's ``OutOfMemoryError`` on a device, its CPU
    allocator's RuntimeError, Python's MemoryError), or None for any other error, with what needs
    less for ``command`` (the options of ``decode`` and ``calibrate``; another's: smaller inputs).
    Files written before it are whole (atomic writes); a decode keeps the cycles it completed."""
    first = (str(exc).strip().splitlines() or [""])[0]
    if type(exc).__name__ == "OutOfMemoryError" or "CUDA out of memory" in first:
        where = "device"
    elif isinstance(exc, MemoryError) or "can't allocate memory" in first:
        where = "host"
    else:
        return None
    less = _LESS_MEMORY.get(command, "fewer or smaller inputs (traces, runs, cells) need less")
    return f"out of {where} memory{': ' + first if first else ''}; {less}"

