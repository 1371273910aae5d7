"""The tiny trained MoE target and EAGLE-3 drafter bundled with SpecFit, and the demo prompts.

The files live inside the installed package (``pyproject.toml`` ships ``assets/**/*``); the
functions here return their paths through :mod:`importlib.resources`, so they are found from a
source checkout and from an installed wheel alike. ``README.md`` next to them is the model card;
``scripts/train_tiny.py`` rebuilds them.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

__all__ = ["tiny_moe_dir", "tiny_moe_eagle3_dir", "demo_prompts_path", "assets_dir"]


def assets_dir() -> Path:
    """The directory holding every bundled asset."""
    # the package is installed as plain files (no zip import), so the traversable is a real path
    return Path(str(resources.files(__name__)))


def tiny_moe_dir() -> Path:
    """The tiny Qwen3-MoE target: config.json, model.safetensors, tokenizer.json."""
    return assets_dir() / "tiny-moe"


def tiny_moe_eagle3_dir() -> Path:
    """The EAGLE-3 drafter trained for :func:`tiny_moe_dir` (published checkpoint format)."""
    return assets_dir() / "tiny-moe-eagle3"


def demo_prompts_path() -> Path:
    """JSON Lines prompts for the demo: ``{"prompt": ..., "workload": "docs" | "math"}``."""
    return assets_dir() / "prompts.jsonl"
