"""The trace-driven simulator: counterfactual replay of position-indexed traces
(:mod:`.replay`), sweeps over policies, cache sizes and cost models (:mod:`.sweep`), what-if
changes to cost models (:mod:`.whatif`) and the ``specfit simulate`` command (:mod:`.commands`)."""
