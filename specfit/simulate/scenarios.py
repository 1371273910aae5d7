"""Turning replay options into what the replay needs: the option checks and the cost-model
scenarios (a preset or profile for the trace's model shape, with what-if changes and its label).

``specfit simulate`` and ``specfit sweep`` both build their scenarios here, so a sweep cell and
the same setting run with ``simulate`` replay under the same cost model and carry the same label.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import SpecFitError
from .sweep import Scenario

__all__ = ["check_replay_options", "distinct_labels", "build_scenario", "scenario_label", "unique_names", "link_gbps"]


def check_layer_ahead(value: str) -> None:
    """One clear error for an unknown ``--layer-ahead``."""
    from ..experts.layer_ahead import PREFETCHERS

    if value != "none" and value not in PREFETCHERS:
        raise SpecFitError(f"--layer-ahead: expected none or one of {', '.join(PREFETCHERS)}, got {value!r}")


def check_replay_options(predictor: str, acceptance: str, cache_mode: str, cache_policy: str,
                         source: str = "", weights: bool = True) -> None:
    """One clear error for an unknown predictor, acceptance, cache mode or eviction policy;
    ``source`` (e.g. a spec file) prefixes the message instead of the option's name. ``weights``:
    the command can load the target's weights (``simulate --model``), which the ``router``
    predictor needs."""
    from ..experts.cache import EVICTION_POLICIES
    from ..experts.predictors import PREDICTORS, parse_predictor

    where = (lambda key, option: f"{source}: field {key!r}") if source else (lambda key, option: option)
    name, _ = parse_predictor(predictor, where("predictor", "--predictor"))
    if name == "router" and not weights:
        raise SpecFitError(f"{where('predictor', '--predictor')}: router needs the target's weights, which this "
                           f"command does not load (simulate --model does); expected one of "
                           f"{sorted(set(PREDICTORS) - {'router'})} (noisy as noisy:P)")
    if acceptance not in ("calibrated", "raw"):
        raise SpecFitError(f"{where('acceptance', '--acceptance')}: expected calibrated or raw, got {acceptance!r}")
    if cache_mode not in ("per_layer", "global"):
        raise SpecFitError(f"{where('cache_mode', '--cache-mode')}: expected per_layer or global, got {cache_mode!r}")
    if cache_policy not in EVICTION_POLICIES:
        raise SpecFitError(f"{where('cache_policy', '--cache-policy')}: expected one of {EVICTION_POLICIES}, "
                           f"got {cache_policy!r}")


def scenario_label(profile_spec: str, h2d_scale: float, overrides: dict[str, float]) -> str:
    """``pcie5``, ``MY-MACHINE x2 H2D``, ``pcie4 (base_s=0.004)``: what the summary's ``profile`` says."""
    label = Path(profile_spec).stem if str(profile_spec).endswith(".json") else str(profile_spec)
    label += f" x{h2d_scale:g} H2D" if h2d_scale != 1.0 else ""
    label += " (" + ",".join(f"{k}={v:g}" for k, v in overrides.items()) + ")" if overrides else ""
    return label


def distinct_labels(profiles: list[str], where: str = "--profile") -> list[str]:
    """``profiles`` when no two share the label their rows carry (a profile file's name without
    ``.json``, a preset's name): ``a/prof.json`` and ``b/prof.json`` would be one profile in the
    results. ``where``: the option or spec field the error names."""
    labels = [scenario_label(p, 1.0, {}) for p in profiles]
    same = next((label for label in labels if labels.count(label) > 1), None)
    if same is not None:
        named = [p for p, label in zip(profiles, labels) if label == same]
        raise SpecFitError(f"{where}: {', '.join(named)} would all be labelled {same!r} in the results; expected "
                           f"profiles with distinct names (rename a file)")
    return profiles


def build_scenario(profile_spec: str, shape, h2d_scale: float = 1.0, overrides: dict[str, float] | None = None,
                   rescale: bool = False) -> Scenario:
    """The cost model of ``profile_spec`` (preset name or profile JSON) for a model of ``shape``
    (:class:`~specfit.calibrate.profile.ModelShape`), with ``overrides`` applied and the host
    link ``h2d_scale`` times as fast (its bandwidth: the profile's latency of a copy is kept)."""
    from ..calibrate.presets import resolve_profile
    from .whatif import apply_overrides, scale_h2d

    overrides = overrides or {}
    profile = resolve_profile(profile_spec, shape, rescale=rescale)
    cost = apply_overrides(profile.cost, overrides)
    if h2d_scale != 1.0:
        cost = scale_h2d(cost, h2d_scale, profile.copy_latency_s)
    return Scenario(scenario_label(profile_spec, h2d_scale, overrides), cost, profile.copy_latency_s)


def link_gbps(cost, copy_latency_s: float = 0.0) -> float:
    """The host-to-device bandwidth a cost model implies: one expert's bytes over the transfer
    part of a miss (``miss_s - hit_s``) less the fixed latency of a copy (``copy_latency_s``, the
    profile's: :attr:`~specfit.calibrate.profile.Profile.copy_latency_s`), which a bandwidth
    what-if keeps; infinite when a miss costs no more than that."""
    transfer_s = cost.transfer_s - min(max(copy_latency_s, 0.0), cost.transfer_s)
    return cost.expert_bytes / transfer_s / 1e9 if transfer_s > 0 and cost.expert_bytes else float("inf")


def unique_names(paths: list[Path]) -> list[str]:
    """Trace names for the summary: the file stem, or the whole path where two stems collide."""
    names = [Path(p).stem for p in paths]
    return [str(p) if names.count(n) > 1 else n for p, n in zip(paths, names)]
