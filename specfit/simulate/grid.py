"""A what-if grid: the sweep spec (TOML or YAML), its cells, and running one cell.

A spec lists the axes of the grid; every combination is one *cell*, one replay:

    traces = ["../traces/qwen3-30b-a3b-chat.parquet"]     # paths relative to the spec file
    routing = [{log = "routing.npz", drafters = ["chat", "code"], max_tokens = 256}]
    profiles = ["pcie4", "pcie5", "calibrate/MY-MACHINE.json"]
    h2d_scale = [1, 2]
    cache_experts = [0, 16, 32]
    cache_mode = "per_layer"          # every axis takes one value or a list
    cache_policy = ["lru", "moe-infinity"]
    policies = ["ar", "chain:2", "eagle3:16:4", "static:auto", "specfit"]
    predictor = ["oracle", "affinity"]
    acceptance = "calibrated"
    max_levels = 8
    price_uncertainty = true
    layer_ahead = ["none", "eam"]     # simulate --layer-ahead's what-if (none: not recounted)
    cost = "base_s=0.004"             # optional overrides of every profile
    rescale = false                   # allow a measured profile of another model shape

``routing`` entries are real routing logs (``.npz`` / ``.jsonl``) whose draft trees are
synthesised with each drafter preset of ``drafters`` (:data:`specfit.traces.synth.WORKLOADS`), as
``specfit traces import-routing`` does; each (log, drafter) pair is one trace of the grid.

A cell is identified by a hash of its parameters and of the bytes of the files it reads
(:attr:`Cell.cell_id`): the same setting has the same id in every run, so an interrupted or
extended sweep skips what is already in its dataset, and a changed trace, profile or preset is
replayed again. :func:`run_cell` is the one place that knows how a cell becomes a replay.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import SpecFitError
from ..io import not_readable_as, repeated_path

__all__ = ["TraceSource", "Cell", "SweepSpec", "load_spec", "parse_spec", "expand", "run_cell", "CELL_COLUMNS",
           "file_digest", "policy_cost_rank"]

# the cell's parameters as dataset columns (trace, cache_experts, policy and predictor are also
# columns of the replay summary, with the same values)
CELL_COLUMNS = ("cell_id", "trace", "source", "drafter", "profile_source", "h2d_scale", "cost_overrides", "rescale",
                "cache_experts", "cache_mode", "cache_policy", "policy", "predictor", "acceptance", "max_levels",
                "price_uncertainty", "inputs_digest", "layer_ahead")

_AXES = {  # spec key: (type of one value, default)
    "profiles": (str, ["pcie4"]),
    "h2d_scale": (float, [1.0]),
    "cache_experts": (int, [0, 16, 32]),
    "cache_mode": (str, ["per_layer"]),
    "cache_policy": (str, ["lru"]),
    "policies": (str, ["ar", "chain:4", "eagle3", "eagle3-nocache", "static:auto", "specfit", "oracle"]),
    "predictor": (str, ["oracle"]),
    "acceptance": (str, ["calibrated"]),
    "max_levels": (int, [8]),
    "price_uncertainty": (bool, [True]),
    "layer_ahead": (str, ["none"]),
}
_SCALARS = {"cost": (str, ""), "rescale": (bool, False)}
_ROUTING_KEYS = {"log": str, "drafters": list, "shape": str, "max_tokens": int, "sequences": int, "seed": int,
                 "sibling_reuse": float}


@dataclass(frozen=True)
class TraceSource:
    """Where one trace of the grid comes from: a trace file, or a routing log imported with a
    drafter preset. ``path`` is as the spec wrote it; ``resolved`` is where the file is."""

    name: str
    path: str
    resolved: Path
    drafter: str = ""                              # "" for a trace file
    entry: str = field(default="", compare=False)  # "routing[i]": the spec's entry, which errors name
    import_options: dict = field(default_factory=dict, hash=False, compare=False)  # shape, max_tokens, ...
    digest: str = ""

    @property
    def is_routing(self) -> bool:
        return bool(self.drafter)


@dataclass(frozen=True)
class Cell:
    """One replay of the grid; every field is a plain value (a dataset column)."""

    trace: str
    source: str
    drafter: str
    profile_source: str
    h2d_scale: float
    cost_overrides: str
    rescale: bool
    cache_experts: int
    cache_mode: str
    cache_policy: str
    policy: str
    predictor: str
    acceptance: str
    max_levels: int
    price_uncertainty: bool
    inputs_digest: str
    layer_ahead: str = "none"

    @property
    def cell_id(self) -> str:
        fields = asdict(self)
        if fields["layer_ahead"] == "none":      # a cell of a grid without the axis keeps its id
            del fields["layer_ahead"]
        text = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def prepared_key(self) -> tuple:
        """What the prepared trace depends on (one preparation serves every cell with this key)."""
        return (self.trace, self.predictor, self.acceptance)

    @property
    def scenario_key(self) -> tuple:
        return (self.trace, self.profile_source, self.h2d_scale, self.cost_overrides, self.rescale)

    def params(self) -> dict:
        return {"cell_id": self.cell_id, **asdict(self)}


@dataclass(frozen=True)
class SweepSpec:
    """A parsed spec: the trace sources and the value lists of every other axis."""

    path: str
    sources: tuple[TraceSource, ...]
    axes: dict
    cost: str = ""
    rescale: bool = False

    @property
    def n_cells(self) -> int:
        n = len(self.sources)
        for values in self.axes.values():
            n *= len(values)
        return n

    def to_dict(self) -> dict:
        return {"path": self.path, "sources": [{"name": s.name, "path": s.path, "drafter": s.drafter,
                                                 "import_options": s.import_options, "digest": s.digest}
                                                for s in self.sources],
                "axes": self.axes, "cost": self.cost, "rescale": self.rescale}


def file_digest(path: str | Path, extra: dict | None = None) -> str:
    """Short sha256 of a file's bytes (and of ``extra`` options): what makes a cell's inputs its own."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    if extra:
        h.update(json.dumps(extra, sort_keys=True).encode())
    return h.hexdigest()[:16]


def load_spec(path: str | Path) -> SweepSpec:
    """Read a ``.toml`` or ``.yaml``/``.yml`` sweep spec."""
    path = Path(path)
    if not path.is_file():
        raise SpecFitError(f"{path}: " + not_readable_as(path, "a .toml or .yaml sweep spec",
                                                         "no such sweep spec; expected a .toml or .yaml file"))
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecFitError(f"{path}: not a readable sweep spec ({exc})") from None
    if path.suffix == ".toml":
        import tomllib
        try:
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise SpecFitError(f"{path}: not valid TOML ({exc})") from None
    elif path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise SpecFitError("YAML sweep specs need PyYAML: pip install 'specfit[sweep]' (or write the spec in TOML)") from None
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise SpecFitError(f"{path}: not valid YAML{where} ({what})") from None
    else:
        raise SpecFitError(f"{path}: unknown spec format {path.suffix!r}; expected .toml, .yaml or .yml")
    return parse_spec(raw, source=str(path), base=path.parent)


def _is_a(kind: type, value) -> bool:
    """TOML and YAML types as the spec means them: a bool is not a number, an int is a float."""
    if kind is bool or isinstance(value, bool):
        return kind is bool and isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, kind)


def _values(raw: dict, key: str, kind: type, default: list, source: str) -> list:
    value = raw.get(key, default)
    values = value if isinstance(value, list) else [value]
    if not values:
        raise SpecFitError(f"{source}: field {key!r} is an empty list; expected at least one value")
    out = []
    for v in values:
        if not _is_a(kind, v):
            raise SpecFitError(f"{source}: field {key!r} must hold {kind.__name__} values, got {v!r}")
        out.append(float(v) if kind is float else v)
    if key == "cache_mode":
        from ..experts.cache import cache_mode_name

        out = [cache_mode_name(v) for v in out]        # per-layer is per_layer: one value, not two
    if len(set(out)) != len(out):
        raise SpecFitError(f"{source}: field {key!r} lists a value twice: {out}")
    return out


def check_axis_values(axes: dict, source: str) -> None:
    """The numeric axes in range (those of ``axes`` that are there); ``source`` ``"plan"``: the
    values came from ``specfit plan``'s options, which the error names."""
    from ..specfit_policy import MAX_LEVELS

    bounds = (("cache_experts", lambda v: v < 0, ">= 0"),
              ("max_levels", lambda v: not 1 <= v <= MAX_LEVELS, f"from 1 to {MAX_LEVELS}"),
              ("h2d_scale", lambda v: not (math.isfinite(v) and v > 0), "finite and > 0"))
    for key, bad, expected in bounds:
        wrong = [v for v in axes.get(key, ()) if bad(v)]
        if wrong:
            where = f"--{key.replace('_', '-')}" if source == "plan" else f"{source}: field '{key}'"
            raise SpecFitError(f"{where}: expected values {expected}, got {wrong[0]:g}")


def parse_spec(raw, source: str = "spec", base: Path | None = None) -> SweepSpec:
    """A :class:`SweepSpec` from the spec's parsed mapping; relative paths are relative to ``base``."""
    from ..traces.synth import WORKLOADS
    from .scenarios import check_layer_ahead, check_replay_options, distinct_labels
    from .sweep import check_policies
    from .whatif import parse_overrides

    if not isinstance(raw, dict):
        raise SpecFitError(f"{source}: expected a mapping of spec fields at the top level")
    known = {"traces", "routing", *_AXES, *_SCALARS}
    unknown = sorted(map(str, set(raw) - known))
    if unknown:
        raise SpecFitError(f"{source}: unknown field(s) {unknown}; expected some of {sorted(known)}")
    base = Path(base) if base is not None else Path(".")
    axes = {key: _values(raw, key, kind, default, source) for key, (kind, default) in _AXES.items()}
    scalars = {}
    for key, (kind, default) in _SCALARS.items():
        value = raw.get(key, default)
        if not _is_a(kind, value):
            raise SpecFitError(f"{source}: field {key!r} must be a {kind.__name__}, got {value!r}")
        scalars[key] = value
    check_axis_values(axes, source)
    # a sweep's rows carry the label simulate gives the same profile: two alike would be one profile
    distinct_labels(axes["profiles"], "--profile" if source == "plan" else f"{source}: field 'profiles'")
    try:
        parse_overrides(scalars["cost"])
        check_policies(axes["policies"], max(axes["max_levels"]))
    except SpecFitError as exc:
        raise SpecFitError(f"{source}: field {'cost' if str(exc).startswith('--cost') else 'policies'!r}: "
                           f"{str(exc).split(': ', 1)[1]}") from None
    for predictor in axes["predictor"]:
        for acceptance in axes["acceptance"]:
            for mode in axes["cache_mode"]:
                for policy in axes["cache_policy"]:
                    check_replay_options(predictor, acceptance, mode, policy, source=source, weights=False)
    for value in axes["layer_ahead"]:
        try:
            check_layer_ahead(value)
        except SpecFitError as exc:
            raise SpecFitError(f"{source}: field 'layer_ahead': {str(exc).split(': ', 1)[1]}") from None
    sources = _trace_sources(raw, source, base, WORKLOADS)
    return SweepSpec(path=source, sources=tuple(sources), axes=axes, **scalars)


def _trace_sources(raw: dict, source: str, base: Path, workloads: dict) -> list[TraceSource]:
    from ..traces.importers import check_import_options
    from .scenarios import unique_names

    traces = raw.get("traces", [])
    routing = raw.get("routing", [])
    if not isinstance(traces, list) or not all(isinstance(t, str) for t in traces):
        raise SpecFitError(f"{source}: field 'traces' must be a list of trace file paths")
    if not isinstance(routing, list) or not all(isinstance(r, dict) for r in routing):
        raise SpecFitError(f"{source}: field 'routing' must be a list of tables {{log = ..., drafters = [...]}}")
    if not traces and not routing:
        raise SpecFitError(f"{source}: no traces; expected field 'traces' (trace files) or 'routing' (routing logs)")
    out = []
    log_names = unique_names([Path(str(r.get("log", ""))) for r in routing])
    for path, name in zip(traces, unique_names([Path(t) for t in traces])):
        resolved = base / path
        if not resolved.is_file():
            raise SpecFitError(f"{source}: field 'traces': {path!r} (relative to {base}): "
                               + not_readable_as(resolved, "a trace file", "no such trace file"))
        out.append(TraceSource(name=name, path=path, resolved=resolved, digest=file_digest(resolved)))
    same = repeated_path([t.resolved for t in out])
    if same is not None:      # spelt two ways, one file would be replayed twice as two traces
        raise SpecFitError(f"{source}: field 'traces' lists {same} twice; expected distinct trace files")
    for i, entry in enumerate(routing):
        where = f"{source}: routing[{i}]"
        bad = sorted(set(entry) - set(_ROUTING_KEYS))
        if bad or "log" not in entry:
            raise SpecFitError(f"{where}: expected fields 'log' and 'drafters' (and optionally shape, max_tokens, "
                               f"sequences, seed, sibling_reuse), got {sorted(entry)}")
        for key, kind in _ROUTING_KEYS.items():
            if key in entry and not _is_a(kind, entry[key]):
                raise SpecFitError(f"{where}: field {key!r} must be a {kind.__name__}, got {entry[key]!r}")
        options = {k: entry[k] for k in ("shape", "max_tokens", "sequences", "seed", "sibling_reuse") if k in entry}
        # the range checks of `specfit traces import-routing`'s options, naming the entry's field
        check_import_options(**{k: v for k, v in options.items() if k != "shape"},
                             name=lambda key: f"{where}: field {key!r}")
        drafters = entry.get("drafters", ["chat"])
        if not drafters or any(not isinstance(d, str) or d not in workloads for d in drafters):
            raise SpecFitError(f"{where}: field 'drafters' must list presets of {sorted(workloads)}, got {drafters!r}")
        resolved = base / entry["log"]
        if not resolved.is_file():
            raise SpecFitError(f"{where}: field 'log': {entry['log']!r} (relative to {base}): "
                               + not_readable_as(resolved, "a routing log", "no such routing log"))
        stem = log_names[i]
        for drafter in drafters:
            # the trees are made with the preset's figures and the options' defaults, which the code
            # may change: both are part of the identity, so a resumed sweep does not mix old and new trees
            made_with = import_arguments(drafter, options)
            made_with["drafter"] = made_with["drafter"].to_dict()
            out.append(TraceSource(name=f"{stem}:{drafter}", path=entry["log"], resolved=resolved, drafter=drafter,
                                   entry=f"routing[{i}]", import_options=options, digest=file_digest(resolved, {**options, **made_with})))
    names = [s.name for s in out]
    if len(set(names)) != len(names):
        raise SpecFitError(f"{source}: two traces have the same name ({names}); list each source once")
    return out


def import_arguments(drafter: str, options: dict) -> dict:
    """The :func:`~specfit.traces.importers.import_routing` arguments a routing source's trace is
    made with: its drafter preset and its options, those the spec leaves out at their defaults."""
    from ..traces.synth import WORKLOADS

    return {"workload": drafter, "drafter": WORKLOADS[drafter], "sibling_reuse": options.get("sibling_reuse", 0.3),
            "seed": options.get("seed", 0), "max_tokens": options.get("max_tokens")}


def expand(spec: SweepSpec, profile_digests: dict[str, str] | None = None) -> list[Cell]:
    """Every cell of the grid, in a fixed order. ``profile_digests``: the digest of each profile
    JSON named in the spec (computed here when not given); a preset's is :func:`preset_digest`."""
    import itertools

    a = spec.axes
    if profile_digests is None:
        profile_digests = {p: file_digest(_profile_path(spec, p)) for p in a["profiles"] if p.endswith(".json")}
    from ..calibrate.presets import PRESETS

    # (a name that is neither is refused where the scenarios are built, naming the spec's field)
    profile_digests = {**{p: preset_digest(p) for p in a["profiles"] if p in PRESETS}, **profile_digests}
    cells = []
    for src in spec.sources:
        for predictor, acceptance, profile, h2d, mode, evict, cache, levels, pricing, ahead, policy in itertools.product(
                a["predictor"], a["acceptance"], a["profiles"], a["h2d_scale"], a["cache_mode"], a["cache_policy"],
                a["cache_experts"], a["max_levels"], a["price_uncertainty"], a.get("layer_ahead", ["none"]),
                a["policies"]):
            digest = src.digest + (":" + profile_digests[profile] if profile in profile_digests else "")
            cells.append(Cell(trace=src.name, source=src.path, drafter=src.drafter, profile_source=profile,
                              h2d_scale=h2d, cost_overrides=spec.cost, rescale=spec.rescale, cache_experts=cache,
                              cache_mode=mode, cache_policy=evict, policy=policy, predictor=predictor,
                              acceptance=acceptance, max_levels=levels, price_uncertainty=pricing,
                              inputs_digest=digest, layer_ahead=ahead))
    return cells


def preset_digest(name: str) -> str:
    """A preset's digest: its cost model for every shape it knows. Its figures are constants of the
    code, so a sweep resumed after they changed (a hit following the expert bytes, stop 62) replays
    its cells again instead of mixing rows of the two."""
    from ..calibrate.presets import SHAPES, preset_profile

    costs = [preset_profile(name, shape).cost.to_dict() for shape in SHAPES.values()]
    return hashlib.sha256(json.dumps(costs, sort_keys=True).encode()).hexdigest()[:16]


def _profile_path(spec: SweepSpec, profile: str) -> Path:
    """A profile JSON named in the spec, relative to the spec file (presets are names, not files)."""
    path = Path(spec.path).parent / profile
    if not path.is_file():
        raise SpecFitError(f"{spec.path}: field 'profiles': no such profile JSON {profile!r} "
                           f"(relative to {Path(spec.path).parent})")
    return path


def policy_cost_rank(policy: str) -> int:
    """A rough order of replay cost (higher: slower), so the slow cells are scheduled first and
    the sweep does not end waiting on one of them."""
    from ..policies import is_tuned

    head = policy.split(":")[0]
    if is_tuned(policy):
        return 2
    return 1 if head == "specfit" else 0


def run_cell(prepared, cell: Cell, scenario) -> dict:
    """Replay one cell: the single summary row of :func:`specfit.simulate.sweep.run_sweep` on
    ``prepared`` (the cell's :class:`~specfit.simulate.replay.PreparedTrace`, used opaquely) under
    ``scenario`` (its resolved cost model), plus the cell's parameters, the link bandwidth the
    cost model implies and ``replay_s``, the wall time of the replay itself.

    ``speedup_vs_ar`` / ``speedup_vs_eagle3`` need the baseline's cell; the dataset fills them in
    when it is read (:func:`specfit.simulate.dataset.read_results`)."""
    from .scenarios import link_gbps
    from .sweep import run_sweep

    start = time.perf_counter()
    _, summary = run_sweep([prepared], [cell.policy], [cell.cache_experts], [scenario], cache_mode=cell.cache_mode,
                           cache_policy=cell.cache_policy, max_levels=cell.max_levels,
                           price_uncertainty=cell.price_uncertainty,
                           layer_ahead=cell.layer_ahead)
    replay_s = time.perf_counter() - start
    if len(summary) != 1:
        raise RuntimeError(f"run_sweep returned {len(summary)} summary rows for one cell")
    row = {k: (None if _is_missing(v) else v.item() if hasattr(v, "item") else v)
           for k, v in summary.iloc[0].to_dict().items()}
    params = cell.params()
    clash = {k for k in row if k in params and row[k] != params[k]}
    if clash:
        raise RuntimeError(f"cell {cell.cell_id}: the summary's {sorted(clash)} differ from the cell's")
    return {**row, **params, "link_gbps": link_gbps(scenario.cost, scenario.copy_latency_s), "replay_s": replay_s}


def _is_missing(value) -> bool:
    import pandas as pd

    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):
        return False
