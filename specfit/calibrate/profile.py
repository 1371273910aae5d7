"""Hardware profiles: a fitted cost model for one machine and one model shape (JSON).

A profile records where its numbers come from (``kind``: ``measured`` by ``specfit calibrate``,
``refit`` from decoded cycles, or a ``preset`` derived from published hardware numbers), the
machine, the model shape it was measured for, the cost-model parameters, the fit's held-out error
and a summary of the probe data. A profile for another model shape is refused unless the caller
asks to rescale it (transfer costs scale with the bytes of one expert).
"""

from __future__ import annotations

import json
import math
import platform
import socket
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path

from ..costmodel import CostModel
from ..errors import SpecFitError
from ..io import json_text, nulls_as_nan, write_json_atomic

__all__ = ["ModelShape", "Profile", "PROFILE_VERSION", "machine_info", "load_profile", "held_out_unit"]

PROFILE_VERSION = 1
KINDS = ("measured", "refit", "preset")


def _integer(value, what: str) -> int:
    """``value`` as an int: a JSON integer, or a number with no fractional part (``16.0``); a
    fraction, a boolean or a string is refused rather than truncated (``16.5`` is not 16 experts)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise SpecFitError(f"{what}: expected an integer, got {json_text(value)}")


def _check_kind(kind, source: str) -> None:
    if kind not in KINDS:
        raise SpecFitError(f"{source}: field 'kind' must be one of {KINDS}, got {json_text(kind)}")


@dataclass(frozen=True)
class ModelShape:
    """The MoE shape a profile's costs belong to.

    ``n_layers`` counts MoE layers (the layer axis of the expert cache and of traces: a dense
    layer has no experts to transfer) and ``expert_bytes`` one *routed* expert, the unit of a
    transfer. ``shared_expert_bytes`` are the shared expert(s) of one MoE layer (Qwen2-MoE,
    DeepSeek-V2): always resident with the dense weights, so their compute is part of the
    measured per-pass and per-node terms and never of the hit/miss terms. It is recorded, not
    compared: transfer costs depend on the routed experts only.
    """

    name: str
    n_layers: int
    n_experts: int
    top_k: int
    expert_bytes: int
    hidden_size: int = 0
    shared_expert_bytes: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, source: str) -> "ModelShape":
        if not isinstance(d, dict):
            raise SpecFitError(f"{source}: field 'shape' must be an object with {[f.name for f in fields(cls)]}")
        missing = [f.name for f in fields(cls) if f.name not in d and f.name not in ("hidden_size", "shared_expert_bytes")]
        if missing:
            raise SpecFitError(f"{source}: field 'shape' lacks {missing}")
        if not isinstance(d["name"], str):
            raise SpecFitError(f"{source}: field 'shape.name': expected a string, got {json_text(d['name'])}")
        counts = {f.name: _integer(d.get(f.name, 0), f"{source}: field 'shape.{f.name}'")
                  for f in fields(cls) if f.name != "name"}
        shape = cls(name=d["name"], **counts)
        if not (shape.n_layers >= 1 and shape.n_experts >= 1 and 1 <= shape.top_k <= shape.n_experts
                and shape.expert_bytes >= 1 and shape.hidden_size >= 0 and shape.shared_expert_bytes >= 0):
            raise SpecFitError(f"{source}: field 'shape' must have n_layers >= 1, n_experts >= 1, 1 <= top_k <= "
                               f"n_experts and expert_bytes >= 1, got n_layers={shape.n_layers}, "
                               f"n_experts={shape.n_experts}, top_k={shape.top_k}, expert_bytes={shape.expert_bytes}")
        return shape

    @classmethod
    def from_config(cls, config, dtype, name: str) -> "ModelShape":
        """The shape of a model with this :class:`~specfit.runtime.config.ModelConfig`, its experts
        stored in ``dtype`` (a torch dtype)."""
        return cls(name, config.n_moe_layers, config.n_experts, config.top_k, config.expert_bytes(dtype),
                   config.hidden_size, config.shared_expert_bytes(dtype))

    @classmethod
    def from_trace_meta(cls, model: dict) -> "ModelShape":
        """The shape a trace's ``model`` metadata describes."""
        return cls(model["name"], model["n_layers"], model["n_experts"], model["top_k"], model["expert_bytes"],
                   int(model.get("hidden_size", 0)), int(model.get("shared_expert_bytes", 0)))

    def same_shape(self, other: "ModelShape") -> bool:
        keys = ("n_layers", "n_experts", "top_k", "expert_bytes")
        return all(getattr(self, k) == getattr(other, k) for k in keys)


def machine_info(device) -> dict:
    """What the measurements ran on: ``device`` (a torch device or its name; on a GPU host a
    calibration may run on the CPU, or on another GPU than the first), host, library versions, and
    torch's intra-op threads (``--threads``: on a CPU they set how long a pass takes)."""
    import torch

    device = torch.device(device)
    info = {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "device": device.type,
        "device_name": platform.processor() or platform.machine(),
    }
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        info["device_name"] = torch.cuda.get_device_name(index)
        info["cuda"] = torch.version.cuda
    return info


@dataclass
class Profile:
    cost: CostModel
    shape: ModelShape
    kind: str = "measured"
    source: str = ""
    machine: dict = field(default_factory=dict)
    fit: dict = field(default_factory=dict)       # held-out error and what was fitted
    probes: dict = field(default_factory=dict)    # summary of the probe data
    created: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))

    def __post_init__(self) -> None:
        _check_kind(self.kind, "profile")

    @property
    def label(self) -> str:
        return f"{self.source or self.shape.name} ({self.kind})"

    @property
    def copy_latency_s(self) -> float:
        """The fixed latency of one host-to-device copy, whatever its bytes: the intercept of the
        calibration's H2D fit (``fit.h2d.overhead_s``); 0 for a profile without one (a preset is
        bytes over a published bandwidth). A bandwidth what-if (``--h2d-scale``) and a rescale to
        other expert bytes scale a miss's transfer less this part."""
        h2d = self.fit.get("h2d")
        latency = h2d.get("overhead_s") if isinstance(h2d, dict) else None
        return float(latency) if isinstance(latency, (int, float)) and math.isfinite(latency) and latency > 0 else 0.0

    # ------------------------------------------------------------------ shapes
    def for_shape(self, shape: ModelShape, rescale: bool = False, source: str = "profile") -> "Profile":
        """This profile for a model of ``shape``: itself when the shapes match; with ``rescale``,
        transfer costs scaled by the ratio of expert bytes (the compute terms and the latency of a
        copy, :attr:`copy_latency_s`, are kept); otherwise an error naming both shapes."""
        if self.shape.same_shape(shape):
            return self
        if not rescale:
            raise SpecFitError(
                f"{source}: made for {self.shape.name} ({self.shape.n_layers} layers, {self.shape.n_experts} "
                f"experts, top-{self.shape.top_k}, {self.shape.expert_bytes} B/expert), not for {shape.name} "
                f"({shape.n_layers} layers, {shape.n_experts} experts, top-{shape.top_k}, {shape.expert_bytes} "
                f"B/expert); pass --rescale to map its transfer costs by expert bytes"
            )
        ratio = shape.expert_bytes / self.shape.expert_bytes if self.shape.expert_bytes else 1.0
        cost = self.cost.scaled_transfer(ratio, self.copy_latency_s).replace(expert_bytes=shape.expert_bytes)
        return Profile(cost=cost, shape=shape, kind=self.kind, source=f"{self.label} rescaled to {shape.name}",
                       machine=self.machine, fit={**self.fit, "rescaled_from": self.shape.to_dict()},
                       probes=self.probes, created=self.created)

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        return {
            "profile_version": PROFILE_VERSION,
            "kind": self.kind,
            "source": self.source,
            "created": self.created,
            "machine": self.machine,
            "shape": self.shape.to_dict(),
            "cost": self.cost.to_dict(),
            "fit": self.fit,
            "probes": self.probes,
        }

    @classmethod
    def from_dict(cls, d: dict, source: str = "profile") -> "Profile":
        if not isinstance(d, dict):
            raise SpecFitError(f"{source}: expected a JSON object, got {json_text(d)}")
        version = d.get("profile_version")
        if version != PROFILE_VERSION:
            found = "field 'profile_version' is missing" if version is None else f"field 'profile_version' is {version!r}"
            raise SpecFitError(f"{source}: {found}, this SpecFit reads version {PROFILE_VERSION}")
        for key in ("shape", "cost"):
            if key not in d:
                raise SpecFitError(f"{source}: missing field '{key}'")
        try:
            cost = CostModel.from_dict(d["cost"], source=f"{source}: field 'cost'")
        except ValueError as exc:
            raise SpecFitError(str(exc)) from None
        cost.check_cycle_time(f"{source}: field 'cost'")
        shape = ModelShape.from_dict(d["shape"], source)
        if cost.expert_bytes and cost.expert_bytes != shape.expert_bytes:
            raise SpecFitError(f"{source}: field 'cost.expert_bytes' is {cost.expert_bytes}, but 'shape.expert_bytes' is "
                               f"{shape.expert_bytes}; expected the same expert size in both")
        kind = d.get("kind", "measured")
        _check_kind(kind, source)
        texts = {key: _field(d, key, str, "a string", source, default="") for key in ("source", "created")}
        sections = {key: _field(d, key, dict, "a JSON object", source, default={})
                    for key in ("machine", "fit", "probes")}
        _check_fit(sections["fit"], source)
        sections["fit"] = nulls_as_nan(sections["fit"], keep=FIT_NULL_MEANS_NONE)   # strict JSON's nulls
        _check_probes(sections["probes"], source)
        return cls(cost=cost, shape=shape, kind=kind, **texts, **sections)

    def save(self, path: str | Path) -> Path:
        return write_json_atomic(path, self.to_dict())


def _field(d: dict, key: str, kind: type, expected: str, source: str, default):
    value = d.get(key, default)
    if not isinstance(value, kind):
        raise SpecFitError(f"{source}: field '{key}': expected {expected}, got {json_text(value)}")
    return value


def held_out_unit(fit: dict) -> str:
    """What a profile's held-out error is over: the probes' passes, or the decode cycles a
    ``calibrate --refit`` (and the demo's warm-up) fitted it on."""
    return "decode cycles" if fit.get("refit") else "passes"


# entries of 'fit' whose null means "not measured" (no pageable copies on a CPU; a CPU share only
# with one torch thread on a CPU), not a number without a value
FIT_NULL_MEANS_NONE = ("h2d_pageable", "cpu_share")


# the entries of 'fit' and 'probes' that the summaries and the report read, and what each holds
FIT_OBJECTS = ("holdout", "h2d", "h2d_pageable", "probe_noise", "held", "refit")
FIT_NULLABLE = ("h2d_pageable",)                                     # null: no pageable copies measured (CPU)
FIT_LISTS = ("fitted", "warnings")
PROBE_TABLES = ("h2d", "expert_compute", "cycles", "draft")          # one object per measurement


def _check_fit(fit: dict, source: str) -> None:
    for key, value in fit.items():
        if key in FIT_OBJECTS and not isinstance(value, dict) and not (value is None and key in FIT_NULLABLE):
            raise SpecFitError(f"{source}: field 'fit.{key}': expected a JSON object, got {json_text(value)}")
        if key in FIT_LISTS and not isinstance(value, list):
            raise SpecFitError(f"{source}: field 'fit.{key}': expected a list, got {json_text(value)}")


def _check_probes(probes: dict, source: str) -> None:
    for key in PROBE_TABLES:
        rows = probes.get(key, [])
        bad = rows if not isinstance(rows, list) else next((r for r in rows if not isinstance(r, dict)), None)
        if bad is not None:
            got = json_text(rows) if bad is rows else f"a list holding {json_text(bad)}"
            raise SpecFitError(f"{source}: field 'probes.{key}': expected a list of objects (one per measurement), "
                               f"got {got}")


def load_profile(path: str | Path) -> Profile:
    """Read a profile JSON; a missing file, corrupt JSON or wrong fields are one clear error."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecFitError(f"{path}: no such profile file") from None
    except UnicodeDecodeError as exc:
        raise SpecFitError(f"{path}: not UTF-8 JSON (byte {exc.start}: {exc.reason}); expected a profile JSON "
                           f"written by `specfit calibrate`") from None
    except OSError as exc:
        raise SpecFitError(f"{path}: cannot read the profile ({exc.strerror})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecFitError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    return Profile.from_dict(data, source=str(path))
