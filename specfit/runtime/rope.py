"""Rotary position embeddings: the frequencies of every RoPE variant the supported families use.

A config names its RoPE in one of two spellings: the hub's (``rope_theta`` at the top level and an
optional ``rope_scaling`` block whose kind is ``type`` or ``rope_type``) or what ``transformers``
5.x writes (``rope_parameters: {rope_theta, rope_type, ...}``). As in ``transformers``, a
``rope_scaling`` block takes precedence and a top-level ``rope_theta`` fills a block that has none;
a top-level ``original_max_position_embeddings`` overrides the block's for ``yarn`` and ``llama3``.

Variants (the formulas of ``transformers.modeling_rope_utils``, operation by operation in float32,
so the frequencies agree bit for bit):

- ``default``: ``inv_freq[i] = 1 / theta^(2i / dim)``;
- ``linear``: the default divided by ``factor`` (positions interpolated);
- ``dynamic`` (NTK): the default until a pass reaches beyond ``max_position_embeddings``, then the
  base grows with the sequence length (``base * (factor * len / max_pos - (factor - 1))^(dim / (dim - 2))``);
  like ``transformers`` the frequencies are recomputed when a pass goes beyond the longest length
  seen so far and reset when a pass is back inside the original length (keys already cached keep
  the frequencies they were rotated with);
- ``yarn``: interpolated and extrapolated frequencies blended by a linear ramp between the
  correction dimensions of ``beta_fast`` / ``beta_slow``, with cos/sin scaled by an attention
  factor (from ``mscale`` / ``mscale_all_dim`` when given);
- ``llama3``: long wavelengths divided by ``factor``, a smooth blend between ``low_freq_factor`` and
  ``high_freq_factor`` (EAGLE-3 heads of Llama 3 targets use it).

:class:`Rotary` holds the frequencies of one model and returns cos/sin for explicit positions; the
attention factor multiplies cos and sin before they are cast to the compute dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import SpecFitError
from ..io import config_value

__all__ = ["RopeSpec", "parse_rope", "Rotary", "yarn_mscale"]

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


@dataclass(frozen=True)
class RopeSpec:
    """What a config says about its RoPE (``rope_type`` one of :data:`ROPE_TYPES`)."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    def describe(self) -> str:
        if self.rope_type == "default":
            return f"RoPE theta {self.theta:g}"
        return f"RoPE theta {self.theta:g}, {self.rope_type} x{self.factor:g}"


def parse_rope(raw: dict, source: str, max_position_embeddings: int, default_theta: float | None = None) -> RopeSpec:
    """The RoPE of a ``config.json`` (either spelling); one clear error for an unknown variant, a
    missing parameter or a value of the wrong kind (read as :func:`config_value` reads; null is
    absent)."""
    scaling = raw.get("rope_scaling")
    params = raw.get("rope_parameters")
    key = "rope_scaling" if isinstance(scaling, dict) and scaling else "rope_parameters"
    block = scaling if key == "rope_scaling" else params
    if block is not None and not isinstance(block, dict):
        raise SpecFitError(f"{source}: key {key!r} must be an object, got {block!r}")
    block = dict(block or {})

    def number(name, default=None, kind=float):
        value = block.get(name)
        return default if value is None else config_value(value, f"{key}.{name}", source, kind)

    theta_key = f"{key}.rope_theta" if block.get("rope_theta") is not None else "rope_theta"
    if block.get("rope_theta") is not None:
        theta = number("rope_theta")
    elif raw.get("rope_theta") is not None:
        theta = config_value(raw["rope_theta"], "rope_theta", source, float)
    elif default_theta is not None:
        theta = float(default_theta)
    else:
        raise SpecFitError(f"{source}: missing key 'rope_theta' (or 'rope_parameters.rope_theta')")
    if not (math.isfinite(theta) and theta > 0):      # 0 or less: NaN frequencies; infinite: no rotation at all
        raise SpecFitError(f"{source}: key {theta_key!r} must be a finite number > 0, got {theta}")
    rope_type = next((str(block[k]) for k in ("rope_type", "type") if block.get(k) is not None), "default")
    if rope_type not in ROPE_TYPES:
        raise SpecFitError(f"{source}: key {key!r} has rope_type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    if number("partial_rotary_factor", 1.0) != 1.0:
        raise SpecFitError(f"{source}: key {key!r} has partial_rotary_factor {block['partial_rotary_factor']}; "
                           f"only full-width RoPE is supported")
    if rope_type == "default":
        return RopeSpec(theta=theta)
    original_key = f"{key}.original_max_position_embeddings"
    original = number("original_max_position_embeddings", kind=int)
    if rope_type in ("yarn", "llama3") and raw.get("original_max_position_embeddings") is not None:
        # transformers' precedence: a top-level key (Phi-3's spelling) overrides the block's
        original_key = "original_max_position_embeddings"
        original = config_value(raw[original_key], original_key, source, int)
    factor = number("factor")
    if rope_type == "yarn":
        original = original or int(max_position_embeddings)
        if factor is None:   # DeepSeek-V3 style: the ratio of the extended to the original length
            factor = max_position_embeddings / original
    if factor is None:
        raise SpecFitError(f"{source}: key '{key}.factor' is required for rope_type {rope_type!r}")
    if rope_type in ("linear", "dynamic") and factor < 1.0:
        raise SpecFitError(f"{source}: key '{key}.factor' must be >= 1 for rope_type {rope_type!r}, got {factor}")
    # 0 or less divides the frequencies by 0 or flips them; an original length below 1 takes a log of 0 or less
    if not (math.isfinite(factor) and factor > 0):
        raise SpecFitError(f"{source}: key '{key}.factor' must be a finite number > 0, got {factor}")
    if original is not None and original < 1:
        raise SpecFitError(f"{source}: key {original_key!r} must be at least 1, got {original}")
    if rope_type == "llama3":
        missing = [name for name in ("low_freq_factor", "high_freq_factor") if block.get(name) is None]
        missing += ["original_max_position_embeddings"] if original is None else []
        if missing:
            raise SpecFitError(f"{source}: key {key!r} (rope_type 'llama3') misses {missing}")
        low, high = number("low_freq_factor"), number("high_freq_factor")
        if not 0 < low < high:      # the blend between them divides by each and by their difference
            raise SpecFitError(f"{source}: keys '{key}.low_freq_factor' and '{key}.high_freq_factor' must satisfy "
                               f"0 < low < high, got {low} and {high}")
    return RopeSpec(theta=theta, rope_type=rope_type, factor=factor, original_max_position_embeddings=original,
                    beta_fast=number("beta_fast") or 32.0, beta_slow=number("beta_slow") or 1.0,
                    mscale=number("mscale"), mscale_all_dim=number("mscale_all_dim"),
                    attention_factor=number("attention_factor"), truncate=number("truncate", True, kind=bool),
                    low_freq_factor=number("low_freq_factor", 1.0), high_freq_factor=number("high_freq_factor", 4.0))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _default_inv_freq(base, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))


def _yarn(spec: RopeSpec, dim: int) -> tuple[torch.Tensor, float]:
    factor, base = spec.factor, spec.theta
    attention_factor = spec.attention_factor
    if attention_factor is None:
        if spec.mscale and spec.mscale_all_dim:
            attention_factor = float(yarn_mscale(factor, spec.mscale) / yarn_mscale(factor, spec.mscale_all_dim))
        else:
            attention_factor = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(spec.original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001   # no singular ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_share = 1 - ramp
    return interpolation * (1 - extrapolation_share) + extrapolation * extrapolation_share, attention_factor


def _llama3(spec: RopeSpec, dim: int) -> torch.Tensor:
    inv_freq = _default_inv_freq(spec.theta, dim)
    old = spec.original_max_position_embeddings
    low_wavelen, high_wavelen = old / spec.low_freq_factor, old / spec.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / spec.factor, inv_freq)
    smooth = (old / wavelen - spec.low_freq_factor) / (spec.high_freq_factor - spec.low_freq_factor)
    smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def inv_freq_and_scale(spec: RopeSpec, dim: int, max_position_embeddings: int,
                       seq_len: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """float32 ``inv_freq [dim / 2]`` and the cos/sin factor; ``seq_len`` only matters for
    ``dynamic`` (None: the original length)."""
    if spec.rope_type == "default":
        return 1.0 / (spec.theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    if spec.rope_type == "linear":
        return _default_inv_freq(spec.theta, dim) / spec.factor, 1.0
    if spec.rope_type == "dynamic":
        if seq_len is None:
            return _default_inv_freq(spec.theta, dim), 1.0   # the growth term is 1 at the original length
        # a tensor length, as transformers' dynamic update passes it: the base becomes a float32 tensor
        seq_len = torch.maximum(seq_len, torch.tensor(max_position_embeddings, dtype=seq_len.dtype))
        base = spec.theta * ((spec.factor * seq_len / max_position_embeddings) - (spec.factor - 1)) ** (dim / (dim - 2))
        return _default_inv_freq(base, dim), 1.0
    if spec.rope_type == "yarn":
        return _yarn(spec, dim)
    return _llama3(spec, dim), 1.0


class Rotary:
    """The RoPE of one model: float32 frequencies on ``device`` and cos/sin for explicit positions.

    Frequencies stay in float32 whatever the compute dtype; cos and sin are computed in float32,
    multiplied by the attention factor and only then cast, as ``transformers`` does.
    """

    def __init__(self, spec: RopeSpec, dim: int, max_position_embeddings: int, device=None):
        self.spec, self.dim, self.max_position_embeddings = spec, int(dim), int(max_position_embeddings)
        inv_freq, self.attention_scaling = inv_freq_and_scale(spec, self.dim, self.max_position_embeddings)
        self.original_inv_freq = inv_freq.to(device)
        self.inv_freq = self.original_inv_freq
        self._longest = self.max_position_embeddings     # dynamic: the length the frequencies are for

    def to(self, device) -> "Rotary":
        self.original_inv_freq = self.original_inv_freq.to(device)
        self.inv_freq = self.inv_freq.to(device)
        return self

    def freqs(self, positions: torch.Tensor) -> torch.Tensor:
        """float32 angles [T, dim / 2] of ``positions`` [T]."""
        if self.spec.rope_type == "dynamic" and positions.numel():
            self._dynamic_update(positions)
        if positions.device != self.inv_freq.device:       # the model uploads them with its inputs
            positions = positions.to(self.inv_freq.device)
        return positions.float()[:, None] * self.inv_freq[None, :]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Half-split cos, sin [T, dim] (``cat(freqs, freqs)``) in ``dtype``."""
        freqs = self.freqs(positions)
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = self.attention_scaling
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)

    def _dynamic_update(self, positions: torch.Tensor) -> None:
        seq_len = positions.max().cpu() + 1
        if int(seq_len) > self._longest:        # growth: frequencies for the longer sequence
            inv_freq, _ = inv_freq_and_scale(self.spec, self.dim, self.max_position_embeddings, seq_len=seq_len)
            self.inv_freq = inv_freq.to(self.original_inv_freq.device)
            self._longest = int(seq_len)
        if int(seq_len) < self.max_position_embeddings < self._longest:   # back inside: the original ones
            self.inv_freq = self.original_inv_freq
            self._longest = self.max_position_embeddings
