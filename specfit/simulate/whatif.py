"""What-if changes to a cost model: single-parameter overrides and a faster or slower host link.

The cost models themselves come from hardware profiles and presets
(:func:`specfit.calibrate.presets.resolve_profile`); a what-if derives a new one from them.
"""

from __future__ import annotations

import math

from ..costmodel import CostModel
from ..errors import SpecFitError

__all__ = ["parse_overrides", "apply_overrides", "scale_h2d"]


def parse_overrides(text: str | None) -> dict[str, float]:
    """``"base_s=0.004,miss_s=2e-4"`` -> ``{"base_s": 0.004, "miss_s": 0.0002}``."""
    if not text:
        return {}
    out = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise SpecFitError(f"--cost: expected NAME=VALUE items separated by commas, got {item!r}")
        try:
            out[name] = float(value)
        except ValueError:
            raise SpecFitError(f"--cost: {name} must be a number, got {value!r}") from None
    return out


def apply_overrides(cost: CostModel, overrides: dict[str, float]) -> CostModel:
    try:
        cost = cost.replace(**overrides)
    except ValueError as exc:
        raise SpecFitError(f"--cost: {exc}") from None
    return cost.check_cycle_time("--cost") if overrides else cost


def scale_h2d(cost: CostModel, factor: float, copy_latency_s: float = 0.0) -> CostModel:
    """The cost model with ``factor`` times the host-to-device bandwidth: the bandwidth part of a
    miss's transfer (:attr:`CostModel.transfer_s` less ``copy_latency_s``, the fixed latency of a
    copy: :attr:`~specfit.calibrate.profile.Profile.copy_latency_s`) divided by ``factor``; the
    latency of a copy does not change with the link's bandwidth."""
    scale = 1.0 / factor if math.isfinite(factor) and factor > 0 else math.nan
    if not math.isfinite(cost.transfer_s * scale):       # 1e-320: a finite factor whose transfer overflows
        raise SpecFitError(f"--h2d-scale: expected a finite positive factor that leaves a miss finite, got {factor}")
    return cost.scaled_transfer(scale, copy_latency_s)
