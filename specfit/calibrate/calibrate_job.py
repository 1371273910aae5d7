"""``specfit calibrate``: probe the machine, fit the cycle-time predictor, write a profile; and
``--refit``: refit a profile from the cycles a ``specfit decode --out`` run measured.

The fitted model is the one the search and the simulator use. Its per-expert terms come from
passes where the offloaded model really copies and computes experts; the draft term from a timed
draft level (the drafter, or a stand-in of its shape). Every probe runs in ``rounds`` interleaved
rounds of the same work and each measurement is their median (:mod:`specfit.calibrate.repeat`);
the profile keeps every round's timing, the spread, the CPU share and load average, and warns
when they say the machine was busy. The fit is physical (:mod:`specfit.calibrate.fit`): a miss
never costs less than a hit, and a term the passes cannot identify is held at what the direct
probes measured (a hit: one resident expert; a transfer: one expert's copy; a node: the slope of
the star-tree passes, :func:`~specfit.calibrate.cycles.star_node_cost`). A stand-in model with fewer layers than the
named shape lacks whole layers, so ``base_s`` and ``per_node_s`` grow by those layers' time, each
kind of layer timed on its own (:func:`scale_to_depth`); what was added is recorded in the profile.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ..costmodel import PARAM_NAMES
from ..errors import SpecFitError, check_seed
from ..io import json_text, optional_file, user_cache_dir
from .cycles import (cycles_features, part_line, probe_cycles, probe_draft, probe_drafter_levels, probe_trees,
                     probe_layer_parts, star_node_cost)
from .fit import CycleTimeFitter, prediction_errors
from .probes import MEASURES, fit_h2d, probe_expert_compute, probe_h2d
from .profile import ModelShape, Profile, machine_info
from .repeat import busy_warnings, machine_noise, repeat_rounds

__all__ = ["CalibrationPlan", "calibrate", "refit", "read_run_cycles", "run_shape", "check_dtype",
           "default_profile_path", "planned_profile_path", "cached_profile_path", "drafter_identity",
           "RUN_CYCLE_COLUMNS",
           "probe_prior", "scale_to_depth"]

# what `specfit decode --out` writes per cycle (cycles.parquet) and a refit reads
RUN_CYCLE_COLUMNS = ("draft_levels", "nodes_verified", "hits", "misses", "measured_time_s")


@dataclass
class CalibrationPlan:
    model_dir: Path | None = None
    shape: str | None = None
    layers: int | None = None
    drafter_dir: Path | None = None
    device: str = "cpu"
    dtype: str | None = None
    quick: bool = False
    seed: int = 0

    def validate(self) -> None:
        """Fail early, before any probe runs, on a bad seed, dtype, model directory or shape."""
        check_seed(self.seed)
        if self.dtype is not None:
            check_dtype(self.dtype)
        if self.model_dir is not None:
            from ..runtime.config import ModelConfig

            ModelConfig.from_dir(self.model_dir)
        else:
            from .standin import SHAPE_CONFIGS, shape_config

            raw = SHAPE_CONFIGS.get(self.shape or "", {})
            dense = raw.get("first_k_dense_replace", 0)
            if self.layers is not None and 1 <= self.layers <= dense:
                # a stand-in of only dense layers has no expert to probe
                raise SpecFitError(f"--layers: expected {dense + 1}..{raw['num_hidden_layers']} for {self.shape} (its "
                                   f"first {dense} layer(s) dense, the rest MoE), got {self.layers}")
            shape_config(self.shape or "", self.layers)

    @property
    def n_steps(self) -> int:
        h2d = (2 if torch.device(self.device).type == "cuda" else 1) * len(self.size_factors) * len(self.batch_sizes)
        trees = len(probe_trees(self.node_counts, self.repeats))
        per_round = h2d + len(self.token_counts) + len(self.capacity_fractions) * trees
        return per_round * (self.warmup_rounds + self.rounds) + 1

    # probe grids; --quick trims them for CI
    @property
    def size_factors(self):
        return (0.5, 1.0, 2.0) if self.quick else (0.25, 0.5, 1.0, 2.0, 4.0)

    @property
    def batch_sizes(self):
        return (1, 4) if self.quick else (1, 2, 4, 8)

    @property
    def token_counts(self):
        return (1, 4, 16) if self.quick else (1, 2, 4, 8, 16, 32)

    @property
    def node_counts(self):
        return (1, 2, 4, 8, 16) if self.quick else (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)

    @property
    def capacity_fractions(self):
        return (0.0, 0.5, 1.0) if self.quick else (0.0, 0.25, 0.5, 0.75, 1.0)

    @property
    def repeats(self) -> int:
        """Random trees per (cache size, node count) in one round."""
        return 2

    @property
    def rounds(self) -> int:
        """Repetitions of every probe (the same work each round); a measurement is their median."""
        return 3

    @property
    def warmup_rounds(self) -> int:
        """Untimed passes of every probe before the rounds (a process's first pass is cold)."""
        return 1


def check_dtype(name: str) -> torch.dtype:
    """The torch dtype ``--dtype`` names."""
    from ..runtime.config import DTYPES

    if name not in DTYPES:
        raise SpecFitError(f"--dtype: expected one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")


def default_profile_path(machine: dict, shape: ModelShape) -> Path:
    """``calibrate/<host>-<device>-<model>.json`` under the current directory (where
    ``specfit calibrate`` writes by default and a project keeps its profiles)."""
    return Path("calibrate") / _profile_name(machine, shape.name)


def planned_profile_path(plan: CalibrationPlan) -> Path:
    """The :func:`default_profile_path` of the profile ``plan`` makes, known before any probe runs
    (its name is the model directory's or the --shape's, as the profile's shape is named)."""
    name = Path(plan.model_dir).name if plan.model_dir is not None else str(plan.shape)
    return Path("calibrate") / _profile_name(machine_info(plan.device), name)


def cached_profile_path(machine: dict, shape: ModelShape, dtype: str | None = None) -> Path:
    """The same name in the user's cache (``$XDG_CACHE_HOME/specfit/profiles``, by default
    ``~/.cache/specfit/profiles``), where ``specfit decode`` keeps the quick calibrations it makes
    itself, whatever the current directory; with ``dtype`` (the experts' element type) in the
    name, so that one model decoded in two dtypes keeps a profile for each."""
    name = _profile_name(machine, shape.name)
    if dtype:
        name = name.removesuffix(".json") + f"-{_slug(dtype)}.json"
    return user_cache_dir() / "specfit" / "profiles" / name


def _profile_name(machine: dict, model_name: str) -> str:
    return f"{_slug(machine['host'])}-{_slug(machine['device_name'])}-{_slug(model_name)}.json"


def drafter_identity(drafter_dir) -> str:
    """Which drafter a draft level was timed with, ``<directory>@<digest of its config.json>``, or
    "stand-in": a profile's ``draft_level_s`` is that drafter's, and a decode with another says so."""
    if drafter_dir is None:
        return "stand-in"
    from ..simulate.grid import file_digest

    return f"{Path(drafter_dir).name}@{file_digest(Path(drafter_dir) / 'config.json')}"


def _load_target(plan: CalibrationPlan, status=None):
    """(model, probed shape, full shape, dtype) for a model directory or a named stand-in."""
    device = torch.device(plan.device)
    if plan.model_dir is not None:
        from ..runtime.loader import load_model

        from ..runtime.config import ModelConfig
        from ..runtime.loader import drafter_capture_layers

        target = ModelConfig.from_dir(plan.model_dir)
        capture = drafter_capture_layers(plan.drafter_dir, target) if plan.drafter_dir is not None else None
        model = load_model(plan.model_dir, device=device, dtype=plan.dtype, capture_layers=capture)
        shape = ModelShape.from_config(model.config, model.dtype, Path(plan.model_dir).name)
        return model, shape, shape
    from .standin import SHAPE_CONFIGS, random_model, shape_config

    if plan.shape is None:
        raise SpecFitError("calibrate: pass --model DIR or --shape NAME (one of " + ", ".join(SHAPE_CONFIGS) + ")")
    # the public shapes ship in bf16: a stand-in holds its experts the same way (and half the memory)
    dtype = check_dtype(plan.dtype or "bfloat16")
    full = shape_config(plan.shape)
    config = shape_config(plan.shape, plan.layers)
    check_standin_memory(plan, config, dtype, device)
    model = random_model(config, device, dtype, seed=plan.seed, progress=status)
    probed = ModelShape.from_config(config, dtype, f"{plan.shape} ({config.n_layers} layers, random weights)")
    full_shape = ModelShape.from_config(full, dtype, plan.shape)
    return model, probed, full_shape


# what the probes may not take of the host's available memory (other processes, the allocator)
HOST_RESERVE_FRACTION = 0.15


def check_standin_memory(plan: CalibrationPlan, config, dtype, device) -> None:
    """Refuse, before anything is allocated, a stand-in whose weights (plus, on the CPU, the
    smallest probe cache) would not fit in the host memory available beside what runs already."""
    from ..runtime.devices import available_host_bytes
    from .standin import standin_bytes

    available = available_host_bytes()
    if available is None:
        return
    held = standin_bytes(config, dtype)
    needed = held["experts"] + (held["dense"] if device.type == "cpu" else 0)
    if device.type == "cpu":       # the "device" slots are host memory too: at least the staging buffers
        needed += 2 * config.expert_bytes(dtype)
    budget = available * (1 - HOST_RESERVE_FRACTION)
    if needed > budget:
        raise SpecFitError(
            f"calibrate --shape {plan.shape} --layers {config.n_layers}: needs {needed / 2**30:.1f} GiB of host memory "
            f"({held['experts'] / 2**30:.1f} GiB of experts, {held['dense'] / 2**30:.1f} GiB dense, in "
            f"{str(dtype).removeprefix('torch.')}), {available / 2**30:.1f} GiB are available; pass fewer --layers")


def _load_drafter(plan: CalibrationPlan, model):
    """``--drafter`` loaded for ``model`` (an EAGLE-3 head or a draft model), when a real model
    is probed; None for a stand-in of a named shape (its draft level is a stand-in too)."""
    if plan.drafter_dir is None or plan.model_dir is None:
        return None
    from ..runtime.loader import load_drafter

    return load_drafter(plan.drafter_dir, model)


def _drafter_dims(plan: CalibrationPlan, config) -> tuple[int, int]:
    """(hidden size, draft vocabulary) of the drafter whose level is timed: ``--drafter``'s
    config.json when given, else EAGLE-3's defaults for the target (its hidden size, 32k tokens)."""
    if plan.drafter_dir is None:
        return config.hidden_size, min(config.vocab_size, 32000)
    from ..io import read_json_object

    path = Path(plan.drafter_dir) / "config.json"
    raw = read_json_object(path, "the drafter's config.json")
    try:
        return int(raw["hidden_size"]), int(raw.get("draft_vocab_size") or raw["vocab_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise SpecFitError(f"{path}: expected JSON with 'hidden_size' and 'draft_vocab_size' ({exc})") from None


def calibrate(plan: CalibrationPlan, progress=None, model=None, status=None) -> Profile:
    """Run every probe, fit the cost model, and return the profile (not yet saved).

    ``model``: an already loaded target (e.g. by ``specfit decode``) to probe instead of loading
    ``plan.model_dir``; its expert offload is restored afterwards. ``progress`` ticks once per
    probe step, ``status`` hears what is being done before the probes (building a stand-in).
    """
    started = time.perf_counter()
    step = progress or (lambda: None)
    if model is None:
        model, probed, full = _load_target(plan, status)
    else:
        name = Path(plan.model_dir).name if plan.model_dir else "model"
        probed = full = ModelShape.from_config(model.config, model.dtype, name)
    device, dtype, c = model.device, model.dtype, model.config
    machine = machine_info(device)

    capacities = sorted({int(round(f * c.n_experts)) for f in plan.capacity_fractions})
    # every probe once per round, the rounds one after another: a disturbance of the machine shorter
    # than a round touches one sample of a measurement, and the median drops it
    rows, timing = repeat_rounds({
        "h2d": lambda: probe_h2d(probed.expert_bytes, device, batch_sizes=plan.batch_sizes,
                                 size_factors=plan.size_factors, progress=step),
        "expert_compute": lambda: probe_expert_compute(c.hidden_size, c.expert_intermediate_size, dtype, device,
                                                       token_counts=plan.token_counts, top_k=c.top_k,
                                                       weights_float32=c.routing_weights_float32, progress=step),
        "cycles": lambda: probe_cycles(model, capacities, node_counts=plan.node_counts, repeats=plan.repeats,
                                       seed=plan.seed, progress=step),
    }, plan.rounds, plan.warmup_rounds)
    h2d_rows, compute_rows, cycle_rows = rows["h2d"], rows["expert_compute"], rows["cycles"]
    noise = {**machine_noise(rows, timing, device.type, torch.get_num_threads()), "warmup_rounds": plan.warmup_rounds,
             "quick": plan.quick}
    drafter = _load_drafter(plan, model)
    timed_with = drafter_identity(plan.drafter_dir if drafter is not None else None)
    draft_hidden, draft_vocab = _drafter_dims(plan, c)
    if drafter is None and plan.model_dir is None and draft_hidden == c.hidden_size:
        # a stand-in: a random EAGLE-3 head of the published shape grows real trees (its levels
        # with the tree's bookkeeping; a lone layer's kernels leave out most of what a level costs
        # on a GPU: timed that way, a fraction of a live level on an H200, benchmarks/RESULTS.md,
        # "A stand-in's draft level, timed on real trees")
        from .standin import random_drafter

        drafter = random_drafter(model, draft_vocab, plan.seed)
    if drafter is not None:
        # the real drafter, levels of an EAGLE-2/3 tree with top-4: a level beyond the first
        draft_rows = probe_drafter_levels(model, drafter, seed=plan.seed)
        draft_level_s = float(np.median([r["seconds"] for r in draft_rows if r["level"] > 1]))
    else:
        draft_rows = probe_draft(draft_hidden, draft_vocab, device, dtype)
        # one draft level for a frontier of 8 nodes (an EAGLE-3 top-k frontier)
        draft_level_s = float(np.interp(8, [r["width"] for r in draft_rows], [r["seconds"] for r in draft_rows]))
    step()

    X, y = cycles_features(cycle_rows)
    prior = probe_prior(compute_rows, h2d_rows, probed.expert_bytes, pinned=device.type == "cuda")
    node_s = star_node_cost(cycle_rows, prior.get("hit_s", 0.0), prior.get("transfer_s", 0.0))
    if node_s is not None:
        prior["per_node_s"] = node_s
    fitter = CycleTimeFitter(seed=plan.seed, fixed={"draft_level_s": draft_level_s}, prior=prior).fit(
        X, y, source="cycle probes")
    cost = fitter.cost_model(expert_bytes=full.expert_bytes)
    part_rows, depth = [], {"layers_added": {"dense_layer": 0, "moe_layer": 0}}
    if full.n_layers != probed.n_layers:          # a stand-in of fewer layers than its shape
        from .standin import shape_config

        part_rows = probe_layer_parts(model)
        cost, depth = scale_to_depth(cost, part_rows, c, shape_config(plan.shape))
    predicted = fitter.predict(X)
    pinned = device.type == "cuda"
    fit_info = {
        **fitter.quality_,
        "method": "physical least squares on measured verification passes (relative error, Huber weights, "
                  "miss_s = hit_s + transfer_s >= hit_s), draft_level_s fixed from the draft probe, terms the "
                  "passes cannot identify held at the expert-compute, H2D and star-tree probes' values",
        "probed_params": dict(zip(PARAM_NAMES, map(float, fitter.params_))),
        **depth,
        "h2d": fit_h2d(h2d_rows, pinned=pinned if device.type == "cuda" else None),
        "h2d_pageable": fit_h2d(h2d_rows, pinned=False) if device.type == "cuda" else None,
        "seconds": time.perf_counter() - started,
        "probe_noise": noise,
        "warnings": busy_warnings(noise),
    }
    for row, p in zip(cycle_rows, predicted):
        row["predicted_s"] = float(p)
    return Profile(
        cost=cost, shape=full, kind="measured",
        source=f"specfit calibrate on {machine['device_name']} ({probed.name})", machine=machine, fit=fit_info,
        probes={"h2d": h2d_rows, "expert_compute": compute_rows, "cycles": cycle_rows, "draft": draft_rows,
                "layer_parts": part_rows, "drafter": timed_with,
                "probed_shape": probed.to_dict(), "dtype": str(dtype).replace("torch.", ""), "measures": MEASURES},
    )


def scale_to_depth(cost, part_rows: list[dict], probed, full) -> tuple:
    """(cost model, what was added) of a stand-in with config ``probed`` at the depth of ``full``.

    The stand-in's passes already hold the head and its own layers, so ``base_s`` and
    ``per_node_s`` grow by the layers it lacks, each timed on its own (``part_rows``:
    :func:`~specfit.calibrate.cycles.probe_layer_parts`). Multiplying the terms by the ratio of MoE
    layers instead scaled the head and the dense layer with them: twice the full model's base for
    a 4-layer DeepSeek-V2-Lite stand-in on a CPU, 4.4 times for a 2-layer one."""
    kinds = {"dense_layer": lambda c: c.n_layers - c.n_moe_layers, "moe_layer": lambda c: c.n_moe_layers}
    missing = {part: count(full) - count(probed) for part, count in kinds.items()}
    lines = {part: part_line(part_rows, part) for part in kinds}
    added = {term: sum(n * lines[part][i] for part, n in missing.items())
             for i, term in enumerate(("base_s", "per_node_s"))}
    info = {"layers_added": missing,
            "layer_lines_s": {part: {"base_s": line[0], "per_node_s": line[1]} for part, line in lines.items()},
            "depth_added_s": added}
    return cost.replace(**{term: getattr(cost, term) + s for term, s in added.items()}), info


def probe_prior(compute_rows: list[dict], h2d_rows: list[dict], expert_bytes: int, pinned: bool) -> dict:
    """What the direct probes say the per-expert terms are: a hit is one resident expert run on a
    token (the compute probe's smallest batch), a transfer one expert's copy (the H2D fit)."""
    prior = {}
    if compute_rows:
        smallest = min(compute_rows, key=lambda r: r["tokens"])
        prior["hit_s"] = float(smallest["seconds"])
    line = fit_h2d(h2d_rows, pinned=pinned if pinned else None) if h2d_rows else {}
    if np.isfinite(line.get("gbps", np.nan)) and line["gbps"] > 0:
        prior["transfer_s"] = float(line["overhead_s"] + expert_bytes / (line["gbps"] * 1e9))
    return prior


# --------------------------------------------------------------------------- refit from a run
def read_run_cycles(run_dir: str | Path) -> pd.DataFrame:
    """The per-cycle measurements ``specfit decode --out RUN_DIR`` kept (``cycles.parquet``, and
    the cycles journal of a run that was killed)."""
    from ..runtime.run_dir import CYCLES_FILE, JOURNAL_FILE, read_decode_cycles

    run_dir = Path(run_dir)
    if not any([optional_file(run_dir / CYCLES_FILE, "a run's cycles (Parquet)"),
                optional_file(run_dir / JOURNAL_FILE, "a run's journal of cycles (JSON lines)")]):
        raise SpecFitError(f"{run_dir / CYCLES_FILE}: no such file; expected the cycles of a `specfit decode --out "
                           f"{run_dir}` run")
    df = read_decode_cycles(run_dir)
    path = run_dir / CYCLES_FILE
    if "measured_time_s" not in df and "cycle_time_s" in df:      # written before the shared schema
        df = df.rename(columns={"cycle_time_s": "measured_time_s"})
    missing = [c for c in RUN_CYCLE_COLUMNS if c not in df.columns]
    if missing:
        raise SpecFitError(f"{path}: missing column(s) {missing}; expected {list(RUN_CYCLE_COLUMNS)}")
    if df.empty:
        raise SpecFitError(f"{path}: no cycles recorded")
    values = {name: pd.to_numeric(df[name], errors="coerce").to_numpy(dtype=np.float64) for name in RUN_CYCLE_COLUMNS}
    measured = values["measured_time_s"]
    if not np.isfinite(measured).all():
        bad = int((~np.isfinite(measured)).sum())
        what = ("no measured times: a replay's cycles (`specfit simulate --out`) are charged, not measured; "
                "expected the cycles of a `specfit decode --out` run") if bad == measured.size else \
            f"{bad} of {measured.size} cycles have no finite 'measured_time_s'"
        raise SpecFitError(f"{path}: {what}")
    if (measured <= 0).any():
        bad = measured[measured <= 0]
        raise SpecFitError(f"{path}: {bad.size} of {measured.size} cycles have 'measured_time_s' <= 0 (the first: "
                           f"{bad[0]:g}); expected positive seconds")
    for name in RUN_CYCLE_COLUMNS[:-1]:
        counts = values[name]
        # a count past int64 is none the run wrote (and 1e300 broke the fit's eigen-solver in a traceback)
        wrong = ~(np.isfinite(counts) & (counts >= 0) & (counts == np.round(counts)) & (counts < 2.0 ** 63))
        if wrong.any():
            first = int(np.argmax(wrong))
            value = df[name].iloc[first]
            shown = repr(value) if isinstance(value, str) or value is None else f"{counts[first]:g}"
            raise SpecFitError(f"{path}: column '{name}' holds {shown} (cycle {first}); expected non-negative whole "
                               f"counts (int64)")
    return df.assign(**values)


def _run_json(run_dir: str | Path) -> tuple[dict, Path]:
    """A ``specfit decode --out`` run's ``run.json`` and its path ({} when there is none). One that
    is there but cannot be read is an error: ignoring it would refit a preset for the wrong model,
    or a profile of another model, without a word."""
    from ..io import read_json_object
    from ..runinfo import RUN_INFO_FILE

    path = Path(run_dir) / RUN_INFO_FILE
    if not path.exists():
        return {}, path
    return read_json_object(path, "the run.json of a `specfit decode --out` run"), path


def run_shape(run_dir: str | Path) -> ModelShape | None:
    """The model a ``specfit decode --out`` run decoded, as its ``run.json`` records it; None for
    a run that recorded none (no run.json, or one without a shape: older runs, the demo's warm-up)."""
    info, path = _run_json(run_dir)
    recorded = info.get("shape")
    return None if recorded is None else ModelShape.from_dict(recorded, source=str(path))


def run_drafter(run_dir: str | Path) -> str | None:
    """The drafter a ``specfit decode --out`` run drafted with (:func:`drafter_identity`), as its
    ``run.json`` records it; None for a run that drafted with none or does not say (older runs)."""
    info, path = _run_json(run_dir)
    drafter = info.get("drafter")
    if drafter is not None and not isinstance(drafter, str):
        raise SpecFitError(f"{path}: field 'drafter': expected a string (<directory>@<digest>) or null, got "
                           f"{json_text(drafter)}")
    return drafter


def _refit_probes(profile: Profile, run_dirs, frames) -> tuple[dict, list[str]]:
    """The refitted profile's probes and warnings. Its ``draft_level_s`` is fitted on the runs'
    drafted levels, so ``probes.drafter`` names their drafter; when the runs drafted with several,
    or one of them does not say with which (older runs), the key goes (a decode then compares
    nothing) and a warning says so. Runs that drafted no level leave the profile's draft level and
    its drafter as they were; so does a refit that held ``draft_level_s`` (every cycle drafting as
    deep, its levels cannot be told from the base: the prior's, scaled), which :func:`refit` does
    not ask this for."""
    drafters = {run_drafter(d) for d, frame in zip(run_dirs, frames) if (frame["draft_levels"] > 0).any()}
    probes = dict(profile.probes)
    if not drafters:
        return probes, []
    if len(drafters) == 1 and None not in drafters:
        probes["drafter"] = drafters.pop()
        return probes, []
    timed = probes.pop("drafter", None)
    if timed is None:
        return probes, []
    known = sorted(d for d in drafters if d is not None)
    unknown = "its run.json does not say which drafter drafted its levels (a decode of an older SpecFit)"
    which = (f"the runs drafted their levels with {' and with '.join(known)}" + (f", and one of them {unknown}"
             if None in drafters else "")) if known else f"a run's {unknown}"
    return probes, [f"{which}: the refitted draft_level_s is not known to be one drafter's, so the profile no longer "
                    f"names one (probes.drafter, {timed}, dropped)"]


def refit(profile: Profile, run_dirs, seed: int = 0, holdout_fraction: float = 0.3) -> tuple[Profile, dict]:
    """Refit ``profile``'s cost model on measured decode cycles.

    Returns the refitted profile and a comparison on the *same* held-out cycles: the error of the
    original profile's predictions and of a fit on the other cycles.
    """
    check_seed(seed)
    for d in run_dirs:
        shape = run_shape(d)
        if shape is not None:
            if not shape.same_shape(profile.shape):
                raise SpecFitError(f"--refit {d}: its cycles were measured on {shape.name} ({shape.n_layers} "
                                   f"layers, {shape.n_experts} experts, top-{shape.top_k}, "
                                   f"{shape.expert_bytes} B/expert), the profile is for {profile.shape.name} "
                                   f"({profile.shape.n_layers} layers, {profile.shape.n_experts} experts, "
                                   f"top-{profile.shape.top_k}, {profile.shape.expert_bytes} B/expert); refit the "
                                   f"profile of that model (or pass --rescale to map this one onto it first)")
    frames = [read_run_cycles(d) for d in run_dirs]
    df = pd.concat(frames, ignore_index=True)
    from ..costmodel import CostModel

    X = CostModel.features(df["draft_levels"], df["nodes_verified"], df["hits"], df["misses"])
    y = df["measured_time_s"].to_numpy(dtype=np.float64)
    if "update_time_s" in df:
        # a cycle's time holds the online model's update when the run refitted as it went; a model that
        # decides with the profile adds its own expected update (OnlineCostModel), so the profile is
        # fitted on the cycles without it, or that time would be counted twice
        update = pd.to_numeric(df["update_time_s"], errors="coerce").to_numpy(dtype=np.float64)
        y = y - np.where(np.isfinite(update) & (update > 0) & (update < y), update, 0.0)
    # the profile is the prior: a term these cycles cannot identify keeps the profile's value
    fitter = CycleTimeFitter(holdout_fraction=holdout_fraction, seed=seed, prior=profile.cost).fit(
        X, y, source="decode cycles")
    n_test = fitter.quality_["n_holdout"]
    test = np.random.default_rng(seed).permutation(len(y))[:n_test]
    before = prediction_errors(X[test] @ profile.cost.params, y[test])
    after = fitter.quality_["holdout"]
    cost = fitter.cost_model(expert_bytes=profile.cost.expert_bytes)
    comparison = {"n_cycles": int(len(y)), "n_holdout": int(n_test), "before": before, "after": after,
                  "before_params": profile.cost.to_dict(), "after_params": cost.to_dict()}
    probes, warnings = (_refit_probes(profile, run_dirs, frames) if "draft_level_s" in fitter.quality_.get("fitted", ())
                        else (dict(profile.probes), []))
    refitted = Profile(cost=cost, shape=profile.shape, kind="refit",
                       source=f"refit of {profile.label} on {len(y)} decode cycles", machine=profile.machine,
                       fit={**fitter.quality_, "refit": comparison, "runs": [str(d) for d in run_dirs],
                            # the copies' fit of the probes it keeps (a copy's latency: what-ifs keep it)
                            **{k: profile.fit[k] for k in ("h2d", "h2d_pageable") if k in profile.fit},
                            **({"warnings": warnings} if warnings else {})},
                       probes=probes)
    return refitted, comparison
