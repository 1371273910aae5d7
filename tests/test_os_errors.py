"""What the file system can do to an output: a device, a FIFO or a link where a file goes, a link
to nothing, a name too long, a full disk. Each ends as one line naming the path (status 2), before
any work where it can be seen then, and nothing that was there is replaced or left half-written."""

from __future__ import annotations

import os
import stat

import pyarrow.parquet as pq
import pytest

from cli_helpers import invoke, one_line_error
from specfit.errors import SpecFitError
from specfit.io import atomic_write, write_text_atomic
from trace_helpers import SAMPLE_OLMOE

SYNTH = ["traces", "synth", "--shape", "olmoe-1b-7b", "--tokens", "16", "--sequence-tokens", "16", "--out"]
SIMULATE = ["simulate", "--trace", SAMPLE_OLMOE, "--policies", "ar", "--cache-experts", "0", "--out"]


def test_a_fifo_where_a_file_goes_is_refused_and_left_a_fifo(tmp_path):
    fifo = tmp_path / "fifo.parquet"
    os.mkfifo(fifo)
    one_line_error(invoke(*SYNTH, fifo), str(fifo), "not a regular file")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    with pytest.raises(SpecFitError, match="not a regular file"):        # any writer, checked or not
        write_text_atomic(fifo, "x")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_a_link_to_a_file_is_written_through_and_stays_a_link(tmp_path):
    target = tmp_path / "real" / "trace.parquet"
    target.parent.mkdir()
    target.write_text("old")
    link = tmp_path / "link.parquet"
    link.symlink_to(target)
    assert invoke(*SYNTH, link).exit_code == 0
    assert link.is_symlink() and pq.read_metadata(target).num_rows > 0
    assert not [p for p in target.parent.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("make", ["dangling", "loop"])
def test_a_link_to_nothing_is_refused_before_any_work(tmp_path, make):
    link = tmp_path / "link"
    if make == "dangling":
        link.symlink_to(tmp_path / "gone" / "x")
    else:
        (tmp_path / "other").symlink_to(link)
        link.symlink_to(tmp_path / "other")
    one_line_error(invoke(*SIMULATE, link), str(link), "symbolic link to nothing")         # a run directory
    one_line_error(invoke(*SYNTH, link / "x.parquet"), str(link), "symbolic link to nothing")  # a link on the way
    one_line_error(invoke(*SYNTH, link), str(link), "symbolic link to nothing")            # the file itself
    assert os.path.islink(link) and not (tmp_path / "gone").exists()
    with pytest.raises(SpecFitError, match="symbolic link to nothing"):
        write_text_atomic(link, "x")


def test_a_name_too_long_is_one_line(tmp_path):
    long = tmp_path / ("L" * 300 + ".parquet")
    one_line_error(invoke(*SYNTH, long), "File name too long")
    one_line_error(invoke(*SIMULATE, tmp_path / ("D" * 300)), "File name too long")


def test_a_full_disk_mid_write_is_one_line_and_keeps_the_file_that_was_there(tmp_path, monkeypatch):
    out = tmp_path / "trace.parquet"
    assert invoke(*SYNTH, out).exit_code == 0
    before = out.read_bytes()

    def full(*args, **kwargs):                # as pyarrow raises it: an OSError that names no file
        raise OSError("Error writing bytes to file. Detail: [errno 28] No space left on device")

    monkeypatch.setattr(pq, "write_table", full)
    one_line_error(invoke(*SYNTH, out), str(out), "No space left on device")     # the file being written
    assert out.read_bytes() == before and not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_atomic_write_refuses_a_directory_and_writes_nothing(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(SpecFitError, match="a directory"):
        atomic_write(tmp_path / "d", lambda tmp: open(tmp, "w").close())
    assert (tmp_path / "d").is_dir() and not list((tmp_path / "d").iterdir())


def test_a_second_run_into_a_directory_being_written_is_refused(tmp_path, monkeypatch):
    from specfit.assets import demo_prompts_path, tiny_moe_dir
    from specfit.io import run_dir_lock
    from specfit.runtime import loader

    real_load_model = loader.load_model

    def not_while_locked(*args, **kwargs):     # decode is refused before it loads (or calibrates) anything
        assert not locked, "decode loaded the model while another run held its directory"
        return real_load_model(*args, **kwargs)

    monkeypatch.setattr(loader, "load_model", not_while_locked)
    locked = True

    out = tmp_path / "run"
    decode = ["decode", "--model", tiny_moe_dir(), "--prompts", demo_prompts_path(), "--cache-experts", "4",
              "--policy", "ar", "--profile", "pcie4", "--max-new-tokens", "2", "--out", out]
    with run_dir_lock(out, "decode"):          # another run holds it
        one_line_error(invoke(*SIMULATE, out), str(out), "another specfit run is writing this directory")
        one_line_error(invoke(*decode), str(out), "another specfit run is writing this directory")
        assert [p.name for p in out.iterdir()] == [".lock"]
    locked = False
    assert invoke(*decode).exit_code == 0       # once it is done


def test_an_input_that_is_a_fifo_is_named_as_one_not_as_missing(tmp_path):
    fifo = tmp_path / "in.parquet"
    os.mkfifo(fifo)
    for args in (["traces", "validate", fifo], ["simulate", "--trace", fifo], ["sweep", fifo], ["report", fifo]):
        one_line_error(invoke(*args), str(fifo), "not a regular file")
    spec = tmp_path / "grid.toml"
    spec.write_text('traces = ["in.parquet"]\n')
    one_line_error(invoke("sweep", spec, "--out", tmp_path / "s"), "field 'traces'", "not a regular file")


@pytest.mark.parametrize("name", ["summary.parquet", "run.json"])
def test_a_directory_where_a_result_file_goes_is_refused_before_the_replay(tmp_path, name):
    out = tmp_path / "run"
    (out / name).mkdir(parents=True)
    one_line_error(invoke(*SIMULATE, out), str(out / name), "is a directory")
    assert (out / name).is_dir() and not (out / "cycles.parquet").exists()


@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_a_lock_file_that_is_a_link_or_a_fifo_is_refused_and_left_alone(tmp_path, kind):
    # opening it for writing would have truncated the link's target, or waited forever on the FIFO
    out = tmp_path / "run"
    out.mkdir()
    target = tmp_path / "precious"
    target.write_text("keep me")
    if kind == "link":
        (out / ".lock").symlink_to(target)
    else:
        os.mkfifo(out / ".lock")
    one_line_error(invoke(*SIMULATE, out), ".lock")
    assert target.read_text() == "keep me"
