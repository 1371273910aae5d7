"""Running a grid's cells on Ray: local by default, or on an existing cluster (``address``).

Each trace (or routing log) is read once by the driver and put into Ray's object store once;
one task per (trace, predictor, acceptance) prepares it (routing logs are first imported with
their drafter preset, one task per pair), and the prepared trace stays in the object store.
Cells are batched into chunks of one prepared trace each, so the per-task cost of Ray is shared by
several replays; a worker deserialises a prepared trace once and keeps it for the chunks that
follow (it is the largest object a task touches). The slowest policies are scheduled first, so
the sweep does not end waiting on one long chunk.

The driver writes each finished chunk as one part file of the dataset
(:mod:`specfit.simulate.dataset`) as soon as it arrives, and skips the cells already there.
"""

from __future__ import annotations

import math
import os
import time
from collections import OrderedDict, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..errors import INTERRUPTS, Interrupted, SpecFitError, interrupted
from .grid import Cell, SweepSpec, TraceSource, import_arguments, policy_cost_rank, run_cell

__all__ = ["require_ray", "ray_session", "run_grid", "SweepRun", "GridInputs", "resolve_inputs", "RAY_MISSING",
           "SweepInterrupted"]

RAY_MISSING = "specfit sweep needs Ray: pip install 'specfit[sweep]'"
_CHUNKS_PER_WORKER = 16      # enough chunks that the last ones are short next to the whole sweep
_MAX_CHUNK_CELLS = 16
_PREPARED_KEPT = 2           # prepared traces a worker keeps deserialised (they are large)


class SweepInterrupted(Interrupted):
    """Ctrl-C during a sweep: what was finished is on disk."""

    def __init__(self, done: int, total: int):
        super().__init__(f"interrupted: {done} of {total} cells are in the dataset; run the same command again to "
                         f"resume")
        self.done, self.total = done, total


def require_ray():
    try:
        import ray
    except ImportError:
        raise SpecFitError(RAY_MISSING) from None
    return ray


@contextmanager
def ray_session(address: str | None = None, num_cpus: int | None = None):
    """Ray for the duration of a sweep: the caller's if Ray is already initialised (left running),
    else a local instance with ``num_cpus`` (default: this machine's cores) or the cluster at
    ``address``, shut down afterwards."""
    ray = require_ray()
    if ray.is_initialized():
        yield ray
        return
    import logging

    options = dict(include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    try:
        with _sigterm_kept():
            _init(ray, address, num_cpus, options)
    except KeyboardInterrupt:                 # stopped while Ray started: what started goes too
        ray.shutdown()
        raise
    try:
        yield ray
    finally:
        ray.shutdown()


@contextmanager
def _sigterm_kept():
    """Keep the command's SIGTERM handler through ``ray.init``, which installs the driver's own (it
    exits at once, status 15, with the core worker's stack dump): a ``kill`` of a sweep stops it as
    a Ctrl-C does, keeping every finished cell and saying so (status 143). A SIGTERM that arrives
    while Ray starts, under Ray's handler, becomes the same stop."""
    import signal
    import threading

    from ..errors import note_stop_signal, sigterm_stops

    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM) if main else None
    ours = sigterm_stops()
    try:
        yield
    except SystemExit as exc:
        if not (ours and exc.code == signal.SIGTERM):
            raise
        note_stop_signal(signal.SIGTERM)
        raise KeyboardInterrupt from None
    finally:
        if main and ours:          # the command's handler, also over one installed outside Python's view;
            signal.signal(signal.SIGTERM, before)   # a library caller keeps Ray's (it shuts Ray down)


def _init(ray, address, num_cpus, options) -> None:
    if address:
        _check_reachable(address)
        try:
            ray.init(address=address, **options)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            raise SpecFitError(f"--address {address!r}: could not join the Ray cluster ({exc})") from None
    else:
        ray.init(num_cpus=num_cpus or os.cpu_count(), **options)


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """A HOST:PORT that nothing listens on fails now, in one line (Ray itself retries for minutes)."""
    import socket

    host, sep, port = address.rpartition(":")
    if not sep or "://" in address or not port.isdigit():
        return          # "auto", "ray://...": Ray resolves those itself
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise SpecFitError(f"--address {address}: no Ray head answers there ({exc.strerror or exc}); expected the "
                           "address `ray start --head` printed, e.g. HOST:6379") from None


@dataclass
class GridInputs:
    """What the driver resolved before any task runs: each source's data (a Trace or a
    RoutingLog with its model metadata) and each cell's cost-model scenario."""

    data: dict           # source name -> Trace | (RoutingLog, model dict)
    scenarios: dict      # Cell.scenario_key -> Scenario


# a scenario's error names the command-line option of the value; a spec file holds it in a field
_SPEC_FIELDS = (("--cost", "cost"), ("--h2d-scale", "h2d_scale"), ("--profile", "profiles"))


def resolve_inputs(spec: SweepSpec, cells: list[Cell]) -> GridInputs:
    """Read every source once and build every scenario in the driver, so bad input fails here
    with one clear message, and workers need no access to the user's files."""
    from ..calibrate.profile import ModelShape
    from ..traces.format import read_trace
    from ..traces.importers import model_for_log, read_routing_log
    from ..traces.synth import MODEL_SHAPES
    from .scenarios import build_scenario
    from .whatif import parse_overrides

    data, shapes = {}, {}
    for src in spec.sources:
        if src.is_routing:
            log = _routing_log(read_routing_log(src.resolved), src)
            # a shape the log is not of is found here, before Ray starts, not on a worker
            model = model_for_log(log, src.import_options.get("shape"),
                                  option=f"{spec.path}: {src.entry}: field 'shape'",
                                  fix=f"give {src.entry} in {spec.path} a 'shape' field (one of {sorted(MODEL_SHAPES)})")
            data[src.name] = (log, model)
            shapes[src.name] = ModelShape.from_trace_meta(model)
        else:
            trace = read_trace(src.resolved, weights=False)
            data[src.name] = trace
            shapes[src.name] = ModelShape.from_trace_meta(trace.model)
    base = Path(spec.path).parent
    scenarios = {}
    for cell in cells:
        key = cell.scenario_key
        if key not in scenarios:
            profile = str(base / cell.profile_source) if cell.profile_source.endswith(".json") else cell.profile_source
            try:
                scenarios[key] = build_scenario(profile, shapes[cell.trace], cell.h2d_scale,
                                                parse_overrides(cell.cost_overrides), cell.rescale)
            except SpecFitError as exc:
                if Path(spec.path).suffix not in (".toml", ".yaml", ".yml"):
                    raise
                # the value came from a field of the spec file, not from the option the message names
                # (a profile of another shape is allowed by the spec's field rescale, not by --rescale)
                message = str(exc).replace("pass --rescale", "set rescale = true in the spec")
                field, option = next(((f, o) for o, f in _SPEC_FIELDS if message.startswith(o)), ("profiles", "--profile"))
                raise SpecFitError(f"{spec.path}: field {field!r}: "
                                   f"{message.removeprefix(option).removeprefix(':').lstrip()}") from None
    return GridInputs(data=data, scenarios=scenarios)


def _routing_log(log, src: TraceSource):
    import numpy as np

    sequences = src.import_options.get("sequences")
    if sequences is not None:
        keep = np.unique(log.sequence, return_index=True)[1]
        first = log.sequence[np.sort(keep)][:sequences]
        log = log.select(np.flatnonzero(np.isin(log.sequence, first)))
    return log


# ------------------------------------------------------------------ tasks (run on Ray workers)
def _import_task(log, model: dict, drafter: str, options: dict):
    from ..traces.importers import import_routing

    return import_routing(log, model, **import_arguments(drafter, options))


def _prepare_task(trace, name: str, predictor: str, acceptance: str):
    from .replay import prepare_trace

    return prepare_trace(name, trace, predictor, acceptance)


_PREPARED: OrderedDict = OrderedDict()


def _prepared(box: list):
    """The prepared trace behind ``box[0]`` (an ObjectRef passed inside a list, so Ray does not
    deserialise it for every chunk), kept for the next chunks on this worker."""
    import ray

    key = box[0].hex()
    if key not in _PREPARED:
        _PREPARED[key] = ray.get(box[0])
        while len(_PREPARED) > _PREPARED_KEPT:
            _PREPARED.popitem(last=False)
    _PREPARED.move_to_end(key)
    return _PREPARED[key]


def _chunk_task(box: list, work: list) -> list[dict]:
    prepared = _prepared(box)
    return [run_cell(prepared, cell, scenario) for cell, scenario in work]


# ------------------------------------------------------------------ the driver
@dataclass
class SweepRun:
    """How a sweep went: cells in the grid, skipped (already in the dataset), computed now."""

    total: int
    skipped: int
    computed: int
    wall_s: float
    replay_s: float
    workers: int
    chunks: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _chunks(cells: list[Cell], size: int) -> list[list[Cell]]:
    by_key = defaultdict(list)
    for cell in cells:
        by_key[cell.prepared_key].append(cell)
    chunks = []
    for group in by_key.values():
        group = sorted(group, key=lambda c: -policy_cost_rank(c.policy))   # stable: grid order within a rank
        chunks += [group[i:i + size] for i in range(0, len(group), size)]
    # slow chunks first across traces too (a chunk's rank is that of its first, slowest cell)
    return sorted(chunks, key=lambda ch: -policy_cost_rank(ch[0].policy))


def run_grid(spec: SweepSpec, cells: list[Cell], inputs: GridInputs, out_dir: Path, done: set[str],
             chunk_cells: int | None = None, on_progress=None, *, ray) -> SweepRun:
    """Replay the cells not in ``done`` on the Ray instance ``ray`` (see :func:`ray_session`),
    writing each finished chunk into ``out_dir``'s dataset. ``on_progress(n_cells, description)``
    is called as chunks finish. Ctrl-C raises :class:`SweepInterrupted` (finished chunks are
    kept; the tasks still running end with the Ray session)."""
    from .dataset import write_part

    start = time.perf_counter()
    pending = [c for c in cells if c.cell_id not in done]
    workers = max(int(ray.cluster_resources().get("CPU", 1)), 1)
    size = chunk_cells or min(_MAX_CHUNK_CELLS, max(1, math.ceil(len(pending) / (workers * _CHUNKS_PER_WORKER))))
    chunks = _chunks(pending, size)
    run = SweepRun(total=len(cells), skipped=len(cells) - len(pending), computed=0, wall_s=0.0, replay_s=0.0,
                   workers=workers, chunks=len(chunks))
    if not chunks:
        return run
    import_remote = ray.remote(_import_task)
    prepare_remote = ray.remote(_prepare_task)
    chunk_remote = ray.remote(_chunk_task)
    needed = {ch[0].prepared_key for ch in chunks}
    sources = {s.name: s for s in spec.sources}
    traces = {}     # source name -> ObjectRef of its Trace (put once, or imported once)
    for name in {key[0] for key in needed}:
        src, data = sources[name], inputs.data[name]
        if src.is_routing:
            log, model = data
            traces[name] = import_remote.remote(ray.put(log), model, src.drafter, src.import_options)
        else:
            traces[name] = ray.put(data)
    preparing = {prepare_remote.remote(traces[key[0]], *key): key for key in needed}
    by_key = defaultdict(list)
    for ch in chunks:
        by_key[ch[0].prepared_key].append(ch)
    running = {}
    try:
        while preparing or running:
            ready, _ = ray.wait(list(preparing) + list(running), num_returns=1)
            ref = ready[0]
            if ref in preparing:
                key = preparing.pop(ref)
                for ch in by_key[key]:
                    work = [(cell, inputs.scenarios[cell.scenario_key]) for cell in ch]
                    running[chunk_remote.remote([ref], work)] = ch
                continue
            chunk = running.pop(ref)
            rows = _get(ray, ref)
            write_part(out_dir, rows)
            run.computed += len(rows)
            run.replay_s += sum(r["replay_s"] for r in rows)
            if on_progress is not None:
                on_progress(len(rows), f"{chunk[-1].trace} {chunk[-1].policy}")
    except INTERRUPTS as exc:
        if not interrupted(exc):
            raise
        # no ray.cancel: cancelling a task whose reply is in flight can abort the driver inside
        # Ray (2.60); shutting down (or the driver exiting) ends the sweep's tasks anyway
        raise SweepInterrupted(run.skipped + run.computed, run.total) from None
    run.wall_s = time.perf_counter() - start
    return run


def _get(ray, ref):
    """A task's result; bad input found on a worker becomes the one-line error it would be locally."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, SpecFitError):
            raise SpecFitError(str(cause)) from None
        raise


def execute(spec: SweepSpec, out_dir: Path, address: str | None = None, num_cpus: int | None = None,
            chunk_cells: int | None = None, show_progress: bool = True, ctx=None, extra: dict | None = None) -> SweepRun:
    """The whole sweep: lock ``out_dir``, check its inputs, record the grid, skip the finished
    cells, run the rest on Ray with a progress bar (cells done / total, ETA). ``extra`` goes into
    ``sweep.json`` (e.g. the plan's memory model). Bad input leaves no directory it created."""
    import shutil

    from .dataset import locked
    from .grid import expand

    require_ray()
    out_dir = Path(out_dir)
    cells = expand(spec)
    created = not out_dir.exists()
    try:
        with locked(out_dir):
            return _execute_locked(spec, cells, out_dir, address, num_cpus, chunk_cells, show_progress, ctx, extra)
    except SpecFitError:
        if created and [p.name for p in out_dir.iterdir()] == [".lock"]:
            shutil.rmtree(out_dir)
        raise


def _execute_locked(spec: SweepSpec, cells: list[Cell], out_dir: Path, address, num_cpus, chunk_cells, show_progress,
                    ctx, extra) -> SweepRun:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from ..runinfo import write_run_info
    from .dataset import PLAN_FILE, done_cell_ids, remove_stale_temporaries, write_sweep_file

    remove_stale_temporaries(out_dir)
    done = done_cell_ids(out_dir)
    finished = all(c.cell_id in done for c in cells)
    # the traces and profiles are checked before the grid is recorded: a spec that names a bad
    # one leaves no sweep.json or run.json (which a report would take for an empty sweep)
    inputs = None if finished else resolve_inputs(spec, cells)
    # a plan's recommendation ranks the grid its plan ran: beside another grid a report would show
    # it as this sweep's (a plan writes its own after this sweep)
    (out_dir / PLAN_FILE).unlink(missing_ok=True)
    write_sweep_file(out_dir, {**spec.to_dict(), **(extra or {})}, [c.params() for c in cells])
    write_run_info(out_dir, "sweep", ctx)
    if finished:
        return SweepRun(total=len(cells), skipped=len(cells), computed=0, wall_s=0.0, replay_s=0.0, workers=0,
                        chunks=0)
    console = Console(stderr=True)
    columns = (TextColumn("[bold]sweep"), BarColumn(), MofNCompleteColumn(), TextColumn("cells"),
               TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.description}"))
    with ray_session(address, num_cpus) as ray, \
            Progress(*columns, console=console, disable=not show_progress, transient=True) as bar:
        already = sum(c.cell_id in done for c in cells)
        task = bar.add_task("starting", total=len(cells), completed=already)
        return run_grid(spec, cells, inputs, out_dir, done, chunk_cells, ray=ray,
                        on_progress=lambda n, what: bar.update(task, advance=n, description=what))
