"""A sweep's results on disk: one directory, one Parquet part file per finished chunk of cells.

Layout of a sweep directory:

    sweep.json              the spec and every cell of the grid (ids and parameters), in grid order
    run.json                the command that ran it (see :mod:`specfit.runinfo`)
    results/part-*.parquet  one row per finished cell: the replay summary plus the cell's parameters
                            (the speed-ups vs ``ar`` / ``eagle3``: :func:`read_results` computes them)
    .lock                   held while a sweep writes here (a second one is refused)

Every file appears whole or not at all (:func:`specfit.io.atomic_write`): a part is written to a
temporary file and renamed into place once its chunk is done, so a sweep killed at any moment
leaves finished parts and, at worst, a temporary file that the next run removes. The cells already
in ``results/`` are skipped on restart; the part file is the commit point of its cells.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pandas as pd

from ..errors import SpecFitError
from ..io import atomic_write, read_parquet, run_dir_lock, write_json_atomic

__all__ = ["SWEEP_FILE", "PLAN_FILE", "RESULTS_DIR", "is_sweep_dir", "locked", "remove_stale_temporaries", "done_cell_ids",
           "write_part", "write_sweep_file", "read_sweep_file", "read_results", "fill_speedups", "part_files",
           "layer_ahead_wide", "LAYER_AHEAD_ROWS", "LAYER_AHEAD_COLUMNS"]

SWEEP_FILE = "sweep.json"
PLAN_FILE = "plan.json"          # `specfit plan`'s recommendation, beside the sweep it ran
RESULTS_DIR = "results"
_SPEEDUPS = ("speedup_vs_ar", "speedup_vs_eagle3")
# what identifies a baseline row's group: every cell parameter but the policy
_GROUP_COLUMNS = ("trace", "source", "drafter", "profile", "profile_source", "h2d_scale", "cost_overrides", "rescale",
                  "cache_experts", "cache_mode", "cache_policy", "predictor", "acceptance", "max_levels",
                  "price_uncertainty", "inputs_digest", "layer_ahead")


def is_sweep_dir(path: Path) -> bool:
    return (Path(path) / SWEEP_FILE).is_file()


def locked(out_dir: Path):
    """Hold the sweep directory's lock: two sweeps writing the same dataset would compute cells twice."""
    return run_dir_lock(out_dir, "sweep")


def part_files(out_dir: Path) -> list[Path]:
    return sorted((Path(out_dir) / RESULTS_DIR).glob("part-*.parquet"))


def remove_stale_temporaries(out_dir: Path) -> int:
    """Remove temporary files a killed sweep left behind, in the dataset and its results (only
    while holding the lock); returns how many."""
    from ..io import remove_stale_temporaries as remove_in

    return remove_in(out_dir) + remove_in(Path(out_dir) / RESULTS_DIR)


def done_cell_ids(out_dir: Path) -> set[str]:
    """The ids of the cells whose rows are in the dataset."""
    done: set[str] = set()
    for part in part_files(out_dir):
        done.update(read_parquet(part, ["cell_id"], "sweep part file", "remove it to recompute its cells")["cell_id"])
    return done


def write_part(out_dir: Path, rows: list[dict]) -> Path:
    """Write one finished chunk's rows as a new part file (named after its cells, so a part is
    never overwritten by another chunk's)."""
    frame = pd.DataFrame(rows)
    if "static_n" in frame:
        frame["static_n"] = pd.array([None if pd.isna(v) else int(v) for v in frame["static_n"]], dtype="Int64")
    # a speed-up needs its baseline's cell, which another chunk may hold: the dataset computes it
    # when it is read (read_results), and a part stores no column of empty speed-ups
    frame = frame.drop(columns=[c for c in _SPEEDUPS if c in frame])
    name = hashlib.sha256(",".join(frame["cell_id"]).encode()).hexdigest()[:16]
    path = Path(out_dir) / RESULTS_DIR / f"part-{name}.parquet"
    return atomic_write(path, lambda tmp: frame.to_parquet(tmp, index=False))


def write_sweep_file(out_dir: Path, spec: dict, cells: list[dict]) -> Path:
    return write_json_atomic(Path(out_dir) / SWEEP_FILE, {"spec": spec, "cells": cells})


def read_sweep_file(out_dir: Path) -> dict:
    path = Path(out_dir) / SWEEP_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecFitError(f"{out_dir}: no {SWEEP_FILE}; expected the output directory of `specfit sweep`") from None
    except (OSError, ValueError) as exc:          # unreadable, not UTF-8, not JSON
        raise SpecFitError(f"{path}: not a readable JSON file ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("cells"), list):
        raise SpecFitError(f"{path}: expected an object with a 'cells' list")
    return data


def read_results(out_dir: Path, current_only: bool = True) -> pd.DataFrame:
    """Every finished cell's row, in grid order, with the speed-ups vs ``ar`` / ``eagle3`` filled
    in where the baseline's cell of the same setting is in the grid. ``current_only``: keep only
    the cells of the grid in ``sweep.json`` (a directory reused with a changed spec keeps the old
    parts, which a later spec may need again)."""
    parts = part_files(out_dir)
    frames = []
    for part in parts:
        frames.append(read_parquet(part, what="sweep part file"))
    if not frames:
        return pd.DataFrame(columns=["cell_id"])
    frame = _numeric_where_numbers(pd.concat(frames, ignore_index=True))
    # parts written before the axis: not recounted
    frame["layer_ahead"] = frame["layer_ahead"].fillna("none") if "layer_ahead" in frame else "none"
    dup = frame["cell_id"][frame["cell_id"].duplicated()]
    if len(dup):
        raise SpecFitError(f"{out_dir}: cell {dup.iloc[0]} appears in two part files; remove one of them")
    if current_only and is_sweep_dir(out_dir):
        order = {c["cell_id"]: i for i, c in enumerate(read_sweep_file(out_dir)["cells"])}
        frame = frame[frame["cell_id"].isin(order)]
        frame = frame.iloc[frame["cell_id"].map(order).argsort(kind="stable")].reset_index(drop=True)
    return fill_speedups(frame)


def _numeric_where_numbers(frame: pd.DataFrame) -> pd.DataFrame:
    """A figure that is missing in every row of a part (a chunk of policies it does not apply
    to, e.g. the layer-ahead recount of the cache-lever policies) is stored as a column of nulls,
    which read beside other parts' numbers makes the whole column text: such a column, every
    value a number or missing, is numbers again."""
    for column in frame.columns[frame.dtypes == object]:
        values = frame[column].dropna()
        if len(values) and all(isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
                               for v in values):
            frame[column] = pd.to_numeric(frame[column])
    return frame


def fill_speedups(frame: pd.DataFrame) -> pd.DataFrame:
    """``speedup_vs_ar`` and ``speedup_vs_eagle3`` from the ``ar`` / ``eagle3`` row of each
    setting (every cell parameter but the policy equal, and but ``layer_ahead``: a recount
    changes none of the replay's figures, so a baseline recounted otherwise, or not at all, is the
    same replay)."""
    from ..accounting import with_speedups

    return with_speedups(frame, [c for c in _GROUP_COLUMNS if c in frame.columns and c != "layer_ahead"])


_LAYER_AHEAD = ("layer_ahead_tokens_per_s", "layer_ahead_hidden_share", "layer_ahead_precision")
# what the sweep's table and its report say of layer_ahead_wide's rows and columns
LAYER_AHEAD_ROWS = "settings (a cell and its layer_ahead recounts: one row)"
LAYER_AHEAD_COLUMNS = ("+LA NAME tokens/s: the cell recounted with copies of the next layer's experts made while a "
                       "layer computes (the spec's layer_ahead NAME, as simulate --layer-ahead); – for a policy with "
                       "cache levers (not recounted) or a recount not in the dataset yet; the other figures are the "
                       "replay's, the same whatever layer_ahead")


def layer_ahead_wide(frame: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """``frame``'s rows one per setting whatever its ``layer_ahead`` (a recount changes none of a
    row's other figures), each recounted prefetcher's tokens/s a column ``+LA NAME tokens/s``;
    returns the frame and those columns (none where no cell was recounted)."""
    if "layer_ahead" not in frame:
        return frame, []
    recounted = frame[frame["layer_ahead"] != "none"]
    if "layer_ahead_tokens_per_s" in recounted:
        recounted = recounted[recounted["layer_ahead_tokens_per_s"].notna()]
    keys = [c for c in _GROUP_COLUMNS + ("policy",) if c in frame and c != "layer_ahead"]
    wide = frame.drop_duplicates(subset=keys, keep="first").drop(
        columns=["layer_ahead", *[c for c in _LAYER_AHEAD if c in frame]])
    added = []
    for name in dict.fromkeys(recounted["layer_ahead"]) if len(recounted) else ():
        column = f"+LA {name} tokens/s"
        part = recounted[recounted["layer_ahead"] == name][[*keys, "layer_ahead_tokens_per_s"]]
        wide = wide.merge(part.rename(columns={"layer_ahead_tokens_per_s": column}), on=keys, how="left")
        added.append(column)
    return wide, added
