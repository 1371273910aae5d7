"""The trace-driven simulator: counterfactual replay of position-indexed traces
(:mod:`.replay`), sweeps over policies, cache sizes and cost models (:mod:`.sweep`), what-if
changes to cost models (:mod:`.whatif`) and the ``specfit simulate`` command (:mod:`.commands`)."""

from .replay import PreparedTrace, prepare, replay
from .sweep import Scenario, run_sweep

__all__ = ["PreparedTrace", "prepare", "replay", "Scenario", "run_sweep"]
