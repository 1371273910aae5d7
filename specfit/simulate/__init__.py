"""The trace-driven simulator: counterfactual replay of position-indexed traces
(:mod:`.replay`), sweeps over policies, cache sizes and cost models (:mod:`.sweep`), what-if
changes to cost models (:mod:`.whatif`, :mod:`.scenarios`) and the ``specfit simulate`` command
(:mod:`.commands`); grids of replays on Ray (:mod:`.grid` the spec and its cells,
:mod:`.distributed` the execution, :mod:`.dataset` the resumable results) and the memory-budget
planner (:mod:`.plan`), with the ``specfit sweep`` / ``specfit plan`` commands
(:mod:`.sweep_commands`). Ray is imported only by the sweep's execution."""
