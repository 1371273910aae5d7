"""Assemble one report from what ``decode --out``, ``simulate --out`` and ``calibrate`` wrote.

Each input is recognised by its files: a profile JSON (calibration), a directory with
``summary.parquet`` (simulation), a directory with ``cycles.parquet`` and no summary (a live
decode run), a directory with ``sweep.json`` (``specfit sweep``; with ``plan.json`` too, a
``specfit plan``). A directory may also hold a ``profile.json`` (the demo's layout) and a ``run.json``
saying what was run.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd

from .. import __version__
from ..calibrate.profile import load_profile
from ..errors import SpecFitError, one_line
from ..io import deferred_interrupt, not_readable_as, optional_file, read_parquet, repeated_path, write_json_atomic
from ..runinfo import read_run_info
from ..runtime.run_dir import CYCLES_FILE, JOURNAL_FILE, OUTPUT_FILE, read_decode_cycles, read_decode_summaries
from .calibration import calibration_section
from .html import Page
from .live import live_section
from .simulation import simulation_section

__all__ = ["build_report", "classify"]


def classify(path: Path) -> list[str]:
    """The kinds of output found at ``path``: "calibration", "simulation", "live", "sweep", "plan"."""
    if path.is_file():
        if path.suffix == ".json":
            return ["calibration"]
        raise SpecFitError(f"{path}: expected a profile JSON or an output directory of decode / simulate")
    if not path.is_dir():
        raise SpecFitError(f"{path}: " + not_readable_as(path, "a profile JSON or a run directory",
                                                         "no such file or directory"))
    kinds = []
    info = read_run_info(path) or {}
    # a file of a run's that is there but no file (a directory, a link to nothing) is named, not
    # taken for absent (a decode whose cycles.parquet is a directory "decoded no cycle")
    if optional_file(path / "sweep.json", "a sweep's grid (JSON)"):
        kinds.append("sweep")
        if optional_file(path / "plan.json", "a plan's recommendation (JSON)"):
            kinds.append("plan")
    if optional_file(path / "profile.json", "a hardware profile (JSON)"):
        kinds.append("calibration")
    if optional_file(path / "summary.parquet", "a simulation's summary (Parquet)"):
        kinds.append("simulation")
    elif str(info.get("kind", "")).startswith("simulate"):
        raise SpecFitError(f"{path}: a `specfit simulate` output without its summary.parquet (the run was interrupted "
                           "while writing); run the simulation again")
    elif any([optional_file(path / CYCLES_FILE, "a run's cycles (Parquet)"),
              optional_file(path / JOURNAL_FILE, "a run's journal of cycles (JSON lines)")]):
        if not _measured(path / CYCLES_FILE):
            raise SpecFitError(f"{path}: cycles.parquet holds replayed cycles (no measured times) but no "
                               "summary.parquet; expected a `specfit decode --out` run, or a `specfit simulate --out` "
                               "run with both files (run the simulation again)")
        kinds.append("live")
    if not kinds and str(info.get("kind", "")) == "decode" and (path / OUTPUT_FILE).is_file():
        raise SpecFitError(f"{path}: a `specfit decode` run that decoded no cycle (every output ended at the prompt "
                           "pass's token: --max-new-tokens 1, or an end-of-sequence token first); its outputs are in "
                           f"{path / OUTPUT_FILE}, and there are no cycles to report")
    if not kinds:
        raise SpecFitError(f"{path}: found no profile.json, summary.parquet, cycles.parquet or sweep.json; expected "
                           "what `specfit calibrate`, `specfit simulate --out`, `specfit decode --out` or `specfit sweep` "
                           "write")
    return kinds


def demo_parts(path: Path) -> list[Path]:
    """The inputs a ``specfit demo`` directory's report is built from (its decode, its simulation,
    its profile), in the demo's order; any other path as it is."""
    info = read_run_info(path) if path.is_dir() else None
    kind = (info or {}).get("kind")
    if not (isinstance(kind, str) and kind.split()[:1] == ["demo"]):
        return [path]
    parts = [path / "decode", path / "simulate", path / "profile.json"]
    found = [p for p in parts if p.exists()]
    if not found:
        raise SpecFitError(f"{path}: a `specfit demo` directory without its decode/, simulate/ or profile.json (the "
                           "run was interrupted before its first step ended); run the demo again")
    return found


def _measured(cycles: Path) -> bool:
    """Whether a cycle table holds measured cycles (a decode's) rather than replayed ones; True
    when there is no table or it cannot be read (the live section then says what is wrong)."""
    if not cycles.is_file():
        return True
    import pyarrow.parquet as pq

    try:
        if "measured_time_s" not in pq.read_schema(cycles).names:
            return True                  # an older decode's table (cycle_time_s), or one the live section refuses
        measured = pq.read_table(cycles, columns=["measured_time_s"]).column(0).to_numpy(zero_copy_only=False)
    except Exception:  # pyarrow raises several types for damaged files; reading it later says which
        return True
    # a replay writes the column too (CYCLE_COLUMNS), with no value in it
    return measured.size == 0 or bool(np.isfinite(np.asarray(measured, dtype=float)).any())


@contextlib.contextmanager
def _damaged(path: Path, files: str, unit: str = "column"):
    """Tables or JSON that lack a ``unit`` (column, field) the report reads, or hold a value of
    another type, are one error naming the files and what was wrong, not a traceback. (The report
    reads what this version writes; a hand-edited or damaged file ends here.) The warnings a
    damaged value raises on its way (numpy's "invalid value encountered in cast") go with the
    error; a section that builds gives them on."""
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        try:
            yield
        except SpecFitError:
            raise                                           # already says what was wrong
        except KeyError as exc:
            raise SpecFitError(f"{path}: {files}: missing {unit} {exc}; expected the {unit}s the specfit version "
                               f"that reads it writes") from None
        except (ValueError, TypeError, AttributeError, IndexError, OverflowError) as exc:   # inf or 1e300 as a count
            detail = one_line(exc)
            detail = detail if len(detail) <= 120 else detail[:117] + "..."
            raise SpecFitError(f"{path}: {files}: a {unit} holds values of the wrong type or range ({detail})") from None
    for w in raised:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _sweep_sections(page: Page, path: Path, kinds: list[str]) -> None:
    import json

    from ..simulate.dataset import read_results, read_sweep_file
    from .sweep import plan_section, sweep_section

    sweep = read_sweep_file(path)
    if "plan" in kinds:
        try:
            plan = json.loads((path / "plan.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:          # unreadable, not UTF-8, not JSON
            raise SpecFitError(f"{path / 'plan.json'}: not a readable JSON file ({exc})") from None
        with _damaged(path, "plan.json", "field"):
            earlier = _earlier_plan(plan, sweep)
            if earlier:
                page.note(f"{path / 'plan.json'}: {earlier}: its recommendation is left out (the plan that ran the "
                          "sweep stopped before ranking; the same command finishes it)")
            else:
                plan_section(page, plan, str(path))
    with _damaged(path, "sweep.json / results", "field"):
        sweep_section(page, read_results(path), str(path), sweep)


def _earlier_plan(plan: dict, sweep: dict) -> str:
    """How a ``plan.json`` differs from the plan its directory's sweep was run for (a rerun with
    another budget that stopped before writing its own), or "" when it is that plan's."""
    spec = sweep.get("spec")
    ran = spec.get("plan") if isinstance(spec, dict) else None
    if not isinstance(ran, dict):
        return ""
    mem = plan["memory"]
    for key in ("model", "device_bytes", "context_tokens", "reserve_bytes", "dtype"):
        if key in ran and ran[key] != mem[key]:
            return f"written by an earlier plan ({key} {mem[key]!r}) than the sweep's ({key} {ran[key]!r})"
    if "cache_sizes" in ran and ran["cache_sizes"] != plan["cache_sizes"]:
        return f"written by an earlier plan (cache sizes {plan['cache_sizes']}) than the sweep's ({ran['cache_sizes']})"
    return ""


def build_report(inputs: list[Path], out_dir: Path, title: str | None = None, say=None) -> Path:
    """Render every input into ``out_dir/index.html``; returns its path. ``title``: the page's, by
    default "SpecFit report: " and the inputs' names (a browser's tab or history of several reports
    told them apart by nothing else). ``say`` (a function of a line) hears what the page left out
    and why, as the page says it."""
    if not inputs:
        raise SpecFitError("report: expected at least one input (a run directory or a profile JSON)")
    same = repeated_path(inputs, noun="path")
    if same is not None:
        raise SpecFitError(f"report: {same} given twice; expected each input once (its sections would repeat)")
    page = Page(title or "SpecFit report: " + ", ".join(Path(p).resolve().name or str(p) for p in inputs))
    page.heading("What was run")
    runs = []
    plan = []
    for path in [part for given in map(Path, inputs) for part in demo_parts(given)]:
        kinds = classify(path)
        plan.append((path, kinds))
        info = read_run_info(path) if path.is_dir() else None
        versions = (info or {}).get("versions")
        versions = versions if isinstance(versions, dict) else {}      # a damaged run.json says nothing
        runs.append({"input": str(path), "contains": ", ".join(kinds),
                     "command": (info or {}).get("command", "–"), "started": (info or {}).get("started", "–"),
                     # each run's own: the report's code may be another version than the run's
                     "versions": ", ".join(f"{k} {v}" for k, v in versions.items()) or "–"})
    page.table(pd.DataFrame(runs))
    page.facts({"report built with specfit": __version__})
    # a trace, profile or policy named with a '$' is text, not matplotlib's math (in titles, legends
    # and category ticks alike); log axes tick plain numbers, not mathtext (plots.log_x)
    with matplotlib.rc_context({"text.parse_math": False}):
        for path, kinds in plan:
            _sections(page, path, kinds)
    for text in page.notes if say is not None else ():
        say(f"note: {text}")
    index = Path(out_dir) / "index.html"
    with deferred_interrupt(f"interrupted while writing: the report in {out_dir} was completed first"):
        page.save(index)
        write_json_atomic(Path(out_dir) / "inputs.json", [str(p) for p in inputs])
    return index


def _run_notes(info: dict) -> list[str]:
    """The notes a run wrote into its ``run.json`` (``info``) for its readers (the strings of a list ``notes``)."""
    notes = info.get("notes")
    return [note for note in notes if isinstance(note, str)] if isinstance(notes, list) else []


def _sections(page: Page, path: Path, kinds: list[str]) -> None:
    """The sections of one input, each from the files that hold it."""
    info = (read_run_info(path) if path.is_dir() else None) or {}        # its run.json, read once
    if "calibration" in kinds:
        profile_path = path if path.is_file() else path / "profile.json"
        profile = load_profile(profile_path)
        with _damaged(profile_path, "fit / probes", "field"):
            calibration_section(page, profile, str(profile_path))
    if "simulation" in kinds:
        summary = read_parquet(path / "summary.parquet")
        # the page draws one histogram of the cycles: two columns of a file that may hold millions of rows
        cycles = read_parquet(path / "cycles.parquet", columns=["policy", "nodes_verified"]) \
            if (path / "cycles.parquet").is_file() else None
        with _damaged(path, "summary.parquet / cycles.parquet"):
            simulation_section(page, summary, cycles, str(path), _run_notes(info))
    if "live" in kinds:
        with _damaged(path, "cycles.parquet / cycles.jsonl"):
            cycles = read_decode_cycles(path)
        if cycles.empty:
            raise SpecFitError(f"{path / 'cycles.parquet'}: no decode cycles to report")
        if (path / JOURNAL_FILE).is_file():
            # a run that ends or stops removes its journal: a kill (or a run still going) leaves it,
            # with no note in run.json, which only a stop the run saw can write
            page.note(f"{path / JOURNAL_FILE}: the journal of a `specfit decode` that did not end (it was killed, or "
                      f"is still running): this shows the {len(cycles)} cycle(s) it completed, and its "
                      f"{OUTPUT_FILE} and summary.json may be older than them")
        try:
            summaries = read_decode_summaries(path)
        except SpecFitError as exc:               # the cycles are still worth the page
            summaries = []
            page.note(f"{exc}: the table of the model each policy decided with is left out")
        with _damaged(path, "cycles.parquet / summary.json"):
            live_section(page, cycles, str(path), summaries, _run_notes(info), info)
    if "sweep" in kinds:
        _sweep_sections(page, path, kinds)
