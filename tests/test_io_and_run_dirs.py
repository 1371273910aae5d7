"""Atomic writes, the run directory's lock, strict JSON, output checks and run.json."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from specfit.errors import SpecFitError
from specfit.io import atomic_write, check_output, file_lock, repeated_path, run_dir_lock, strict_dumps, write_text_atomic
from specfit.runinfo import RUN_INFO_FILE, note_run, write_run_info
from specfit.runtime.run_dir import (CYCLES_FILE, JOURNAL_FILE, OUTPUT_FILE, SUMMARY_FILE, DecodeOutputs,
                                     read_decode_cycles, read_decode_summaries)


def test_atomic_write_leaves_only_the_file_after_success(tmp_path):
    """A successful write moves its temporary file into place: nothing else is left beside it."""
    write_text_atomic(tmp_path / "a.json", "{}")
    write_text_atomic(tmp_path / "a.json", "[1]")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]
    assert (tmp_path / "a.json").read_text() == "[1]"


def test_atomic_write_syncs_the_data_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    """A crash between the rename and the kernel's write-back must not leave an empty file under
    the name: the temporary file's data is synced before it is renamed, then its folder's entry."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(a))), real_replace(a, b)))
    write_text_atomic(tmp_path / "a.json", "{}")
    kinds = [e[0] for e in events]
    assert kinds == ["fsync", "replace", "fsync"]
    assert events[0][1] == events[1][1] != str(tmp_path / "a.json")      # the temporary file, synced
    assert events[2][1] == os.path.realpath(tmp_path)                     # then the folder's entry


def test_atomic_write_interrupted_by_ctrl_c_leaves_the_previous_file_and_no_temporary(tmp_path):
    target = tmp_path / "a.txt"
    target.write_text("old")

    def interrupted(tmp):
        with open(tmp, "w") as f:
            f.write("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(target, interrupted)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"] and target.read_text() == "old"


def test_atomic_write_gives_the_file_the_umasks_mode_not_mkstemps_0600(tmp_path):
    old = os.umask(0o022)
    try:
        write_text_atomic(tmp_path / "r.json", "{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "r.json").stat().st_mode) == 0o644


def test_strict_dumps_writes_every_non_finite_number_as_null():
    assert json.loads(strict_dumps({"a": float("inf"), "b": [float("-inf"), float("nan"), 1.5]})) == \
        {"a": None, "b": [None, None, 1.5]}


def test_a_file_where_an_output_directory_is_meant_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(SpecFitError, match="is a file; expected a directory"):
        check_output(tmp_path / "f", "--out", kind="dir")


def test_the_run_directory_lock_is_exclusive_against_another_open_of_it(tmp_path):
    """Two holders at once (here two opens in one process, as two processes would) are refused."""
    with run_dir_lock(tmp_path / "run", "decode"):
        with pytest.raises(SpecFitError, match="another specfit run is writing this directory"):
            with run_dir_lock(tmp_path / "run", "simulate"):
                pass
    with run_dir_lock(tmp_path / "run", "decode"):      # released: taken again
        pass


def test_a_lock_whose_holder_was_killed_is_taken_without_waiting(tmp_path):
    """The lock is the operating system's: a SIGKILLed holder's goes with its process, though its
    file stays."""
    import signal
    import subprocess
    import sys

    def refuse():
        raise SpecFitError("held")

    lock = tmp_path / "profile.json.lock"
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               f"fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)\n"
                               "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(SpecFitError, match="held"):          # alive: held
            with file_lock(lock, "the lock", refuse):
                pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        holder.stdout.close()
    assert lock.exists()
    with file_lock(lock, "the lock", refuse) as waited:
        assert not waited


def test_read_run_info_is_none_for_a_run_json_that_is_not_an_object(tmp_path):
    from specfit.runinfo import read_run_info

    (tmp_path / "run.json").write_text("[1, 2]")
    assert read_run_info(tmp_path) is None


def test_a_run_directory_of_the_same_command_with_a_described_kind_is_accepted(tmp_path):
    """The demo writes run.json kinds like "decode (specfit demo)": a decode into it is the same
    command and is accepted; a simulate is refused."""
    from specfit.runinfo import check_run_dir, write_run_info

    write_run_info(tmp_path, "decode (specfit demo)")
    assert check_run_dir(tmp_path, "decode") == tmp_path
    with pytest.raises(SpecFitError, match="holds a `specfit decode` run"):
        check_run_dir(tmp_path, "simulate")


def test_a_summary_file_listing_something_other_than_objects_is_one_clear_error(tmp_path):
    from specfit.runtime.run_dir import SUMMARY_FILE, read_decode_summaries

    (tmp_path / SUMMARY_FILE).write_text('[{"policy": "ar", "precision": null}, 3]')
    with pytest.raises(SpecFitError, match="expected a list of per-policy summary objects"):
        read_decode_summaries(tmp_path)
    (tmp_path / SUMMARY_FILE).write_text('[{"policy": "ar", "precision": null}]')
    got = read_decode_summaries(tmp_path)
    assert got[0]["policy"] == "ar" and got[0]["precision"] != got[0]["precision"]     # null read as NaN


def test_a_rerun_into_a_run_directory_replaces_the_last_runs_outputs_at_its_first_cycle(tmp_path):
    """The last run's cycles, journal, records and summary stay while a new run has no result (one
    that fails on its input leaves them as they were), and are gone when its first cycle is
    written: read beside it they would pass for its own. ``start`` (the new run.json) runs then,
    once."""
    from specfit.runtime.run_dir import (CYCLES_FILE, JOURNAL_FILE, OUTPUT_FILE, SUMMARY_FILE, DecodeOutputs,
                                         read_decode_cycles, read_decode_summaries)

    first = DecodeOutputs(tmp_path)
    first.add_cycle({"policy": "ar", "cycle": 0})
    first.summaries.append({"policy": "ar"})
    first.close()
    assert (tmp_path / CYCLES_FILE).is_file() and (tmp_path / SUMMARY_FILE).is_file()
    (tmp_path / JOURNAL_FILE).write_text('{"policy": "ar", "cycle": 0}\n')
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    started = []
    second = DecodeOutputs(tmp_path, start=lambda: started.append(True))
    second.flush()                                  # nothing to write yet: nothing replaced
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before and not started
    second.add_cycle({"policy": "eagle3", "cycle": 0})
    assert started == [True]
    for name in (CYCLES_FILE, OUTPUT_FILE, SUMMARY_FILE):
        assert not (tmp_path / name).exists(), name
    assert list(read_decode_cycles(tmp_path)["policy"]) == ["eagle3"] and read_decode_summaries(tmp_path) == []
    second.add_cycle({"policy": "eagle3", "cycle": 1})
    second.close()
    assert started == [True] and list(read_decode_cycles(tmp_path)["cycle"]) == [0, 1]
    # a writer that sets the rows whole (gpu_check) replaces them at close, its own kept
    third = DecodeOutputs(tmp_path)
    third.records, third.cycles = [{"policy": "ar"}], [{"policy": "ar", "cycle": 0}]
    third.close()
    assert list(read_decode_cycles(tmp_path)["policy"]) == ["ar"] and (tmp_path / OUTPUT_FILE).is_file()


def test_a_ctrl_c_as_the_temporary_file_is_created_leaves_no_temporary(tmp_path, monkeypatch):
    """Python raises a Ctrl-C as soon as a system call returns: one that lands as mkstemp's open
    returns comes before the name of the file it made is known. It is held until the name is, so
    the write ends in KeyboardInterrupt with neither the file nor a temporary left."""
    import signal
    import tempfile

    real = tempfile.mkstemp

    def open_then_ctrl_c(*args, **kwargs):
        made = real(*args, **kwargs)
        signal.raise_signal(signal.SIGINT)
        return made

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        monkeypatch.setattr(tempfile, "mkstemp", open_then_ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            atomic_write(tmp_path / "out.json", lambda tmp: Path(tmp).write_text("{}"))
    finally:
        signal.signal(signal.SIGINT, previous)
    assert list(tmp_path.iterdir()) == []


def test_csv_reads_back_to_the_frame_it_was_written_from(tmp_path):
    """Every value of the frame comes back from the CSV: floats to the bit (the shortest text that
    reads back to each), missing values as empty fields, strings with commas and quotes, bools,
    and list columns (lists and arrays, empty or not, or missing) as JSON lists."""
    import numpy as np
    import pandas as pd

    from specfit.io import write_csv_atomic

    rng = np.random.default_rng(3)
    floats = np.r_[rng.random(50) * 10.0 ** rng.integers(-12, 12, 50), 1.0, 11953766400.0, 1e-300, np.nan]
    n = floats.size
    frame = pd.DataFrame({
        "name": [f'trace, "{i}"' if i % 3 == 0 else f"t{i}" for i in range(n)],
        "policy": ["specfit+cache"] * (n - 1) + [None],
        "count": np.arange(n, dtype=np.int64) * 10**9,
        "maybe": pd.array([i if i % 4 else None for i in range(n)], dtype="Int64"),
        "x": floats,
        "flag": np.arange(n) % 2 == 0,
        "per_layer": [[] if i % 5 == 0 else np.arange(i % 7, dtype=np.int64) if i % 2 else [i, 0, 1] for i in range(n - 1)]
                     + [None],
    })
    path = write_csv_atomic(tmp_path / "cycles.csv", frame)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cycles.csv"]
    back = pd.read_csv(path, keep_default_na=False, na_values=[""], engine="pyarrow")
    assert back.columns.tolist() == frame.columns.tolist()
    assert back["name"].tolist() == frame["name"].tolist()
    assert back["policy"].iloc[:-1].tolist() == frame["policy"].iloc[:-1].tolist() and pd.isna(back["policy"].iloc[-1])
    assert back["count"].tolist() == frame["count"].tolist()
    assert [None if pd.isna(v) else int(v) for v in back["maybe"]] == [None if v is pd.NA else int(v) for v in frame["maybe"]]
    np.testing.assert_array_equal(back["x"].to_numpy(dtype=np.float64), floats)     # NaN where NaN, else equal bits
    assert back["flag"].tolist() == frame["flag"].tolist()
    lists = [None if pd.isna(v) else json.loads(v) for v in back["per_layer"]]
    assert lists == [None if v is None else list(np.asarray(v).tolist()) for v in frame["per_layer"]]
    assert '"trace, \\"0\\""' not in path.read_text() and '"trace, ""0"""' in path.read_text()   # CSV's own quoting


def _last_run(out):
    first = DecodeOutputs(out)
    first.add_cycle({"policy": "ar", "cycle": 0})
    first.records.append({"policy": "ar", "prompt": 0})
    first.summaries.append({"policy": "ar"})
    first.close()
    assert {CYCLES_FILE, OUTPUT_FILE, SUMMARY_FILE} <= {p.name for p in out.iterdir()}


def test_a_record_before_the_first_cycle_replaces_the_last_runs_files_and_is_kept_after_it(tmp_path):
    """A prompt whose output ends at its prefill token gives a record before any cycle: its flush is
    this run's first result, so the last run's cycles and summary go then (not left beside this
    run's decode.jsonl), run.json is written, and the first cycle after it keeps that record."""
    _last_run(tmp_path)
    started = []
    second = DecodeOutputs(tmp_path, start=lambda: started.append(True))
    second.records.append({"policy": "eagle3", "prompt": 0})
    second.flush()
    assert started == [True]
    assert not (tmp_path / CYCLES_FILE).exists() and not (tmp_path / SUMMARY_FILE).exists()
    second.add_cycle({"policy": "eagle3", "cycle": 0})
    lines = (tmp_path / OUTPUT_FILE).read_text().splitlines()
    assert [json.loads(line)["policy"] for line in lines] == ["eagle3"]
    second.close()
    assert started == [True] and list(read_decode_cycles(tmp_path)["policy"]) == ["eagle3"]


def test_a_run_stopped_in_its_first_prompt_writes_an_empty_record_file_not_none(tmp_path):
    """Cycles but no finished (policy, prompt) run: decode.jsonl is written, empty (this run's), and
    the journal is gone."""
    out = DecodeOutputs(tmp_path)
    out.add_cycle({"policy": "ar", "cycle": 0})
    out.close()
    assert (tmp_path / OUTPUT_FILE).read_text() == "" and not (tmp_path / JOURNAL_FILE).exists()
    assert read_decode_summaries(tmp_path) == []


def test_note_run_adds_to_the_notes_already_there(tmp_path):
    write_run_info(tmp_path, "decode", notes=["first"])
    note_run(tmp_path, "second")
    note_run(tmp_path, "third")
    info = json.loads((tmp_path / RUN_INFO_FILE).read_text())
    assert info["notes"] == ["first", "second", "third"] and info["kind"] == "decode"


def test_note_run_writes_nothing_where_there_is_no_readable_run_json(tmp_path):
    note_run(tmp_path, "a note")
    assert not (tmp_path / RUN_INFO_FILE).exists()
    (tmp_path / RUN_INFO_FILE).write_text("[1, 2]")
    note_run(tmp_path, "a note")
    assert (tmp_path / RUN_INFO_FILE).read_text() == "[1, 2]"


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_a_decode_output_directory_loses_a_dead_writers_temporaries_and_keeps_a_live_ones(tmp_path):
    """A SIGKILLed atomic write leaves .NAME.PID-RANDOM.tmp: opening the run directory removes it when
    PID is gone, and leaves one whose writer (this process) is alive."""
    dead = tmp_path / f".summary.json.{_dead_pid()}-abc.tmp"
    live = tmp_path / f".decode.jsonl.{os.getpid()}-abc.tmp"
    dead.write_text("half")
    live.write_text("being written")
    DecodeOutputs(tmp_path)
    assert not dead.exists() and live.exists()


KILLED_RUN_JOURNAL = '{"policy": "ar", "cycle": 0}\n{"policy": "ar", "cycle": 1}\n'


def test_closing_outputs_that_never_had_a_result_keeps_the_last_runs_journal(tmp_path):
    """A rerun that ends before its first result (a crash at its first pass) leaves the journal of a
    killed last run, that run's only copy of its cycles."""
    (tmp_path / JOURNAL_FILE).write_text(KILLED_RUN_JOURNAL)
    DecodeOutputs(tmp_path, start=lambda: None).close()
    assert (tmp_path / JOURNAL_FILE).read_text() == KILLED_RUN_JOURNAL


def test_repeated_path_finds_a_path_given_twice_however_spelled(tmp_path, monkeypatch):
    """The same object twice (a Python caller's list), the same spelling twice, two spellings of one file."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    p = tmp_path / "t.parquet"
    assert repeated_path([p, p]) == str(p)
    assert repeated_path(["t.parquet"] * 2) == "t.parquet"
    assert repeated_path(["t.parquet", "./runs/../t.parquet"], "trace") == "t.parquet and ./runs/../t.parquet (the same trace)"
    assert repeated_path(["t.parquet", "u.parquet", tmp_path / "runs"]) is None


def test_the_records_are_rewritten_as_often_as_that_costs_a_tenth_of_the_run(tmp_path, monkeypatch):
    """decode.jsonl was rewritten whole after every prompt: on a long run of short prompts a growing
    file's rewrites took time quadratic in the prompts (1,600 prompts: 18 s of 43). A rewrite now
    waits until the run since the last has taken ten times its time; the last one always runs."""
    from specfit.runtime import run_dir

    clock = [0.0]
    monkeypatch.setattr(run_dir.time, "perf_counter", lambda: clock[0])
    writes = []

    def timed_write(path, records):          # a rewrite that takes 1 s of the fake clock
        writes.append(len(records))
        clock[0] += 1.0

    monkeypatch.setattr(run_dir, "write_jsonl_atomic", timed_write)
    outputs = DecodeOutputs(tmp_path)
    for prompt in range(30):
        outputs.records.append({"index": prompt})
        outputs.flush()
        clock[0] += 0.5                      # each prompt decodes in half a second
    assert writes[:2] == [1, 21]             # after the first rewrite (1 s), 10 s of decoding before the next
    outputs.close()
    assert writes[-1] == 30 and len(writes) == 3
