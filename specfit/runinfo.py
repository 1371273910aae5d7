"""What was run: the command line, versions and machine, kept next to every output directory
(``run.json``) so a report can say how to reproduce what it shows."""

from __future__ import annotations

import functools
import hashlib
import json
import platform
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

from .io import write_json_atomic

__all__ = ["run_info", "write_run_info", "read_run_info", "check_run_dir", "RUN_INFO_FILE", "source_digest"]

RUN_INFO_FILE = "run.json"


def run_info(kind: str, ctx=None, **extra) -> dict:
    """``ctx``: the command's ``typer.Context``, from which the full command line is rebuilt."""
    from . import __version__

    # the version string stays while the code changes: the digest of its source tells two apart
    versions = {"specfit": __version__, "specfit_source": source_digest(), "python": platform.python_version()}
    for module in ("torch", "numpy", "transformers"):
        mod = sys.modules.get(module)
        if mod is not None:
            versions[module] = getattr(mod, "__version__", "?")
    return {
        "kind": kind,
        "command": _command_line(ctx),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "versions": versions,
        **extra,
    }


@functools.lru_cache(maxsize=None)
def source_digest() -> str:
    """A digest of the package's Python source (names and bytes of every ``.py`` file under it)."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _command_line(ctx) -> str:
    """The running command with every option it received, rebuilt from its CLI context (right
    however the command was invoked), or the process's argv without one."""
    if ctx is None:
        argv = list(sys.argv)
        if argv and Path(argv[0]).name == "specfit":
            argv[0] = "specfit"   # the entry point, not the path of the virtual environment it lives in
        return shlex.join(argv)
    # the command's name and its groups', under the program's name however it was started
    # (``python -m specfit`` names the root "python -m specfit", not a runnable word)
    names, c = [], ctx
    while c.parent is not None:
        names.append(c.info_name)
        c = c.parent
    words = ["specfit", *reversed(names)]
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if value is False and param.default is not False and getattr(param, "secondary_opts", None):
            # an option on by default, turned off (--frozen-profile, --no-price-uncertainty): said so
            words.append(max(param.secondary_opts, key=len))
            continue
        if value is None or value is False or value == () or value == []:
            continue
        if param.param_type_name == "argument":
            words += [str(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
            continue
        flag = max(param.opts, key=len)
        if value is True:
            words.append(flag)
        elif isinstance(value, (list, tuple)):
            for v in value:
                words += [flag, str(v)]
        elif value != param.default:
            words += [flag, str(value)]
    return shlex.join(words)


def write_run_info(out_dir: str | Path, kind: str, ctx=None, **extra) -> Path:
    return write_json_atomic(Path(out_dir) / RUN_INFO_FILE, run_info(kind, ctx, **extra))


def note_run(out_dir: str | Path, note: str) -> None:
    """Add ``note`` to the notes of the directory's ``run.json`` (for its readers: a report shows
    them); nothing when it has no readable one."""
    info = read_run_info(out_dir)
    if info is None:
        return
    notes = info.get("notes") if isinstance(info.get("notes"), list) else []
    write_json_atomic(Path(out_dir) / RUN_INFO_FILE, {**info, "notes": [*notes, note]})


def read_run_info(out_dir: str | Path) -> dict | None:
    """The directory's ``run.json``; None when there is none or it cannot be read as a JSON object
    (what was run is then unknown, which a report says; it is not an error there)."""
    path = Path(out_dir) / RUN_INFO_FILE
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):             # missing, unreadable, not UTF-8, not JSON
        return None
    return info if isinstance(info, dict) else None


def check_run_dir(out_dir: str | Path | None, kind: str, option: str = "--out", files: tuple[str, ...] = ()) -> Path | None:
    """``out_dir`` checked as a directory to write a ``kind`` run (decode, simulate, sweep, demo)
    into (:func:`~specfit.io.check_output`), and refused when it holds another command's run: their
    files would mix (a decode's cycles beside a simulation's summary), and a report would read them
    as one run. A new or empty directory, one without a ``run.json`` and a run of the same kind
    (rewritten, or a sweep resumed) are fine. ``files``: the names the run writes there (and
    ``run.json``), each refused when something other than a regular file holds it (a directory of
    that name), before the run's work rather than when it writes."""
    from .io import check_output

    path = check_output(out_dir, option, kind="dir")
    if path is None or not path.is_dir():
        return path
    for name in (RUN_INFO_FILE, *files):
        check_output(path / name, option, kind="file")
    held = (read_run_info(path) or {}).get("kind")      # no readable run.json: nothing says what it holds
    if isinstance(held, str) and held.split() and held.split()[0] != kind:
        from .errors import SpecFitError

        raise SpecFitError(f"{option} {out_dir}: holds a `specfit {held.split()[0]}` run ({RUN_INFO_FILE}); "
                           f"expected a new directory or a {kind} run to replace")
    return path
