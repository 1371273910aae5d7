"""File output: every file SpecFit writes appears whole or not at all, and every output path is
checked before any work starts (:func:`check_output`), so a bad ``--out`` fails in one line
instead of after minutes of decoding."""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import signal
import stat
import tempfile
import threading
from pathlib import Path
from typing import Callable

from .errors import Interrupted, SpecFitError, note_stop_signal, one_line, sigterm_stops

__all__ = ["atomic_write", "write_text_atomic", "write_json_atomic", "read_parquet", "strict_json", "write_jsonl_atomic", "check_output",
           "not_readable_as", "optional_file", "os_error_text", "run_dir_lock", "file_lock", "LOCK_FILE", "strict_dumps",
           "nulls_as_nan", "write_csv_atomic", "user_cache_dir",
           "remove_stale_temporaries", "read_json_object", "json_text", "config_value", "deferred_interrupt"]


def json_text(value) -> str:
    """How a parsed JSON value reads in an error that expected another kind: its kind, and the
    value itself when it is short."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return repr(value) if len(value) <= 40 else "a string"
    return repr(value)


def config_value(value, key: str, source: str, kind=int):
    """``value`` of ``key`` as ``kind`` (int, float or bool), as JSON wrote it: a string, a bool
    where a number is meant, a fractional or infinite count is a damaged config, not something to
    convert (``int("128")``, ``int(4.5)`` and ``bool("false")`` would all pass silently)."""
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = numeric and math.isfinite(value) and float(value).is_integer()
    else:
        ok = numeric
    if not ok:
        expected = {int: "an integer", float: "a number", bool: "true or false"}[kind]
        raise SpecFitError(f"{source}: key {key!r} must be {expected}, got {json_text(value)}")
    return kind(value)


def read_json_object(path: str | Path, expected: str = "a JSON file") -> dict:
    """The JSON object in ``path``; one clear error for a missing file (naming what was
    ``expected`` there), an unreadable or malformed one, or anything but an object at the top."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecFitError(f"{path}: no such file; expected {expected}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecFitError(f"{path}: not a readable JSON file ({exc})") from None
    if not isinstance(raw, dict):
        raise SpecFitError(f"{path}: expected a JSON object at the top level, got {json_text(raw)}")
    return raw


def _not_a_file(path: Path) -> str | None:
    """What stands at ``path`` instead of a regular file: a directory, something else (a FIFO, a
    device), a symbolic link to nothing; None for a regular file or nothing at all."""
    if path.is_dir():
        return "a directory"
    if path.exists():
        return None if path.is_file() else "not a regular file (a FIFO, device or socket)"
    if os.path.lexists(path):
        return "a symbolic link to nothing (its target is missing, or a loop)"
    return None


def not_readable_as(path: Path, expected: str, missing: str) -> str:
    """Why ``path`` cannot be read as ``expected`` (e.g. "a trace file (.parquet)"), for an error
    naming it: :func:`_not_a_file`'s reason, or (``missing``) nothing at all."""
    what = _not_a_file(path)
    return missing if what is None else f"{what}, expected {expected}"


def optional_file(path: Path, expected: str) -> bool:
    """Whether an optional file is there to read: False where nothing is at ``path`` (not even a
    link), True for a regular file; what stands there instead (a directory, a symbolic link to
    nothing: a partial download) is one error naming it, not taken for an absent file."""
    if not os.path.lexists(path):
        return False
    what = _not_a_file(path)
    if what is not None:
        raise SpecFitError(f"{path}: {what}, expected {expected}")
    return True


def repeated_path(paths, noun: str = "file") -> str | None:
    """The first path ``paths`` names twice, spelled alike or not (``t.parquet`` and
    ``./runs/../t.parquet``), as an error names it ("t", or "a and b (the same file)"); None when
    every path is another."""
    seen: dict[Path, object] = {}
    for path in paths:
        key = Path(path).resolve()
        if key in seen:
            first = seen[key]
            return str(first) if str(first) == str(path) else f"{first} and {path} (the same {noun})"
        seen[key] = path
    return None


def os_error_text(exc: OSError) -> str:
    """An operating-system error as one line: the file(s) it names and the system's reason."""
    files = " -> ".join(str(f) for f in (exc.filename, exc.filename2) if f is not None)
    reason = exc.strerror or str(exc)
    return f"{files}: {reason}" if files else reason


def check_output(path: str | Path | None, option: str, kind: str = "file") -> Path | None:
    """Fail with one line, before any work, when ``path`` cannot be written as a ``kind`` ("file"
    or "dir"): a directory where a file is meant, a file where a directory is meant, something
    that is not a regular file (a device, a FIFO: a write would replace it), a symbolic link to
    nothing on the way, a name the file system refuses (too long), or a parent that is
    missing-and-uncreatable, not a directory, or not writable. Nothing is created: the nearest
    existing ancestor is probed with a temporary file that is removed at once."""
    if path is None:
        return None
    path = Path(path)
    try:
        return _check_output(path, option, kind)
    except OSError as exc:                  # a name too long, a path the system cannot look up
        raise SpecFitError(f"{option} {path}: {exc.strerror or exc}") from None


def _check_output(path: Path, option: str, kind: str) -> Path:
    if path.exists():
        if kind == "file" and path.is_dir():
            raise SpecFitError(f"{option} {path}: is a directory; expected a file to write")
        if kind == "dir" and not path.is_dir():
            raise SpecFitError(f"{option} {path}: is a file; expected a directory to write into")
        if kind == "file" and not path.is_file():
            raise SpecFitError(f"{option} {path}: not a regular file (a device, FIFO or socket); expected a file to "
                               "write (a write would replace it)")
    ancestor = path if kind == "dir" and path.is_dir() else path.parent
    if os.path.lexists(path) and not path.exists():
        ancestor = path
    while not ancestor.exists() and ancestor != ancestor.parent:
        if os.path.lexists(ancestor):
            raise SpecFitError(f"{option} {path}: {ancestor} is a symbolic link to nothing (its target is missing, or "
                               "a loop); expected a directory or a new path")
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise SpecFitError(f"{option} {path}: {ancestor} is a file, so nothing can be created under it")
    try:
        fd, probe = tempfile.mkstemp(prefix=".specfit-write-check.", dir=ancestor)
    except OSError as exc:
        raise SpecFitError(f"{option} {path}: cannot create files under {ancestor} ({exc.strerror or exc})") from None
    os.close(fd)
    os.unlink(probe)
    return path


LOCK_FILE = ".lock"


@contextlib.contextmanager
def run_dir_lock(out_dir: str | Path | None, command: str):
    """Hold ``out_dir``'s lock (:data:`LOCK_FILE`, created with the directory) while a ``command``
    writes into it: a second run writing the same directory at once would delete and mix the
    first one's files (or compute a sweep's cells twice), so it is refused in one line. No
    ``out_dir``: nothing to hold."""
    if out_dir is None:
        yield
        return
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    def refuse() -> None:
        raise SpecFitError(f"{out_dir}: another specfit run is writing this directory (`specfit {command}` needs "
                           "it alone); wait for it or use another --out")

    with file_lock(out_dir / LOCK_FILE, "the directory's lock", refuse):
        yield


@contextlib.contextmanager
def file_lock(lock: Path, what: str, on_held: Callable[[], None]):
    """Hold the lock on file ``lock`` (``what`` names it in errors; created if missing). The lock is
    the operating system's (``flock``): a killed holder's is gone with its process, whatever its
    file says. When another process holds it, ``on_held()`` is called first: it raises to refuse,
    or returns to wait until the holder lets go. Yields whether it waited. On a file system
    without locks (some network mounts) it runs unlocked."""
    import fcntl

    try:                                # never through a link, never blocking on a FIFO, never truncating
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
    except OSError as exc:
        raise SpecFitError(f"{lock}: cannot open {what} ({exc.strerror or exc}); expected a regular "
                           "file or none") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SpecFitError(f"{lock}: not a regular file; expected {what} file or none")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held, waited = True, False
        except BlockingIOError:
            held, waited = False, True
        except OSError:                 # a file system without locks: run unlocked
            held, waited = False, False
        if waited:
            on_held()
            fcntl.flock(fd, fcntl.LOCK_EX)
            held = True
        try:
            yield waited
        finally:
            if held:
                fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def remove_stale_temporaries(directory: str | Path) -> int:
    """Delete temporary files an interrupted :func:`atomic_write` left in ``directory`` (a SIGKILL
    gives it no chance to clean up); one that a running process is writing stays. Returns how many
    were removed."""
    stale = [tmp for tmp in Path(directory).glob(".*.tmp") if _abandoned(tmp)] if Path(directory).is_dir() else []
    for tmp in stale:
        tmp.unlink(missing_ok=True)
    return len(stale)


def _abandoned(tmp: Path) -> bool:
    """Whether the process that wrote temporary file ``tmp`` (``.NAME.PID-RANDOM.tmp``, as
    :func:`atomic_write` names them) is gone: another process writing the same file at the same time
    (two runs calibrating into one profile cache) keeps its own. A name without a process id is an
    older version's, and abandoned."""
    writer = tmp.name[: -len(".tmp")].rsplit(".", 1)[-1].split("-", 1)[0]
    if not writer.isdigit():
        return True
    try:
        os.kill(int(writer), 0)
    except ProcessLookupError:
        return True
    except (OSError, OverflowError):
        return False                  # PermissionError: alive, another user's
    return False


def atomic_write(path: str | Path, write: Callable[[str], None]) -> Path:
    """Call ``write(tmp_path)`` on a temporary file next to ``path``, then move it into place
    with ``os.replace``: readers never see a half-written file, and an interrupted run leaves the
    previous file (or none) rather than a truncated one. A temporary file a killed write of the same
    file left behind (a SIGKILL gives it no chance to clean up) is removed first; the temporary
    file's name holds the writing process's id, so a concurrent writer's is left alone."""
    path = Path(path)
    if path.is_symlink() and path.exists():
        path = Path(os.path.realpath(path))      # a link to a file: write the file it names, keep the link
    what = _not_a_file(path)
    if what is not None:
        raise SpecFitError(f"{path}: {what}; expected a file to write (it is left as it is)")
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):   # a killed write of this file
        if _abandoned(stale):
            stale.unlink(missing_ok=True)
    tmp = None
    try:
        # Python raises a Ctrl-C as soon as the temporary file's open returns, before mkstemp hands
        # back the name to remove (an interrupted sweep left one in ~6 % of its Ctrl-Cs): held there
        with _stop_signals_held():
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}-", suffix=".tmp", dir=path.parent)
            os.close(fd)
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; a report is for others to read
        _fsync(tmp)                       # the data on disk before the name: a crash never leaves an empty file
        os.replace(tmp, path)
        _fsync(path.parent, directory=True)
    except OSError as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if exc.filename is not None:
            raise
        # a writer's own error (pyarrow's, a full disk's) may name no file: name the one written
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _fsync(path, directory: bool = False) -> None:
    """Flush ``path``'s data (a directory's: its entries) to the disk. A file system that cannot
    sync a directory (some network ones refuse) leaves the rename as durable as it makes it."""
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    except OSError:
        if not directory:
            raise
    finally:
        os.close(fd)


@contextlib.contextmanager
def _stop_signals_held():
    """Hold a SIGINT or SIGTERM that arrives inside the block and deliver it again after it, to
    the handler it would have met (whatever that does: raise KeyboardInterrupt, stop the command).
    Only the main thread runs Python's signal handlers; elsewhere, or where a handler was not
    installed from Python, a no-op."""
    held = (signal.SIGINT, signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or any(signal.getsignal(s) is None for s in held):
        yield
        return
    caught = []
    try:
        with _signals_caught(held, caught):
            yield
    finally:
        for s in caught:
            signal.raise_signal(s)


@contextlib.contextmanager
def _signals_caught(held, caught: list):
    """Inside the block the signals ``held`` are appended to ``caught`` instead of being handled;
    their handlers are back after it."""
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in held}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text_atomic(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def strict_json(obj):
    """``obj`` with every NaN or infinite float as None: JSON has no such numbers, and Python's
    ``NaN`` / ``Infinity`` extension is refused by other readers (JavaScript's ``JSON.parse``, jq).
    A reader of specfit's files takes null as "no value" where a number is expected. (Use
    :func:`strict_dumps`, which walks ``obj`` only when it holds such a number.)"""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    return obj


def nulls_as_nan(value, keep: tuple[str, ...] = ()):
    """What :func:`strict_json` wrote, read back: every null as NaN (a figure without a value),
    through dicts and lists, but under the keys in ``keep``, where null means "not measured"."""
    if isinstance(value, dict):
        return {k: v if v is None and k in keep else float("nan") if v is None else nulls_as_nan(v, keep)
                for k, v in value.items()}
    if isinstance(value, list):
        return [nulls_as_nan(v, keep) for v in value]
    return value


def strict_dumps(obj, **options) -> str:
    """``json.dumps`` of ``obj`` as strict JSON (NaN and infinities as null, :func:`strict_json`)."""
    try:
        return json.dumps(obj, allow_nan=False, **options)
    except ValueError:                  # a NaN or an infinity somewhere: the slower walk
        return json.dumps(strict_json(obj), allow_nan=False, **options)


def read_parquet(path: str | Path, columns: list[str] | None = None, what: str = "Parquet file", hint: str = ""):
    """The pandas frame of a Parquet file (only ``columns`` where given). A damaged file, or one
    that lacks a column asked for, is one line naming it as ``what`` (e.g. "sweep part file"),
    then ``hint`` (what to do about it)."""
    import pandas as pd
    import pyarrow.parquet as pq

    hint = f"; {hint}" if hint else ""
    try:
        if columns is not None:
            missing = [c for c in columns if c not in pq.read_schema(path).names]
            if missing:
                raise SpecFitError(f"{path}: missing column(s) {missing}; expected the columns the specfit version "
                                   f"that reads it writes{hint}")
        return pd.read_parquet(path, columns=columns)
    except SpecFitError:
        raise
    except Exception as exc:  # pyarrow raises several types for damaged or non-Parquet files
        raise SpecFitError(f"{path}: not a readable {what} ({one_line(exc)}){hint}") from None


def write_json_atomic(path: str | Path, obj, indent: int = 2) -> Path:
    return write_text_atomic(path, strict_dumps(obj, indent=indent) + "\n")


def write_jsonl_atomic(path: str | Path, records) -> Path:
    return write_text_atomic(path, "".join(strict_dumps(r) + "\n" for r in records))


def write_csv_atomic(path: str | Path, frame) -> Path:
    """``frame`` (a pandas DataFrame) as CSV, written whole or not at all, by Arrow's compiled
    writer (pandas formats each value in Python: 5.1 s of a 25k-token ``simulate``'s 28 s). A
    float prints as the shortest text that reads back to it (``1`` for 1.0), a missing value as an
    empty field, a string in quotes, a bool as ``True`` / ``False`` (as pandas writes it), and a
    list column's value as its JSON list (``[3, 0, 1]``)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    from pyarrow import csv

    table = pa.Table.from_pandas(frame, preserve_index=False)
    for i, field in enumerate(table.schema):
        column = table.column(i)
        if pa.types.is_list(field.type) or pa.types.is_large_list(field.type):
            items = pc.binary_join(column.cast(pa.list_(pa.string())), ", ")
            table = table.set_column(i, field.name, pc.binary_join_element_wise("[", items, "]", ""))
        elif pa.types.is_boolean(field.type):
            table = table.set_column(i, field.name, pc.if_else(column, "True", "False"))
    return atomic_write(path, lambda tmp: csv.write_csv(table, tmp))


@contextlib.contextmanager
def deferred_interrupt(done: str = "interrupted: the files being written were completed first"):
    """Hold a Ctrl-C that arrives inside the block until the block is done, then raise it as
    :class:`~specfit.errors.Interrupted` with ``done`` (what the completed block left): a command
    that writes several files as one result writes all of them or, stopped before, none (a SIGKILL
    still cannot be held). Only the main thread receives signals; elsewhere a no-op, as in a
    process that ignores SIGINT."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield                         # a process that ignores Ctrl-C (started in the background) goes on ignoring it
        return
    caught = []
    # SIGTERM too where the command handles it as a Ctrl-C (errors.stop_on_sigterm)
    held = [signal.SIGINT] + ([signal.SIGTERM] if sigterm_stops() else [])
    with _signals_caught(held, caught):
        yield
    if caught:
        note_stop_signal(caught[-1])
        raise Interrupted(done)


def user_cache_dir() -> Path:
    """``$XDG_CACHE_HOME``, or ``~/.cache`` where it is unset, empty or relative: the XDG Base
    Directory specification says a relative path there is invalid and ignored (it would name
    another cache in every directory a command runs from)."""
    root = os.environ.get("XDG_CACHE_HOME", "")
    return Path(root) if os.path.isabs(root) else Path.home() / ".cache"
