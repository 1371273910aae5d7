"""Routing logs as users have them: the readers behind ``specfit traces import-routing``.

A routing log records, for each decoded token, the experts the target's router picked at every
MoE layer (router rank order), optionally the router's weights for them and the token id. Every
layout is read into one :class:`RoutingLog` (rows grouped by sequence, in decode order):

- ``.npz``, one array per field: ``expert_ids [tokens, layers, top_k]``, ``sequence_id
  [tokens]``, optionally ``token_id``, ``generated_token_index`` (orders the rows of a sequence; without it a
  sequence's rows are in decode order, and may interleave with other sequences' as a batched
  decode writes them) and ``router_weights [tokens, layers, top_k]``;
- ``.npz``, one array per sequence (what routing recorders built on vLLM write): integer arrays
  ``[tokens, layers, top_k]`` under keys that share a prefix and end in the sequence number
  (``problem0``, ``problem1``, ...; any integer dtype, int8 included), sequences in numeric
  order, no token ids; router weights, when recorded, under ``<key>_router_weights`` or
  ``<key>_weights``;
- ``.jsonl`` / ``.parquet``, one record per token and layer (``sequence_id``, ``token_index``,
  ``layer``, ``experts`` [top_k]; rows in layer-major or token-major order, any order in fact) or
  one record per token (``sequence_id``, ``token_index``, ``experts`` [layers][top_k]); optional
  ``token_id`` and ``router_weights`` (the shape of ``experts``). ``generated_token_index`` is
  read as ``token_index``.

A sequence's token indices must be distinct and consecutive (a trace needs every committed token).
Token ids may be missing: :attr:`RoutingLog.tokens` is then None and the importer says so.
"""

from __future__ import annotations

import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ..errors import SpecFitError
from ..io import not_readable_as, read_parquet, write_jsonl_atomic

__all__ = ["RoutingLog", "read_routing_log", "dump_jsonl", "JSONL_FIELDS"]

JSONL_FIELDS = ("sequence_id", "token_index", "token_id", "layer", "experts")
_INDEX_ALIASES = ("token_index", "generated_token_index")
_WEIGHT_ALIASES = ("router_weights", "weights")


@dataclass
class RoutingLog:
    """Decode routing: ``experts [tokens, layers, top_k]``, ``tokens [tokens]`` (None when the log
    has no token ids), ``sequence [tokens]`` (rows of a sequence consecutive, in decode order),
    ``weights [tokens, layers, top_k]`` float32 router weights (None when not recorded)."""

    experts: np.ndarray
    tokens: np.ndarray | None
    sequence: np.ndarray
    source: str
    weights: np.ndarray | None = None
    layout: str = "npz"

    @property
    def token_ids_known(self) -> bool:
        return self.tokens is not None

    def select(self, rows: np.ndarray) -> "RoutingLog":
        return RoutingLog(self.experts[rows], None if self.tokens is None else self.tokens[rows], self.sequence[rows],
                          self.source, None if self.weights is None else self.weights[rows], self.layout)


def read_routing_log(path: str | Path) -> RoutingLog:
    """Read a routing log in any layout of the module docstring."""
    path = Path(path)
    if not path.is_file():
        raise SpecFitError(f"{path}: " + not_readable_as(path, "a routing log file (.npz, .jsonl or .parquet)",
                                                         "no such routing log"))
    if path.suffix == ".npz":
        return _read_npz(path)
    if path.suffix in (".jsonl", ".json"):
        try:
            # dtype=False: values as JSON wrote them (pandas would read true as 1 and "3" as 3 in a
            # column of numbers, which the id checks below refuse)
            frame = pd.read_json(path, lines=True, dtype=False)
        except ValueError as exc:
            raise SpecFitError(f"{path}: not valid JSON lines ({exc})") from None
        return _from_records(frame, path, "jsonl")
    if path.suffix == ".parquet":
        return _from_records(read_parquet(path), path, "parquet")
    raise SpecFitError(f"{path}: unknown routing-log format; expected a .npz, .jsonl or .parquet file")


# ----------------------------------------------------------------- npz
def _read_npz(path: Path) -> RoutingLog:
    try:
        data = np.load(path, allow_pickle=False)   # never unpickle a user file
        arrays = {name: data[name] for name in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise SpecFitError(f"{path}: not a readable .npz file ({exc})") from None
    if "expert_ids" in arrays:
        return _flat_npz(arrays, path)
    return _per_sequence_npz(arrays, path)


def _flat_npz(data: dict, path: Path) -> RoutingLog:
    experts = _expert_ids(data["expert_ids"], path, "array 'expert_ids'")
    T = experts.shape[0]
    if "sequence_id" not in data:
        raise SpecFitError(f"{path}: missing array 'sequence_id' [tokens] beside 'expert_ids'")
    for name in ("sequence_id", "token_id", "generated_token_index"):
        if name in data and data[name].shape != (T,):
            raise SpecFitError(f"{path}: array {name!r} must have one entry per row of expert_ids ({T}), "
                               f"got shape {list(data[name].shape)}")
    seq = _integers(data["sequence_id"], path, "array 'sequence_id'", "sequence ids")
    tokens = data.get("token_id")
    weights = _weights(data.get("router_weights"), experts, path, "array 'router_weights'")
    if "generated_token_index" in data:
        index = _non_negative(data["generated_token_index"], path, "array 'generated_token_index'", "token indices")
        order = np.lexsort((index, _first_seen_rank(seq)))
        _check_consecutive(seq[order], index[order], path)
    else:
        # rows of several sequences may interleave (a batched decode writes them so): each
        # sequence's rows together, in the file's order, sequences in first-seen order
        order = np.argsort(_first_seen_rank(seq), kind="stable")
    tokens = None if tokens is None else _non_negative(tokens[order], path, "array 'token_id'", "token ids")
    return RoutingLog(experts[order], tokens, seq[order], str(path), None if weights is None else weights[order], "npz")


# the keys of a sequence's router weights beside its array (``problem0_router_weights``), in the order read
_SEQUENCE_WEIGHT_SUFFIXES = ("_router_weights", "_weights")


def _per_sequence_npz(data: dict, path: Path) -> RoutingLog:
    keyed = {}
    for name in data:
        match = re.fullmatch(r"(.*?)(\d+)", name)
        if match:             # a sequence's array, whatever its dtype (_expert_ids refuses a float one by name)
            keyed.setdefault(match.group(1), []).append((int(match.group(2)), name))
    if len(keyed) != 1:
        found = ", ".join(sorted(data)[:6]) or "nothing"
        raise SpecFitError(f"{path}: expected 'expert_ids' (one array per field) or one integer array per sequence "
                           f"under keys like problem0, problem1, ... (one shared prefix); found {found}")
    (prefix, entries), = keyed.items()
    entries.sort()
    # every other array must be a sequence's router weights: one left unread would drop what it holds silently
    known = {name for _, name in entries}
    known |= {f"{name}{suffix}" for name in known for suffix in _SEQUENCE_WEIGHT_SUFFIXES}
    unknown = sorted(set(data) - known)
    if unknown:
        raise SpecFitError(f"{path}: array {unknown[0]!r} is neither a sequence ({prefix}<N>) nor a sequence's router "
                           f"weights ({prefix}<N>_router_weights); expected only those in a log of one array per "
                           "sequence")
    for (number, name), (other, other_name) in zip(entries, entries[1:]):
        if number == other:
            raise SpecFitError(f"{path}: arrays {name!r} and {other_name!r} are both sequence {number}; expected one "
                               "array per sequence number")
    experts, weights, sequence = [], [], []
    for number, name in entries:
        block = _expert_ids(data[name], path, f"array {name!r}")
        experts.append(block)
        sequence.append(np.full(block.shape[0], number, dtype=np.int64))
        weight_key = next((f"{name}{suffix}" for suffix in _SEQUENCE_WEIGHT_SUFFIXES if f"{name}{suffix}" in data),
                          None)
        weights.append(None if weight_key is None else _weights(data[weight_key], block, path, f"array {weight_key!r}"))
    shapes = {block.shape[1:] for block in experts}
    if len(shapes) != 1:
        raise SpecFitError(f"{path}: the per-sequence arrays disagree on [layers, top_k]: {sorted(shapes)}")
    if any(w is None for w in weights) and not all(w is None for w in weights):
        raise SpecFitError(f"{path}: router weights are recorded for some sequences only")
    return RoutingLog(np.concatenate(experts), None, np.concatenate(sequence), str(path),
                      None if weights[0] is None else np.concatenate(weights), "npz-per-sequence")


# ----------------------------------------------------------------- records (JSONL, Parquet)
def _from_records(df: pd.DataFrame, path: Path, layout: str) -> RoutingLog:
    df = df.rename(columns={alias: "token_index" for alias in _INDEX_ALIASES[1:] if alias in df.columns})
    df = df.rename(columns={alias: "router_weights" for alias in _WEIGHT_ALIASES[1:] if alias in df.columns})
    if df.empty and len(df.columns) == 0:
        raise SpecFitError(f"{path}: the log has no records")
    missing = [f for f in ("sequence_id", "token_index", "experts") if f not in df.columns]
    if missing:
        raise SpecFitError(f"{path}: records miss field(s) {missing}; expected one record per token and layer with "
                           f"{list(JSONL_FIELDS)} or one per token with experts [layers][top_k]")
    if df.empty:
        raise SpecFitError(f"{path}: the log has no records")
    # JSON nulls and NaN arrive as float (or object) columns: refuse them before anything groups by them
    df["sequence_id"] = _integers(df["sequence_id"].to_numpy(), path, "field 'sequence_id'", "sequence ids")
    df["token_index"] = _non_negative(df["token_index"].to_numpy(), path, "field 'token_index'", "token indices")
    if "layer" in df.columns:
        df["layer"] = _integers(df["layer"].to_numpy(), path, "field 'layer'", "layer numbers")
    df["sequence_rank"] = _first_seen_rank(df["sequence_id"].to_numpy())
    if "layer" in df.columns:
        df, experts, weights = _layer_records(df, path)
        layout += "-per-layer"
    else:
        df = df.sort_values(["sequence_rank", "token_index"], kind="stable")
        experts = _expert_ids(_nested(df["experts"], path, "experts", 2), path, "field 'experts'")
        weights = _weights(_nested(df["router_weights"], path, "router_weights", 2), experts, path,
                           "field 'router_weights'") if "router_weights" in df.columns else None
        layout += "-per-token"
    seq, index = df["sequence_id"].to_numpy(), df["token_index"].to_numpy()
    _check_consecutive(seq, index, path)
    tokens = _non_negative(df["token_id"].to_numpy(), path, "field 'token_id'", "token ids") if "token_id" in df.columns else None
    return RoutingLog(experts, tokens, seq, str(path), weights, layout)


def _layer_records(df: pd.DataFrame, path: Path):
    """Records of one token and layer each: grouped into [tokens, layers, top_k]."""
    layers = np.sort(df["layer"].unique())
    if not np.array_equal(layers, np.arange(layers.size)):
        raise SpecFitError(f"{path}: field 'layer' must cover 0..L-1, got {layers.tolist()[:8]}...")
    df = df.sort_values(["sequence_rank", "token_index", "layer"], kind="stable")
    counts = df.groupby(["sequence_id", "token_index"]).size()
    if (counts != layers.size).any():
        bad = counts[counts != layers.size].index[0]
        sequence, token = (int(v) for v in bad)
        raise SpecFitError(f"{path}: sequence {sequence}, token {token} has {int(counts[bad])} layer records; "
                           f"expected {layers.size}")
    # L records a token but not one per layer (a layer twice, another missing) would shift layers
    per_token = df["layer"].to_numpy().reshape(-1, layers.size)
    wrong = np.flatnonzero((per_token != np.arange(layers.size)).any(axis=1))
    if wrong.size:
        row = int(wrong[0])
        sequence, token = (int(df[c].iloc[row * layers.size]) for c in ("sequence_id", "token_index"))
        listed = per_token[row]
        twice = sorted({int(v) for v in listed[1:][listed[1:] == listed[:-1]]})
        missing = sorted(set(range(layers.size)) - {int(v) for v in listed})
        raise SpecFitError(f"{path}: sequence {sequence}, token {token} lists layer(s) {twice} twice and none for "
                           f"layer(s) {missing}; expected one record per layer 0..{layers.size - 1}")
    flat = _nested(df["experts"], path, "experts", 1)
    experts = _expert_ids(flat.reshape(-1, layers.size, flat.shape[-1]), path, "field 'experts'")
    weights = None
    if "router_weights" in df.columns:
        w = _nested(df["router_weights"], path, "router_weights", 1)
        weights = _weights(w.reshape(experts.shape[0], layers.size, -1), experts, path, "field 'router_weights'")
    return df[df["layer"] == 0], experts, weights


def _nested(column: pd.Series, path: Path, name: str, depth: int) -> np.ndarray:
    """A column of (nested) lists as one regular array; one error for ragged or scalar cells."""
    try:
        values = np.stack([np.stack([np.asarray(inner) for inner in cell]) if depth == 2 else np.asarray(cell)
                           for cell in column.to_numpy()])
    except (ValueError, TypeError):
        shape = "[layers][top_k]" if depth == 2 else "[top_k]"
        raise SpecFitError(f"{path}: field {name!r} must be a list {shape} of the same length in every record") from None
    if values.ndim != depth + 1:
        raise SpecFitError(f"{path}: field {name!r} must be a list of {'lists of ' if depth == 2 else ''}numbers")
    return values


# ----------------------------------------------------------------- checks
def _expert_ids(values: np.ndarray, path: Path, what: str) -> np.ndarray:
    values = np.asarray(values)
    if values.ndim != 3 or not np.issubdtype(values.dtype, np.integer):
        raise SpecFitError(f"{path}: {what} must be integers [tokens, layers, top_k], got {values.dtype} "
                           f"{list(values.shape)}")
    if values.shape[0] == 0:
        raise SpecFitError(f"{path}: {what} has no tokens (0 rows); expected a log of at least two routed tokens")
    if 0 in values.shape:
        raise SpecFitError(f"{path}: {what} must have at least one layer and one expert per token, got shape "
                           f"{list(values.shape)}")
    if values.min() < 0:
        raise SpecFitError(f"{path}: {what} holds a negative expert id ({int(values.min())}); expected ids >= 0")
    srt = np.sort(values, axis=-1)
    repeated = np.argwhere(srt[..., 1:] == srt[..., :-1])
    if repeated.size:
        token, layer, _ = (int(v) for v in repeated[0])
        raise SpecFitError(f"{path}: {what} lists expert {int(srt[token, layer][repeated[0][2]])} twice for token "
                           f"{token} at layer {layer}; a router's top-k names each expert once")
    return values.astype(np.int64)


def _weights(values, experts: np.ndarray, path: Path, what: str) -> np.ndarray | None:
    if values is None:
        return None
    values = np.asarray(values)
    if values.dtype == object and values.shape == experts.shape:      # JSON: numbers, and NaN or null among them
        numbers = np.array([isinstance(v, (int, float, np.number)) and not isinstance(v, (bool, np.bool_))
                            or v is None for v in values.reshape(-1)])
        if numbers.all():
            values = np.array([np.nan if v is None else float(v) for v in values.reshape(-1)]).reshape(values.shape)
    if values.shape != experts.shape or not np.issubdtype(values.dtype, np.number):
        raise SpecFitError(f"{path}: {what} must be numbers shaped like the expert ids {list(experts.shape)}, got "
                           f"{values.dtype} {list(values.shape)}")
    values = values.astype(np.float32)
    bad = ~np.isfinite(values) | (values < 0)
    if bad.any():
        token, layer, slot = (int(v) for v in np.argwhere(bad)[0])
        raise SpecFitError(f"{path}: {what} must be finite, non-negative router weights, got "
                           f"{values[token, layer, slot]} for token row {token}, layer {layer}, rank {slot}")
    return values


def _integers(values: np.ndarray, path: Path, what: str, ids: str) -> np.ndarray:
    """``values`` as int64: integers, or whole floats (a JSON reader's 3.0); one error naming the
    first string, null, NaN, bool or fraction and its row."""
    values = np.asarray(values)
    if np.issubdtype(values.dtype, np.integer):
        return values.astype(np.int64)
    flat = values.reshape(-1)
    if np.issubdtype(values.dtype, np.floating):
        whole = np.isfinite(flat) & (flat == np.round(flat)) & (np.abs(flat) < 2.0 ** 63)
    elif values.dtype == object:   # mixed JSON values
        whole = np.array([_whole_number(v) for v in flat], dtype=bool)
    else:                          # strings, bools, ...
        whole = np.zeros(flat.size, dtype=bool)
    if whole.all():
        return np.array([int(v) for v in flat], dtype=np.int64).reshape(values.shape) if values.dtype == object \
            else values.astype(np.int64)
    row = int(np.flatnonzero(~whole)[0])
    value = flat[row].item() if isinstance(flat[row], np.generic) else flat[row]
    shown = "null (NaN)" if value is None or (isinstance(value, float) and np.isnan(value)) else repr(value)
    raise SpecFitError(f"{path}: {what} must hold integer {ids}, got {shown} in row {row}")


def _whole_number(value) -> bool:
    """Whether one JSON value is a whole number that fits int64 (3 and 3.0 are; true, 3.5 and "3" not)."""
    if isinstance(value, (bool, np.bool_)):
        return False
    if isinstance(value, (int, np.integer)):
        return -2 ** 63 <= int(value) < 2 ** 63
    return isinstance(value, (float, np.floating)) and bool(np.isfinite(value)) and float(value).is_integer() \
        and abs(value) < 2.0 ** 63


def _non_negative(values: np.ndarray, path: Path, what: str, ids: str) -> np.ndarray:
    """Token ids or a sequence's decode positions (which may start at any index): integers, none
    negative; one error naming the first negative one and its row."""
    values = _integers(values, path, what, ids)
    negative = np.flatnonzero(values < 0)
    if negative.size:
        row = int(negative[0])
        raise SpecFitError(f"{path}: {what} must hold non-negative {ids}, got {int(values[row])} in row {row}")
    return values


def _check_consecutive(seq: np.ndarray, index: np.ndarray, path: Path) -> None:
    """Within each sequence (rows grouped, sorted by index) the token indices step by one."""
    same = seq[1:] == seq[:-1]
    step = np.diff(index)
    bad = np.flatnonzero(same & (step != 1))
    if bad.size:
        i = int(bad[0])
        what = "repeats" if step[i] == 0 else "skips from"
        raise SpecFitError(f"{path}: sequence {seq[i].item()!r} {what} token index {int(index[i])} to {int(index[i + 1])}; "
                           f"a sequence's token indices must be consecutive")


def _first_seen_rank(seq: np.ndarray) -> np.ndarray:
    _, first, inverse = np.unique(seq, return_index=True, return_inverse=True)
    return np.argsort(np.argsort(first))[inverse]


def dump_jsonl(log: RoutingLog, path: str | Path) -> None:
    """Write ``log`` in the JSONL layout (one record per token and layer)."""
    position = np.zeros(log.sequence.size, dtype=np.int64)
    for s in np.unique(log.sequence):
        rows = np.flatnonzero(log.sequence == s)
        position[rows] = np.arange(rows.size)

    def records():
        for i in range(log.sequence.size):
            for layer in range(log.experts.shape[1]):
                record = {"sequence_id": int(log.sequence[i]), "token_index": int(position[i]), "layer": layer,
                          "experts": log.experts[i, layer].tolist()}
                if log.tokens is not None:
                    record["token_id"] = int(log.tokens[i])
                if log.weights is not None:
                    record["router_weights"] = [float(w) for w in log.weights[i, layer]]
                yield record

    write_jsonl_atomic(path, records())
