"""Traces: the Parquet trace format (:mod:`.format`), synthetic traces (:mod:`.synth` with the
drafter and routing models of :mod:`.drafter` and :mod:`.routing`), routing-log importers
(:mod:`.importers`), statistics (:mod:`.stats`, :mod:`.summary`) and the ``specfit traces``
commands (:mod:`.commands`)."""
