"""The output directory of ``specfit decode --out``: what is in it, how it is written so that
nothing is ever half-written and a killed run keeps every complete cycle, and how it is read back
(by ``specfit report`` and ``specfit calibrate --refit``)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..errors import SpecFitError
from ..io import (atomic_write, json_text, nulls_as_nan, optional_file, read_parquet, remove_stale_temporaries,
                  strict_dumps, write_json_atomic, write_jsonl_atomic)

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["DecodeOutputs", "read_decode_cycles", "read_decode_summaries", "OUTPUT_FILE", "CYCLES_FILE", "SUMMARY_FILE", "JOURNAL_FILE"]

OUTPUT_FILE = "decode.jsonl"
CYCLES_FILE = "cycles.parquet"
SUMMARY_FILE = "summary.json"
JOURNAL_FILE = "cycles.jsonl"


class DecodeOutputs:
    """The files under ``--out`` (a previous run's replaced when this one has its first result): every cycle
    appended to the ``cycles.jsonl`` journal as it completes, so that even a killed run keeps each
    complete cycle; ``decode.jsonl`` and ``summary.json`` rewritten whole after a prompt (atomic:
    never half-written), as often as that costs at most a tenth of the run (a long run of short
    prompts rewrote a growing file after each: time quadratic in the prompts, 1,600 prompts spent
    18 s of 43 there), and once more when the run ends or stops; ``cycles.parquet`` written once, when the run ends or stops, which then
    removes the journal (rewriting it after each prompt cost time quadratic in the prompts, a
    visible pause per prompt on a long run: ``benchmarks/RESULTS.md``, "Stop 50: four more
    audits"). :func:`read_decode_cycles` reads both. ``cycles`` are rows of
    :data:`specfit.accounting.CYCLE_COLUMNS` with their keys.

    A rerun into a directory replaces the last run's files (and ``start()`` writes this run's
    ``run.json``) when its first cycle or record is written, not before: a rerun that fails on
    its input, or is stopped, before it has a result leaves the last run as it was, and none of
    the last run's files is ever read beside this run's cycles."""

    def __init__(self, out_dir: Path | None, start: Callable[[], None] | None = None):
        self.out_dir = out_dir
        self.records: list[dict] = []
        self.cycles: list[dict] = []
        self.summaries: list[dict] = []
        self._journal = None
        self._next_write = 0.0          # perf_counter before which a rewrite of the records waits
        self._start, self._started = start, out_dir is None
        if out_dir is not None:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            remove_stale_temporaries(out_dir)

    def _begin(self) -> None:
        """This run's first result: the last run's files go, this run's ``run.json`` is written."""
        if self._started:
            return
        for name in (JOURNAL_FILE, CYCLES_FILE, OUTPUT_FILE, SUMMARY_FILE):
            (Path(self.out_dir) / name).unlink(missing_ok=True)
        if self._start is not None:
            self._start()
        self._started = True

    def add_cycle(self, row: dict) -> None:
        self.cycles.append(row)
        if self.out_dir is None:
            return
        journal = Path(self.out_dir) / JOURNAL_FILE
        try:
            if self._journal is None:
                self._begin()
                self._journal = open(journal, "a", encoding="utf-8")
            self._journal.write(strict_dumps(row) + "\n")      # strict JSON: a NaN figure as null
            self._journal.flush()
        except OSError as exc:
            # a full disk's error names no file: the journal it was written to is the one
            if exc.filename is None:
                exc.filename = str(journal)
            raise

    def flush(self, final: bool = False) -> None:
        """``decode.jsonl`` and ``summary.json`` as they stand (the cycles are in the journal); but
        for the ``final`` one, only once the run since the last rewrite has taken ten times its
        time."""
        if self.out_dir is None or not (self.records or self.summaries or self._started):
            return
        self._begin()
        start = time.perf_counter()
        if not final and start < self._next_write:
            return
        write_jsonl_atomic(self.out_dir / OUTPUT_FILE, self.records)
        if self.summaries:
            write_json_atomic(self.out_dir / SUMMARY_FILE, self.summaries)
        now = time.perf_counter()
        self._next_write = now + 10 * (now - start)

    def close(self) -> None:
        """Every cycle into ``cycles.parquet``: the journal has served its purpose."""
        if self.out_dir is not None and self.cycles:
            import pandas as pd

            self._begin()           # cycles set whole, not added one by one: the last run's files go first
            frame = pd.DataFrame(self.cycles)
            atomic_write(self.out_dir / CYCLES_FILE, lambda tmp: frame.to_parquet(tmp, index=False))
        self.flush(final=True)
        if self._journal is not None:
            self._journal.close()
            self._journal = None
        if self._started and self.out_dir is not None:
            # only this run's journal: before its first result the journal is the last run's (a killed
            # run's cycles, which a rerun that failed before its first cycle must leave as they were)
            (Path(self.out_dir) / JOURNAL_FILE).unlink(missing_ok=True)


def read_decode_cycles(out_dir: str | Path) -> "pd.DataFrame":
    """The cycles a ``specfit decode --out`` run kept: ``cycles.parquet``, plus the journal's
    complete lines beyond it when the run was killed before it could write them (a torn last line
    is left out)."""
    import pandas as pd

    out_dir = Path(out_dir)
    parquet, journal = out_dir / CYCLES_FILE, out_dir / JOURNAL_FILE
    frame = read_parquet(parquet) if optional_file(parquet, "a run's cycles (Parquet)") else pd.DataFrame()
    if optional_file(journal, "a run's journal of cycles (JSON lines)"):
        rows = []
        try:
            lines = journal.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise SpecFitError(f"{journal}: not a readable journal of cycles ({exc})") from None
        for line in lines:
            try:
                rows.append(nulls_as_nan(json.loads(line)))     # a figure without a value: null in the file
            except json.JSONDecodeError:
                break          # the line being written when the run was killed
        if len(rows) > len(frame):
            frame = pd.DataFrame(rows)
    return frame


def read_decode_summaries(out_dir: str | Path) -> list:
    """The per-policy summaries a ``specfit decode --out`` run wrote (``summary.json``); none when
    it has none (a run stopped before writing it). The file is written whole or not at all, so one
    that does not read as a list of objects was damaged afterwards: that is an error naming it."""
    path = Path(out_dir) / SUMMARY_FILE
    if not optional_file(path, "the run's per-policy summaries (JSON)"):
        return []
    try:
        summaries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:               # unreadable, not UTF-8, not JSON
        raise SpecFitError(f"{path}: not a readable JSON file ({exc}); expected the run's per-policy summaries") from None
    if not (isinstance(summaries, list) and all(isinstance(s, dict) for s in summaries)):
        raise SpecFitError(f"{path}: expected a list of per-policy summary objects, got {json_text(summaries)}")
    return [nulls_as_nan(s) for s in summaries]     # a precision of no predictions: null in the file
