"""The trace format: an in-memory :class:`Trace` of plain arrays, and its Parquet file.

A trace file is one Parquet file with **one row per draft-tree node**; the rows of one cycle are
consecutive and start with its root (node 0). Cycle-level columns (``sequence``, ``position`` and,
for live recordings, the measured cycle values) repeat on every row of their cycle, which Parquet's
run-length encoding stores for almost nothing, so ``pandas.read_parquet(path)`` is directly a
per-node table and ``groupby("cycle").first()`` the per-cycle one.

Expert sets are fixed-size list columns of ``n_layers * top_k`` ids (layer-major, router rank
order where the recorder knew it); in memory they are ``[nodes, layers, top_k]`` arrays.

The file-level metadata (a JSON object under the Parquet key ``specfit.trace``) holds the schema
version, the model shape, the drafter, the workload, how the trace was recorded and what in it is
real and what synthesised. Reading checks the version and the columns and fails with one
:class:`~specfit.errors.SpecFitError` line naming the file, the field and the expectation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import SpecFitError, one_line
from ..io import atomic_write, json_text, not_readable_as, strict_dumps
from ..tree import DraftTree
from .validate import check_meta, validate_trace

__all__ = ["SCHEMA_VERSION", "METADATA_KEY", "Trace", "read_trace", "write_trace", "validate_trace"]

SCHEMA_VERSION = 1
METADATA_KEY = b"specfit.trace"
UNKNOWN = -1  # verdict / expert placeholder where the recorder did not know the value

# (column, arrow type or None for the expert lists, required, description) - the README's table
# is written from the same facts
NODE_COLUMNS = (
    ("cycle", pa.int32(), True, "cycle index, rows of a cycle are consecutive"),
    ("sequence", pa.int32(), True, "prompt / request the cycle belongs to"),
    ("position", pa.int32(), True, "index of the root token in the sequence's reference output"),
    ("node", pa.int16(), True, "node id in the cycle's tree, 0 = root"),
    ("parent", pa.int16(), True, "parent node id, -1 for the root"),
    ("depth", pa.int16(), True, "draft level of the node, 0 for the root"),
    ("token", pa.int32(), True, "token id of the node (root: the last committed token)"),
    ("draft_logprob", pa.float32(), True, "drafter's log-probability of the token given its parent (root: 0)"),
    ("path_prob", pa.float64(), True, "drafter's probability of the whole path root->node"),
    ("verdict", pa.int32(), True, "target's greedy next token at this node; null where unknown"),
    ("true_experts", None, True, "experts the target routed the node to, [layers * top_k]; null where unknown"),
    ("predicted_experts", None, False, "experts predicted at draft time, [layers * top_k]; null where not recorded"),
    ("verified", pa.bool_(), False, "live runs: the node was in the verified subtree"),
    ("true_expert_weights", None, False, "router weights of true_experts, same order (imported logs that "
                                         "record them); null where unknown"),
)
# live recordings: measured per-cycle values (repeated on the cycle's rows)
SLOT_COLUMNS = ("true_experts", "predicted_experts", "true_expert_weights")   # [layers x top_k] per row
_BATCH = 1 << 13                 # rows per record batch read (bigger batches decode with more memory)
MEASURED_COLUMNS = ("measured_time_s", "measured_draft_s", "measured_verify_s", "measured_bytes_h2d")


@dataclass
class Trace:
    """A trace in memory: cycle arrays ``[cycles]`` and node arrays ``[nodes]`` (all cycles
    concatenated; cycle c owns rows ``offsets[c]:offsets[c + 1]``).

    ``verdict`` and the expert arrays hold :data:`UNKNOWN` (-1) where not known; the ``*_known``
    masks say which rows are real values. ``meta`` is the JSON metadata (see the module docstring).
    """

    meta: dict
    offsets: np.ndarray            # int64 [cycles + 1]
    sequence: np.ndarray           # int32 [cycles]
    position: np.ndarray           # int32 [cycles]
    parent: np.ndarray             # int16 [nodes], -1 for roots
    depth: np.ndarray              # int16 [nodes]
    token: np.ndarray              # int32 [nodes]
    draft_logprob: np.ndarray      # float32 [nodes]
    path_prob: np.ndarray          # float64 [nodes]
    verdict: np.ndarray            # int32 [nodes], -1 where unknown
    true_experts: np.ndarray       # int16 [nodes, layers, top_k], -1 rows where unknown
    predicted_experts: np.ndarray | None = None   # int16 [nodes, layers, top_k] or None
    verified: np.ndarray | None = None            # bool [nodes] or None
    true_expert_weights: np.ndarray | None = None  # float32 [nodes, layers, top_k], NaN rows where unknown
    measured: dict[str, np.ndarray] = field(default_factory=dict)  # per-cycle float64 [cycles]

    # ------------------------------------------------------------------ shape
    @property
    def n_cycles(self) -> int:
        return int(self.offsets.size - 1)

    @property
    def n_nodes(self) -> int:
        return int(self.parent.size)

    @property
    def model(self) -> dict:
        return self.meta["model"]

    @property
    def n_layers(self) -> int:
        return int(self.model["n_layers"])

    @property
    def n_experts(self) -> int:
        return int(self.model["n_experts"])

    @property
    def top_k(self) -> int:
        return int(self.model["top_k"])

    @property
    def expert_bytes(self) -> int:
        return int(self.model["expert_bytes"])

    @property
    def tree_sizes(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def true_known(self) -> np.ndarray:
        return self.true_experts[:, 0, 0] >= 0

    @property
    def verdict_known(self) -> np.ndarray:
        return self.verdict >= 0

    @property
    def cycle_of_node(self) -> np.ndarray:
        return np.repeat(np.arange(self.n_cycles), self.tree_sizes)

    @property
    def parent_rows(self) -> np.ndarray:
        """int64 [nodes]: the row of each node's parent in the trace's node arrays (-1 for roots)."""
        return np.where(self.parent >= 0, self.parent.astype(np.int64) + self.offsets[:-1][self.cycle_of_node], -1)

    @property
    def position_indexed(self) -> bool:
        return bool(self.meta["recording"].get("position_indexed", False))

    def rows(self, cycle: int) -> slice:
        return slice(int(self.offsets[cycle]), int(self.offsets[cycle + 1]))

    def tree(self, cycle: int) -> DraftTree:
        r = self.rows(cycle)
        return DraftTree(parents=self.parent[r].astype(np.int64), path_probs=self.path_prob[r],
                         tokens=self.token[r].astype(np.int64))

    # ------------------------------------------------------------------ tables
    def cycles_frame(self) -> pd.DataFrame:
        """One row per cycle: cycle, sequence, position, n_nodes and the measured values."""
        df = pd.DataFrame({"cycle": np.arange(self.n_cycles), "sequence": self.sequence,
                           "position": self.position, "n_nodes": self.tree_sizes})
        for name, values in self.measured.items():
            df[name] = values
        return df

    def nodes_frame(self, experts: bool = False) -> pd.DataFrame:
        """One row per node (the file's rows); with ``experts`` the expert sets as array cells."""
        c = self.cycle_of_node
        df = pd.DataFrame({
            "cycle": c, "sequence": self.sequence[c], "position": self.position[c],
            "node": np.arange(self.n_nodes) - self.offsets[c], "parent": self.parent, "depth": self.depth,
            "token": self.token, "draft_logprob": self.draft_logprob, "path_prob": self.path_prob,
            "verdict": pd.Series(self.verdict, dtype="Int32").mask(~self.verdict_known),
        })
        if experts:
            df["true_experts"] = list(self.true_experts)
            if self.predicted_experts is not None:
                df["predicted_experts"] = list(self.predicted_experts)
        return df


# --------------------------------------------------------------------------- writing
def _expert_type(n_experts: int) -> pa.DataType:
    # unknown sets are nulls (a validity mask), so every id of the narrow type is usable
    return pa.uint8() if n_experts <= 256 else pa.uint16()


def _expert_column(experts: np.ndarray, known: np.ndarray, n_experts: int) -> pa.Array:
    n, L, k = experts.shape
    vtype = _expert_type(n_experts)
    values = pa.array(np.where(experts >= 0, experts, 0).reshape(-1).astype(vtype.to_pandas_dtype()), type=vtype)
    return pa.FixedSizeListArray.from_arrays(values, L * k, mask=pa.array(~known))


def to_table(trace: Trace) -> pa.Table:
    c = trace.cycle_of_node
    E = trace.n_experts
    cols = {
        "cycle": pa.array(c.astype(np.int32)),
        "sequence": pa.array(trace.sequence[c].astype(np.int32)),
        "position": pa.array(trace.position[c].astype(np.int32)),
        "node": pa.array((np.arange(trace.n_nodes) - trace.offsets[c]).astype(np.int16)),
        "parent": pa.array(trace.parent.astype(np.int16)),
        "depth": pa.array(trace.depth.astype(np.int16)),
        "token": pa.array(trace.token.astype(np.int32)),
        "draft_logprob": pa.array(trace.draft_logprob.astype(np.float32)),
        "path_prob": pa.array(trace.path_prob.astype(np.float64)),
        "verdict": pa.array(trace.verdict.astype(np.int32), mask=~trace.verdict_known),
        "true_experts": _expert_column(trace.true_experts, trace.true_known, E),
    }
    if trace.predicted_experts is not None:
        cols["predicted_experts"] = _expert_column(trace.predicted_experts, trace.predicted_experts[:, 0, 0] >= 0, E)
    if trace.verified is not None:
        cols["verified"] = pa.array(trace.verified.astype(bool))
    if trace.true_expert_weights is not None:
        weights = trace.true_expert_weights
        known = ~np.isnan(weights[:, 0, 0])
        # the unknown rows are null in the column (their NaN values are not written): no copy of
        # the array, which is the trace's largest, to fill them
        values = pa.array(np.ascontiguousarray(weights, dtype=np.float32).reshape(-1), type=pa.float32())
        cols["true_expert_weights"] = pa.FixedSizeListArray.from_arrays(values, weights.shape[1] * weights.shape[2],
                                                                        mask=pa.array(~known))
    for name, values in trace.measured.items():
        cols[name] = pa.array(np.asarray(values, dtype=np.float64)[c])
    table = pa.table(cols)
    meta = dict(trace.meta, schema_version=SCHEMA_VERSION)
    # strict JSON (a statistic of too short a trace is NaN: null here), as every JSON SpecFit writes
    return table.replace_schema_metadata({METADATA_KEY: strict_dumps(meta, sort_keys=True).encode()})


def write_trace(trace: Trace, path: str | Path) -> Path:
    """Validate ``trace`` and write it atomically as Parquet (zstd); returns the path."""
    validate_trace(trace, source=str(path))
    table = to_table(trace)
    # one row group per ~64k nodes keeps a reader's memory bounded without fragmenting small files
    atomic_write(path, lambda tmp: pq.write_table(table, tmp, compression="zstd", compression_level=9,
                                                  row_group_size=65536))
    return Path(path)


# --------------------------------------------------------------------------- reading
def read_trace(path: str | Path, validate: bool = True, weights: bool = True) -> Trace:
    """Read a trace file; raises :class:`SpecFitError` for anything that is not a valid trace.
    ``weights=False`` leaves out ``true_expert_weights`` (an imported log's router weights: no
    replay reads them, and their array, NaN off the reference path, is the trace's largest)."""
    path = Path(path)
    if not path.is_file():
        raise SpecFitError(f"{path}: " + not_readable_as(path, "a trace file (.parquet)", "no such trace file"))
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise SpecFitError(f"{path}: not a Parquet trace file ({one_line(exc)})") from None
    raw = (pf.schema_arrow.metadata or {}).get(METADATA_KEY)
    if raw is None:
        raise SpecFitError(f"{path}: missing the '{METADATA_KEY.decode()}' metadata; expected a SpecFit trace file")
    try:
        meta = json.loads(raw)
    except ValueError:                             # not UTF-8, not JSON
        raise SpecFitError(f"{path}: metadata '{METADATA_KEY.decode()}' is not valid JSON") from None
    if not isinstance(meta, dict):
        raise SpecFitError(f"{path}: metadata '{METADATA_KEY.decode()}' must be a JSON object, got "
                           f"{json_text(meta)}")
    version = meta.get("schema_version")
    if version != SCHEMA_VERSION:
        found = "field 'schema_version' is missing" if version is None else f"schema_version {version!r} is not supported"
        raise SpecFitError(f"{path}: {found}; expected {SCHEMA_VERSION} (re-create the trace with this version of "
                           f"specfit)")
    check_meta(meta, str(path))
    names = set(pf.schema_arrow.names)
    missing = [c for c, _, req, _ in NODE_COLUMNS if req and c not in names]
    if missing:
        raise SpecFitError(f"{path}: missing column(s) {missing}; a schema-{SCHEMA_VERSION} trace needs "
                           f"{[c for c, _, req, _ in NODE_COLUMNS if req]}")
    try:
        # batch by batch, one thread: pf.read() peaked at far more memory than this, and was no faster
        # (benchmarks/RESULTS.md, "Stop 50: four more audits"); the per-slot columns, the trace's
        # bulk, go straight into their arrays (_slot_array)
        slots = [c for c in SLOT_COLUMNS if c in names and (weights or c != "true_expert_weights")]
        columns = [c for c in pf.schema_arrow.names if c not in SLOT_COLUMNS]
        schema = pa.schema([f for f in pf.schema_arrow if f.name in columns], metadata=pf.schema_arrow.metadata)
        table = pa.Table.from_batches(list(pf.iter_batches(batch_size=_BATCH, columns=columns, use_threads=False)),
                                      schema=schema)
        model = meta["model"]
        per_slot = {c: _slot_array(pf, c, model["n_layers"], model["top_k"], str(path)) for c in slots}
    except (pa.ArrowException, OSError) as exc:
        # a readable footer says nothing about the pages: truncated or overwritten data fails here
        raise SpecFitError(f"cannot read {path}: damaged Parquet data ({one_line(exc)})") from None
    trace = _from_table(table, per_slot, meta, str(path))
    del table
    pa.default_memory_pool().release_unused()    # the pool would keep every buffer the table was read into
    if validate:
        validate_trace(trace, source=str(path))
    return trace


def _int_column(table: pa.Table, name: str, source: str, fill: int | None = None, dtype=None) -> np.ndarray:
    """Column ``name`` as integers (``fill`` for its nulls, else none allowed), as ``dtype`` when
    given: a value outside that type's range is refused, not wrapped into a valid-looking one."""
    col = table.column(name)
    if not (pa.types.is_integer(col.type)):
        raise SpecFitError(f"{source}: column '{name}' must hold integers, got {col.type}")
    if col.null_count and fill is None:
        raise SpecFitError(f"{source}: column '{name}' has {col.null_count} null value(s); expected none")
    values = col.to_numpy(zero_copy_only=False) if not col.null_count else \
        col.fill_null(fill).to_numpy(zero_copy_only=False)
    return values if dtype is None else _narrowed(values, dtype, f"{source}: column '{name}'")


def _narrowed(values: np.ndarray, dtype, what: str) -> np.ndarray:
    """``values`` as ``dtype``, refused (naming ``what``) when one lies outside its range."""
    info = np.iinfo(dtype)
    if values.size and (values.min() < info.min or values.max() > info.max):
        bad = values[(values < info.min) | (values > info.max)][0]
        raise SpecFitError(f"{what} holds {bad}; expected values from {info.min} to {info.max} ({np.dtype(dtype).name})")
    return values.astype(dtype)


def _slot_array(pf: pq.ParquetFile, name: str, L: int, k: int, source: str) -> np.ndarray:
    """Column ``name`` of ``pf``, a fixed-size list of ``L * k`` values per row (expert ids or
    router weights), as an int16 (ids; :data:`UNKNOWN` in a null row) or float32 (weights; NaN in
    a null row) array [rows, L, k], filled a record batch at a time: no whole-column copy in Arrow
    and none for the cast (``benchmarks/RESULTS.md``, "Stop 54")."""
    kind, dtype, null = ("integers", np.int16, UNKNOWN) if name != "true_expert_weights" else ("floats", np.float32, np.nan)
    typ = pf.schema_arrow.field(name).type
    value_ok = pa.types.is_integer if kind == "integers" else pa.types.is_floating
    if not (pa.types.is_fixed_size_list(typ) and value_ok(typ.value_type)) or typ.list_size != L * k:
        raise SpecFitError(f"{source}: column '{name}' must be a fixed-size list of {L * k} {kind} "
                           f"(layers x top_k = {L} x {k}), got {typ}")
    out = np.empty((pf.metadata.num_rows, L, k), dtype=dtype)
    flat = out.reshape(len(out), L * k)
    row = 0
    for batch in pf.iter_batches(batch_size=_BATCH, columns=[name], use_threads=False):
        col = batch.column(0)
        m = len(col)
        valid = col.is_valid().to_numpy(zero_copy_only=False)
        # a null row's slots may be null in the child array after a Parquet round trip
        values = col.values.slice(col.offset * L * k, m * L * k)
        if values.null_count:
            # in a written row a null slot would read as 0 (expert 0, a weight of 0): only a whole row is unknown
            slot_null = ~values.is_valid().to_numpy(zero_copy_only=False).reshape(m, L * k)
            if (slot_null.any(axis=1) & valid).any():
                bad = row + int(np.flatnonzero(slot_null.any(axis=1) & valid)[0])
                raise SpecFitError(f"{source}: column '{name}' has a null slot in row {bad}, a row that is not null; "
                                   f"expected {kind} in every slot of a known row (an unknown row is null as a whole)")
            values = values.fill_null(0)
        chunk = values.to_numpy(zero_copy_only=False)
        flat[row:row + m] = (chunk if kind == "floats" else _narrowed(chunk, dtype, f"{source}: column '{name}'")
                             ).reshape(m, L * k)
        if kind == "integers" and (flat[row:row + m][valid] < 0).any():
            # a row is unknown when null; a negative id in a written row would read as unknown (or out of range)
            bad = row + int(np.flatnonzero(valid & (flat[row:row + m] < 0).any(axis=1))[0])
            raise SpecFitError(f"{source}: column '{name}' holds a negative expert id in row {bad}; expected ids from 0 "
                               f"(an unknown row is null)")
        if col.null_count:
            out[row:row + m][~valid] = null
        row += m
    if row != len(out):
        raise SpecFitError(f"{source}: column '{name}' has {row} rows, the file's footer says {len(out)}")
    return out


def _from_table(table: pa.Table, per_slot: dict[str, np.ndarray], meta: dict, source: str) -> Trace:
    cycle = _int_column(table, "cycle", source)
    n = cycle.size
    if n == 0:
        raise SpecFitError(f"{source}: the trace has no rows; expected at least one cycle")
    if np.any(np.diff(cycle) < 0) or cycle[0] != 0 or np.any(np.diff(cycle) > 1):
        raise SpecFitError(f"{source}: column 'cycle' must number cycles 0, 1, 2, ... with each cycle's rows consecutive")
    starts = np.flatnonzero(np.r_[True, cycle[1:] != cycle[:-1]])
    offsets = np.r_[starts, n].astype(np.int64)
    for name in ("path_prob", "draft_logprob"):
        if not pa.types.is_floating(table.column(name).type) or table.column(name).null_count:
            raise SpecFitError(f"{source}: column '{name}' must hold non-null floats, got {table.column(name).type}")
    sizes = np.diff(offsets)

    def per_cycle_value(name: str, values: np.ndarray) -> np.ndarray:
        """A per-cycle column's value, which every row of the cycle repeats."""
        first = values[starts]
        differs = values != np.repeat(first, sizes)          # finite values only: NaN is refused before
        if differs.any():
            c = int(np.searchsorted(offsets, int(np.argmax(differs)), side="right") - 1)
            raise SpecFitError(f"{source}: column '{name}' differs between the rows of cycle {c}; expected one value per "
                               f"cycle, repeated on each of its rows")
        return first

    per_cycle = {name: per_cycle_value(name, _int_column(table, name, source)) for name in ("sequence", "position")}
    measured = {}
    for name in MEASURED_COLUMNS:
        if name in table.column_names:
            col = table.column(name)
            if not (pa.types.is_floating(col.type) or pa.types.is_integer(col.type)):
                raise SpecFitError(f"{source}: column '{name}' must hold numbers, got {col.type}")
            values = col.to_numpy(zero_copy_only=False).astype(np.float64)
            if not np.isfinite(values).all():
                raise SpecFitError(f"{source}: column '{name}' holds {int((~np.isfinite(values)).sum())} null or "
                                   f"non-finite value(s); expected measured numbers")
            measured[name] = per_cycle_value(name, values)
    verified = None
    if "verified" in table.column_names:
        if not pa.types.is_boolean(table.column("verified").type):
            raise SpecFitError(f"{source}: column 'verified' must hold booleans, got {table.column('verified').type}")
        verified = table.column("verified").fill_null(False).to_numpy(zero_copy_only=False).astype(bool)
    node = _int_column(table, "node", source)
    if np.any(node != np.arange(n) - np.repeat(starts, np.diff(offsets))):
        raise SpecFitError(f"{source}: column 'node' must number each cycle's rows 0, 1, 2, ... (root first)")
    return Trace(
        meta=meta, offsets=offsets,
        sequence=per_cycle["sequence"].astype(np.int32),
        position=per_cycle["position"].astype(np.int32),
        parent=_int_column(table, "parent", source, dtype=np.int16),
        depth=_int_column(table, "depth", source, dtype=np.int16),
        token=_int_column(table, "token", source, dtype=np.int32),
        draft_logprob=table.column("draft_logprob").to_numpy(zero_copy_only=False).astype(np.float32),
        path_prob=table.column("path_prob").to_numpy(zero_copy_only=False).astype(np.float64),
        verdict=_int_column(table, "verdict", source, fill=UNKNOWN, dtype=np.int32),
        true_experts=per_slot["true_experts"], predicted_experts=per_slot.get("predicted_experts"),
        verified=verified, measured=measured, true_expert_weights=per_slot.get("true_expert_weights"),
    )


# --------------------------------------------------------------------------- validation
