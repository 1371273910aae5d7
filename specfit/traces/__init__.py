"""Traces: the Parquet trace format (:mod:`.format`), synthetic traces (:mod:`.synth` with the
drafter and routing models of :mod:`.drafter` and :mod:`.routing`), routing-log importers
(:mod:`.importers`), statistics (:mod:`.stats`, :mod:`.summary`) and the ``specfit traces``
commands (:mod:`.commands`)."""

from .format import SCHEMA_VERSION, Trace, read_trace, validate_trace, write_trace

__all__ = ["SCHEMA_VERSION", "Trace", "read_trace", "write_trace", "validate_trace"]
