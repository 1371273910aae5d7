"""Hardware presets for what-ifs, derived from published numbers — not measurements.

Transfer cost of a miss = expert bytes / link bandwidth (pinned host memory):
PCIe Gen4 ~25 GB/s, PCIe Gen5 ~50 GB/s (H100/H200 hosts), GH200 NVLink-C2C ~340 GB/s.
The compute terms are those of an H100-class GPU running Qwen3-30B-A3B at batch size 1:
reading one expert from HBM (~3 TB/s; 9.44 MB in bf16) plus kernel launches (``hit_s``, which
follows the shape's expert bytes like a transfer), the dense part of 48 layers (``base_s``), the marginal cost of one more verified token (``per_node_s``) and
one EAGLE-3 draft level (``draft_level_s``). ``specfit calibrate`` replaces all of them with
measurements of the machine at hand.
"""

from __future__ import annotations

from pathlib import Path

from ..costmodel import CostModel
from ..errors import SpecFitError
from .profile import ModelShape, Profile, load_profile

__all__ = ["PRESETS", "QWEN3_30B_A3B", "OLMOE_1B_7B", "MIXTRAL_8X7B", "SHAPES", "preset_profile", "resolve_profile"]

# expert bytes in bf16: 3 matrices of hidden x moe_intermediate
QWEN3_30B_A3B = ModelShape("qwen3-30b-a3b", n_layers=48, n_experts=128, top_k=8,
                           expert_bytes=3 * 2048 * 768 * 2, hidden_size=2048)
OLMOE_1B_7B = ModelShape("olmoe-1b-7b", n_layers=16, n_experts=64, top_k=8,
                         expert_bytes=3 * 2048 * 1024 * 2, hidden_size=2048)
MIXTRAL_8X7B = ModelShape("mixtral-8x7b", n_layers=32, n_experts=8, top_k=2,
                          expert_bytes=3 * 4096 * 14336 * 2, hidden_size=4096)
SHAPES = {s.name: s for s in (QWEN3_30B_A3B, OLMOE_1B_7B, MIXTRAL_8X7B)}

# name: (link bandwidth in GB/s, description)
PRESETS = {
    "pcie4": (25.0, "PCIe Gen4 x16 host link, ~25 GB/s pinned H2D (preset, not measured)"),
    "pcie5": (50.0, "PCIe Gen5 x16 host link, ~50 GB/s pinned H2D (preset, not measured)"),
    "gh200": (340.0, "GH200 NVLink-C2C, ~340 GB/s H2D (preset, not measured)"),
}

_HBM_BPS = 3e12        # an H100-class GPU's HBM, ~3 TB/s
_HIT_S = 8e-6          # one resident Qwen3 expert for a few tokens: 9.44 MB read at ~3 TB/s + launches
_LAUNCH_S = _HIT_S - QWEN3_30B_A3B.expert_bytes / _HBM_BPS    # the launches: ~4.9 us
_BASE_S = 5e-3         # attention + dense weights + launches of 48 layers, one token
_PER_NODE_S = 3e-5     # one more token in the verification batch
_DRAFT_LEVEL_S = 6e-4  # one EAGLE-3 draft level (one decoder layer + draft lm_head)


def preset_profile(name: str, shape: ModelShape = QWEN3_30B_A3B) -> Profile:
    """The preset ``name`` for a model of ``shape``: a transfer and a hit follow its expert bytes
    (a hit reads the expert from HBM: a Mixtral expert's 352 MB take 117 us there, not the 8 us of
    Qwen3's 9.44 MB), the other compute terms stay those of Qwen3-30B-A3B on an H100-class GPU."""
    if name not in PRESETS:
        raise SpecFitError(f"profile preset {name!r}: expected one of {sorted(PRESETS)} or a profile JSON file")
    gbps, description = PRESETS[name]
    transfer_s = shape.expert_bytes / (gbps * 1e9)
    hit_s = _LAUNCH_S + shape.expert_bytes / _HBM_BPS
    cost = CostModel(base_s=_BASE_S, per_node_s=_PER_NODE_S, hit_s=hit_s, miss_s=hit_s + transfer_s,
                     draft_level_s=_DRAFT_LEVEL_S, expert_bytes=shape.expert_bytes)
    return Profile(cost=cost, shape=shape, kind="preset", source=name,
                   fit={"note": description, "h2d_gbps": gbps}, machine={"device": "preset", "device_name": description})


def resolve_profile(spec: str | Path, shape: ModelShape | None = None, rescale: bool = False) -> Profile:
    """A preset name or a profile JSON path, for a model of ``shape`` (when given).

    A preset is built for ``shape`` directly; a measured profile of another shape is refused
    unless ``rescale`` (see :meth:`Profile.for_shape`).
    """
    spec = str(spec)
    if spec in PRESETS:
        return preset_profile(spec, shape or QWEN3_30B_A3B)
    path = Path(spec)
    if not path.suffix == ".json" and not path.exists():
        raise SpecFitError(f"--profile {spec!r}: expected a preset ({', '.join(sorted(PRESETS))}) or a profile JSON file")
    profile = load_profile(path)
    return profile if shape is None else profile.for_shape(shape, rescale=rescale, source=str(path))
