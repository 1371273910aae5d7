"""The ``specfit decode`` job: load the target (and drafter), resolve the hardware profile, decode
every prompt with every policy, measure each cycle next to its prediction, save as it goes.

Outputs under ``--out DIR`` (rewritten atomically after every prompt, and once more if the run is
interrupted, so every completed cycle survives):

- ``decode.jsonl``: one object per (policy, prompt): output ids, text, tokens/s, bytes, hits;
- ``cycles.parquet``: one row per cycle in the schema live runs and replays share
  (:data:`specfit.accounting.CYCLE_COLUMNS`: predicted next to measured time, bytes, hits,
  misses, union sizes and committed tokens, plus the draft / verify / target-pass / transfer /
  drafter / search times), keyed by policy, sequence (prompt), position and cycle;
- ``summary.json``: per policy, :func:`specfit.accounting.summarise` of its cycles (the errors of
  the profile's predictions and of the online-refitted model's, side by side) and the online
  model's final parameters.

Every policy decides with a cost model refitted on its own recent cycles as the run goes, the
profile as the prior (:class:`specfit.calibrate.online.OnlineCostModel`); ``online_refit=False``
(``--frozen-profile``) keeps the profile.

``--record TRACE`` writes the cycles of one policy as a trace; with ``--record-full`` a pass per
prompt that verifies the whole drafted tree and commits one token records the position-indexed
trace that the simulator replays exactly.

Before the measured runs, every policy decodes a few tokens of the first prompt untimed (lazy
kernel loading and library heuristics would otherwise land in its first cycles).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..accounting import live_row, summarise, waiting_note
from ..errors import INTERRUPTS, PEER_ERRORS, Interrupted, SpecFitError, check_seed, interrupted, out_of_memory_text
from ..io import run_dir_lock
from .prefill import PREFILL_CHUNK, check_prefill_chunk
from .run_dir import CYCLES_FILE, JOURNAL_FILE, OUTPUT_FILE, SUMMARY_FILE, DecodeOutputs, read_decode_cycles

# the predictors a recorded trace can fit before a live run (--predictor-trace)
FITTED_PREDICTORS = ("affinity", "learned")

__all__ = ["DecodePlan", "DecodeRun", "run_decode", "summarise_policy", "read_decode_cycles", "OUTPUT_FILE",
           "CYCLES_FILE", "SUMMARY_FILE", "JOURNAL_FILE", "WARMUP_TOKENS", "ROUNDING_TIE_UNITS", "rounding_ties"]

WARMUP_TOKENS = 4
# how close (in units of the compute dtype's epsilon times the row's largest |logit|) the target's
# logits of the tokens the policies chose must be for their outputs' first difference to be a
# rounding tie: a tree verification pass's logits differ from a one-token pass's by up to about one
# unit in a 16-bit dtype (the bundled model: 0.76 in bfloat16, 0.96 in float16), a deeper model's by
# more; float32's differ by several of its much smaller units (8.3), all sums rounding apart, hence
# the floor on the unit
ROUNDING_TIE_UNITS = 4.0
ROUNDING_UNIT_FLOOR = 2.0 ** -20
NOTHING_DECODED = "interrupted before the first cycle: no cycle was decoded, so none was kept"


@dataclass
class DecodePlan:
    """Everything ``specfit decode`` was asked to do (the command's options)."""

    model_dir: Path
    prompts_path: Path
    cache_experts: int
    policies: list[str] = field(default_factory=lambda: ["ar"])
    drafter_dir: Path | None = None
    profile: str | None = None
    rescale: bool = False
    max_new_tokens: int = 128
    device: str | None = None
    dtype: str | None = None
    out_dir: Path | None = None
    record: Path | None = None
    record_full: bool = False
    temperature: float = 0.0
    seed: int = 0
    tree_top_k: int = 4
    max_levels: int = 8
    acceptance_trace: Path | None = None
    ignore_eos: bool = False
    cache_mode: str = "per_layer"
    cache_policy: str = "lru"
    predictor: str = "router"
    predictor_trace: Path | None = None   # a recorded trace the predictor is fitted on before decoding
    router_adapt: bool = True       # the router predictor learns a context weight per layer (False: fixed)
    warmup: bool = True
    online_refit: bool = True       # refit the cost model on the run's cycles as it goes (False: frozen profile)
    # each prompt decoded by every policy in turn (rotating order), one expert cache for all, so a
    # machine whose speed drifts slows every policy alike (False: policy after policy)
    interleave: bool = False
    # with interleave: each policy keeps its own expert cache across the prompts, as policy after
    # policy would (the caches take turns on the device between prompts, off the clock)
    cache_per_policy: bool = False
    # the prompt through the target and the drafter in passes of at most this many tokens (0: one pass)
    prefill_chunk: int = PREFILL_CHUNK

    def validate(self):
        """Check the options that need no file; return the parsed policies."""
        from ..policies import SequoiaPolicy, make_policy
        from ..specfit_policy import MAX_LEVELS

        if not self.policies:
            raise SpecFitError("--policy: expected at least one policy")
        policies = []
        for spec in self.policies:
            try:
                policies.append(make_policy(spec, max_levels=self.max_levels))
            except ValueError as exc:
                message = f"--policy: {exc}"
                if not 1 <= self.max_levels <= MAX_LEVELS:
                    try:                # a spec that builds with a level: --max-levels is what is wrong
                        make_policy(spec, max_levels=1)
                        expected = ">= 1" if self.max_levels < 1 else f"at most {MAX_LEVELS}"
                        message = f"--max-levels: expected {expected} draft levels for --policy {spec}, got {self.max_levels}"
                    except ValueError:
                        pass
                raise SpecFitError(message) from None
        option = "--policies" if len(policies) > 1 else "--policy"
        for p in policies:
            if p.needs_truth:
                raise SpecFitError(f"{option} {p.name}: knows the target's verdicts in advance, which only a recorded "
                                   f"trace can offer; use it with `specfit simulate`")
            if p.simulator_only:
                raise SpecFitError(f"{option} {p.name}: only a replay can run it (it imposes its own cache or is tuned "
                                   f"on a trace); use it with `specfit simulate`")
        sequoia = [p.name for p in policies if isinstance(p, SequoiaPolicy) and p.rates is None]
        if sequoia and self.acceptance_trace is None:
            raise SpecFitError(f"{option} {sequoia[0]}: fixes its tree from positional acceptance rates, fitted on a "
                               f"recorded trace of this model and drafter; pass --acceptance TRACE (e.g. one written "
                               f"by decode --record)")
        drafting = [p.name for p in policies if p.max_levels > 0]
        if (drafting or self.record_full) and self.drafter_dir is None:
            raise SpecFitError(f"--policy {(drafting or ['(--record-full)'])[0]}: needs a drafter (--drafter DIR, an "
                               f"EAGLE-3 checkpoint); only 'ar' decodes without one")
        if len(set(self.policies)) != len(self.policies):
            raise SpecFitError(f"--policies: {','.join(self.policies)} names a policy twice")
        checks = [
            (self.max_new_tokens < 1, f"--max-new-tokens: expected at least 1, got {self.max_new_tokens}"),
            (self.cache_experts < 0, f"--cache-experts: expected a non-negative number of experts, got {self.cache_experts}"),
            (self.tree_top_k < 1, f"--tree-top-k: expected at least 1, got {self.tree_top_k}"),
            (self.max_levels < 0, f"--max-levels: expected at least 0, got {self.max_levels}"),
            (not math.isfinite(self.temperature) or self.temperature < 0,
             f"--temperature: expected a non-negative number, got {self.temperature}"),
            (self.record_full and self.record is None, "--record-full: pass --record TRACE, the trace file to write"),
            (self.record is not None and self.temperature > 0,
             "--record: traces describe greedy decoding (the target's argmax verdicts); use --temperature 0"),
            (self.record is not None and self.max_new_tokens == 1,
             "--record: --max-new-tokens 1 ends every output at the prompt pass's token, so no decode cycle runs and "
             "there is nothing to record; expected at least 2"),
            (self.record is not None and not self.record_full and len(policies) != 1,
             "--record: records the cycles of one policy; pass a single --policy (or --record-full)"),
            (self.cache_per_policy and not self.interleave,
             "--cache-per-policy: only with --interleave (policy after policy, each policy already starts from its "
             "own empty cache)"),
        ]
        for failed, message in checks:
            if failed:
                raise SpecFitError(message)
        check_prefill_chunk(self.prefill_chunk)
        if self.temperature > 0:
            _learn_sampled_acceptance(policies, option)
        check_seed(self.seed)
        from .devices import resolve_device

        resolve_device(self.device)
        if self.dtype is not None:
            from ..calibrate.calibrate_job import check_dtype

            check_dtype(self.dtype)        # the dtypes a profile can be calibrated in
        from ..experts.cache import EVICTION_POLICIES
        from ..experts.predictors import LIVE_PREDICTORS

        if self.cache_mode not in ("per_layer", "global"):
            raise SpecFitError(f"--cache-mode: expected per_layer or global, got {self.cache_mode!r}")
        if self.cache_policy not in EVICTION_POLICIES:
            raise SpecFitError(f"--cache-policy: expected one of {', '.join(EVICTION_POLICIES)}, got {self.cache_policy!r}")
        if self.predictor not in LIVE_PREDICTORS:
            raise SpecFitError(f"--predictor: expected one of {', '.join(LIVE_PREDICTORS)} (live), got {self.predictor!r}")
        if not self.router_adapt and self.predictor != "router":
            raise SpecFitError(f"--router-fixed: fixes the router predictor's context weight; --predictor is {self.predictor}")
        if self.predictor_trace is not None:
            if self.predictor not in FITTED_PREDICTORS:
                raise SpecFitError(f"--predictor-trace: fits {' or '.join(FITTED_PREDICTORS)}; --predictor "
                                   f"{self.predictor} learns nothing from a trace")
            if not Path(self.predictor_trace).is_file():
                raise SpecFitError(f"--predictor-trace {self.predictor_trace}: no such trace file")
        if self.acceptance_trace is not None and not Path(self.acceptance_trace).is_file():
            raise SpecFitError(f"--acceptance {self.acceptance_trace}: no such trace file")
        if not Path(self.model_dir).is_dir():
            raise SpecFitError(f"--model {self.model_dir}: not a directory")
        from ..io import check_output
        from ..runinfo import check_run_dir

        check_run_dir(self.out_dir, "decode", files=(OUTPUT_FILE, CYCLES_FILE, SUMMARY_FILE, JOURNAL_FILE))
        check_output(self.record, "--record", kind="file")
        if self.drafter_dir is not None and not Path(self.drafter_dir).is_dir():
            raise SpecFitError(f"--drafter {self.drafter_dir}: not a directory")
        return policies


@dataclass
class DecodeRun:
    """What a run produced: per-(policy, prompt) records, per-cycle rows, per-policy summaries."""

    records: list[dict]
    cycles: list[dict]
    summaries: list[dict]
    profile_label: str
    profile_path: Path | None
    outputs_identical: bool | None       # greedy runs of several policies: same tokens everywhere?
    differing_lines: list[int] = field(default_factory=list)   # ... if not, the prompts' lines where they differ
    tie_lines: list[int] = field(default_factory=list)         # ... those whose outputs part at rounding ties only
    dtype: str = "float32"                       # the target's compute dtype
    trace_path: Path | None = None
    trace_cycles: int = 0
    policies: list = field(default_factory=list)   # the policy objects, with what they learned
    memory: dict = field(default_factory=dict)   # host expert bytes, pinned bytes, device expert-slot bytes
    drafter_features: str | None = None          # which target layers feed the drafter
    notes: list[str] = field(default_factory=list)   # what the user should know (e.g. a profile not used)

    @property
    def outputs_within_rounding(self) -> bool:
        """The greedy outputs differ, and every two of a prompt's outputs part at a rounding tie
        (:func:`rounding_ties`): lossless up to the compute dtype's rounding."""
        return self.outputs_identical is False and self.tie_lines == self.differing_lines


def run_decode(plan: DecodePlan, on_record: Callable[[dict], None] | None = None,
               status: Callable[[str], None] | None = None, progress: Callable[[], None] | None = None,
               ctx=None) -> DecodeRun:
    """Run ``plan``; ``on_record`` gets each (policy, prompt) record as it completes, ``status``
    one-line messages (loading, calibrating), ``progress`` a tick per decoded prompt; ``ctx`` the
    command's context, for the command line ``run.json`` records."""

    say = status or (lambda message: None)
    policies = plan.validate()
    created = _first_missing(plan.out_dir)

    def leave_nothing():
        """Bad input or a stop before any cycle: the folders this run made go (an --out that
        existed keeps what it held)."""
        if created is not None:
            import shutil

            shutil.rmtree(created, ignore_errors=True)

    # a second run writing the same directory at once would delete and mix this one's files: it is
    # refused before either loads anything
    with run_dir_lock(plan.out_dir, "decode"):
        try:
            inputs = _load(plan, say)
            inputs.notes.extend(sampled_acceptance_note(plan, policies))
            from ..policies import SequoiaPolicy

            if any(isinstance(p, SequoiaPolicy) and p.rates is None for p in policies):
                from ..sequoia import trace_rates        # fitted only for a policy that takes them

                _fit_sequoia(plan, policies, trace_rates(inputs.acceptance), inputs.notes)
            model, profile = inputs.model, inputs.profile
            start = None
            if plan.out_dir is not None:
                from ..calibrate.calibrate_job import drafter_identity
                from ..calibrate.profile import ModelShape
                from ..runinfo import write_run_info

                # the shape the cycles were measured on: a refit must not move them onto another one
                shape = ModelShape.from_config(model.config, model.dtype, Path(plan.model_dir).name)
                # written with the first result (a rerun failing before it keeps the last run's)
                # the profile's file (a cached one is picked by the machine) and figures: a file may
                # change under its name, a preset in the code; and the drafter whose levels the
                # cycles timed (a refit's draft level is that drafter's); how the policies priced
                # acceptance, and the notes the terminal says before its own, for the report to say
                start = functools.partial(write_run_info, plan.out_dir, "decode", ctx, shape=shape.to_dict(),
                                          profile=profile.label, profile_file=inputs.profile_path and
                                          str(Path(inputs.profile_path).resolve()), cost_model=profile.cost.to_dict(),
                                          drafter=plan.drafter_dir and drafter_identity(plan.drafter_dir),
                                          acceptance=plan.acceptance_trace and str(plan.acceptance_trace),
                                          temperature=plan.temperature,
                                          notes=[note.removeprefix("note: ") for note in inputs.notes])
            outputs = DecodeOutputs(plan.out_dir, start)
            recorder = (_recorder(plan, model, inputs.drafter, profile, recorded_levels(plan, policies))
                        if plan.record is not None else None)
        except BaseException as exc:
            leave_nothing()
            if isinstance(exc, INTERRUPTS) and interrupted(exc):
                raise Interrupted(NOTHING_DECODED) from None
            raise
        planned = len(policies) * len(inputs.prompts)      # (policy, prompt) runs
        rows = _CycleRows(outputs, profile.cost, model.offload.host.expert_bytes, per_cycle=plan.out_dir is not None)

        def stopped_with_nothing() -> bool:
            """The run stops: its pending cycles become rows; with none at all (nor records, nor
            recorded cycles) the folders it made go, and True."""
            rows.flush(stopped=True)
            if outputs.records or outputs.cycles or (recorder is not None and len(recorder)):
                return False
            leave_nothing()
            return True

        runs = None
        try:
            if plan.warmup:
                from ..kernel_warmup import warm_up

                warm_up()      # numba loads (or, after an install, compiles) the kernels before any timed cycle
            runs = _Runs(plan, inputs, outputs, rows, recorder, on_record, progress, say)
            runs.run(policies)
            # inside the try: a stop while the last files are written still keeps (and notes) every cycle
            outputs.close()
            trace_path = _write_recording(recorder, plan.record) if recorder is not None else None
        except SpecFitError as exc:
            if stopped_with_nothing():
                raise
            # a failure mid-run: what ran stays readable
            kept = _keep_partial(plan, outputs, recorder, str(exc), planned, runs)
            if not kept:
                raise
            raise SpecFitError(f"{exc} (before it: kept {kept})") from None
        except INTERRUPTS as exc:
            if not interrupted(exc):
                raise
            if stopped_with_nothing():
                raise Interrupted(NOTHING_DECODED) from None
            kept = _keep_partial(plan, outputs, recorder, "interrupted", planned, runs)
            raise Interrupted(f"interrupted after {len(outputs.cycles)} complete cycle(s) ({len(outputs.records)} (policy, "
                              f"prompt) run(s) finished): " + (f"kept {kept}" if kept else
                                                               "nothing was written (no --out or --record)")) from None
        except Exception as exc:
            # anything else (out of device memory, a torch error, a full disk): the complete cycles
            # still reach cycles.parquet before the error goes on, as far as the disk lets them
            with contextlib.suppress(Exception):
                rows.flush(stopped=True)
                if runs is not None:
                    runs.summarise_stopped()
                outputs.close()
            if isinstance(exc, OSError) and plan.out_dir is not None and not isinstance(exc, PEER_ERRORS):
                from ..io import os_error_text

                raise SpecFitError(f"{os_error_text(exc)} (after {len(outputs.cycles)} complete cycle(s); "
                                   f"those that reached the disk before it are in {plan.out_dir})") from None
            if (memory := out_of_memory_text(exc)) is not None:
                kept = f"; they are in {plan.out_dir}" if plan.out_dir is not None and outputs.cycles else ""
                raise SpecFitError(f"{memory} (after {len(outputs.cycles)} complete cycle(s){kept})") from None
            raise
        if recorder is not None and trace_path is None:
            where = f"; the run's other outputs are in {plan.out_dir}" if plan.out_dir is not None else ""
            raise SpecFitError(f"--record {plan.record}: no decode cycle ran (every output ended at the prompt pass's "
                               f"token): nothing to record{where}")
        identical = _outputs_identical(outputs.records) if plan.temperature == 0 else None
        differing, ties = rounding_ties(model, inputs.prompts, outputs.records, plan.prefill_chunk) if identical is False else ([], [])
        host = model.offload.host
        memory = {"host_expert_bytes": host.nbytes, "pinned_bytes": host.pinned_bytes,
                  "device_expert_bytes": model.offload.device_bytes}
        describe = getattr(getattr(inputs.drafter, "config", None), "describe_feature_layers", None)
        notes = inputs.notes + [f"note: {line}" for line in map(waiting_note, outputs.summaries) if line]
        return DecodeRun(memory=memory, drafter_features=describe(model.config.n_layers) if describe else None, notes=notes,
                         records=outputs.records, cycles=outputs.cycles, summaries=outputs.summaries,
                         profile_label=profile.label, profile_path=inputs.profile_path,
                         outputs_identical=identical, differing_lines=differing, tie_lines=ties,
                         dtype=str(model.dtype).removeprefix("torch."),
                         trace_path=trace_path, trace_cycles=len(recorder) if recorder is not None else 0,
                         policies=policies)


@dataclass
class _Inputs:
    """What a decode runs on (:func:`_load`)."""

    tokenizer: object
    prompts: list
    model: object
    drafter: object
    profile: object
    profile_path: Path | None
    notes: list[str]
    calibrator: object          # the acceptance calibrator (--acceptance-trace), or None
    fitted: object              # the expert predictor fitted on --predictor-trace, or None
    acceptance: object = None   # the --acceptance trace (Sequoia's rates are fitted on it), or None


class _Runs:
    """The run's decoding: every policy over every prompt into ``outputs`` (and ``recorder``), in
    turn or interleaved as the plan says, then the full-tree recording pass if asked for."""

    def __init__(self, plan: DecodePlan, inputs: _Inputs, outputs: DecodeOutputs, rows: "_CycleRows", recorder,
                 on_record, progress, say):
        self.plan, self.inputs, self.outputs, self.rows, self.recorder = plan, inputs, outputs, rows, recorder
        self.on_record, self.tick, self.say = on_record, progress or (lambda: None), say
        self.decoders: dict = {}

    def run(self, policies: list) -> None:
        (self._interleaved if self.plan.interleave else self._in_turn)(policies)
        if self.plan.record_full:
            self._record_full(recorded_levels(self.plan, policies))

    def _in_turn(self, policies: list) -> None:
        model = self.inputs.model
        for policy in policies:
            self._start(policy)
            self.say(f"decode {policy.name}")
            # every policy starts from an empty expert cache; prompts then share it, as a server's would
            model.offload.reset()
            for index, prompt in enumerate(self.inputs.prompts):
                self._decode_prompt(policy, index, prompt)
            self._summarise(policy)

    def _interleaved(self, policies: list) -> None:
        model = self.inputs.model
        for policy in policies:
            self._start(policy)
        self.say(f"decode {', '.join(p.name for p in policies)}, interleaved"
                 + (", each with its own expert cache" if self.plan.cache_per_policy else ""))
        # one expert cache for the run, which every policy's prompts share; with cache_per_policy
        # each policy's own, taking turns on the device
        model.offload.reset()
        caches = None
        if self.plan.cache_per_policy:
            from .offload import CacheTurns

            caches = CacheTurns(model.offload)
        for index, prompt in enumerate(self.inputs.prompts):
            for k in range(len(policies)):           # the order rotates from prompt to prompt
                policy = policies[(index + k) % len(policies)]
                if caches is not None:
                    caches.take(policy.name)
                self._decode_prompt(policy, index, prompt)
        for policy in policies:
            self._summarise(policy)

    def _start(self, policy) -> None:
        """The policy's decoder, after a few untimed tokens of the first prompt (``plan.warmup``)."""
        plan, i = self.plan, self.inputs

        def decoder(recorder, policy):
            return _decoder(plan, i.model, i.drafter, policy, i.profile.cost, i.calibrator, recorder, i.fitted)

        if plan.warmup:
            self.say(f"warm-up {policy.name}")
            i.model.offload.reset()
            # on a copy of the policy, as the predictor is one (see _decoder): what it would learn from
            # these untimed tokens of the first prompt, which the run then decodes, stays out of the run
            decoder(None, copy.deepcopy(policy)).generate(i.prompts[0].input_ids, min(WARMUP_TOKENS, plan.max_new_tokens),
                                                          ignore_eos=True)
        self.decoders[policy.name] = decoder(self.recorder if not plan.record_full else None, policy)

    def _decode_prompt(self, policy, index: int, prompt) -> None:
        plan, rows = self.plan, self.rows
        decoder = self.decoders[policy.name]
        if decoder.recorder is not None:
            decoder.recorder.begin_sequence(index)
        cycle_index = itertools.count()

        def keep(stats, committed):
            rows.add(policy.name, index, stats, committed, next(cycle_index))

        result = decoder.generate(prompt.input_ids, plan.max_new_tokens, ignore_eos=plan.ignore_eos, on_cycle=keep)
        rows.flush()
        if decoder.recorder is not None:
            decoder.recorder.end_sequence(len(result.output_ids))
        record = {"index": index, "line": prompt.line, "policy": policy.name, "cache_experts": plan.cache_experts,
                  "profile": self.inputs.profile.label, **result.to_dict()}
        if self.inputs.tokenizer is not None:
            record["text"] = self.inputs.tokenizer.decode(result.output_ids, skip_special_tokens=True)
        self.outputs.records.append(record)
        self.outputs.flush()
        if self.on_record is not None:
            self.on_record(record)
        self.tick()

    def _summarise(self, policy, stopped: bool = False) -> None:
        summary = summarise_policy(policy.name, self.outputs.records, self.outputs.cycles)
        if stopped and summary["prompts"] < len(self.inputs.prompts):
            # the run stopped before this policy's last prompt: its cycles so far, said so
            summary["complete"] = False
        if self.decoders[policy.name].online is not None:
            summary["online_model"] = self.decoders[policy.name].online.state()
        self.outputs.summaries.append(summary)

    def summarise_stopped(self) -> None:
        """The run stopped (Ctrl-C, bad input met mid-run): every policy that decoded a cycle and
        has no summary yet gets one of what it completed, marked ``"complete": false``, so that
        ``summary.json`` covers every policy ``cycles.parquet`` holds."""
        done = {s["policy"] for s in self.outputs.summaries}
        ran = {c["policy"] for c in self.outputs.cycles} | {r["policy"] for r in self.outputs.records}
        for name, decoder in self.decoders.items():
            if name in ran and name not in done:
                self._summarise(decoder.policy, stopped=True)

    def _record_full(self, levels: int) -> None:
        plan, i, recorder = self.plan, self.inputs, self.recorder
        self.say(f"recording full trees of {levels} levels at every position into {plan.record}")
        full = _full_decoder(plan, i.model, i.drafter, i.profile.cost, recorder, levels, i.fitted)
        i.model.offload.reset()
        for index, prompt in enumerate(i.prompts):
            recorder.begin_sequence(index)
            result = full.generate(prompt.input_ids, plan.max_new_tokens, ignore_eos=plan.ignore_eos)
            recorder.end_sequence(len(result.output_ids))
            self.tick()


class _CycleRows:
    """The cycles of the prompt being decoded on their way to rows of ``outputs``. With an
    ``--out`` directory (``per_cycle``) each cycle's row is made at once and appended to the
    journal, so that a killed process leaves every complete cycle on disk; without files the rows
    are made when the prompt's decode returns (or the run stops): reporting, not in the cycles it
    reports."""

    def __init__(self, outputs: DecodeOutputs, cost, expert_bytes: int, per_cycle: bool):
        self.outputs, self.cost, self.expert_bytes, self.per_cycle = outputs, cost, expert_bytes, per_cycle
        self.pending: list = []        # (policy, sequence, stats, committed tokens, cycle), not yet rows

    def add(self, policy: str, sequence: int, stats, committed: int, cycle: int) -> None:
        self.pending.append((policy, sequence, stats, committed, cycle))
        if self.per_cycle:
            self.flush()

    def flush(self, stopped: bool = False) -> None:
        """Every pending cycle into a row; ``stopped``: the run is stopping, possibly right after a
        pending cycle became a row and before it left the list (it is not made twice)."""
        pending, cycles = self.pending, self.outputs.cycles
        if stopped and pending and cycles:
            # rows are added in order, so the rows already made are pending's first entries, up to the last row
            last = cycles[-1]
            done = (last["policy"], last["sequence"], last["cycle"])
            moved = next((i + 1 for i, (p, s, _, _, c) in enumerate(pending) if (p, s, c) == done), 0)
            del pending[:moved]
        for policy, sequence, stats, committed, cycle in pending:
            row = live_row(stats, self.cost, self.expert_bytes)
            row["committed_tokens"] = committed       # what reached the output (after eos / the length cap)
            self.outputs.add_cycle({"policy": policy, "sequence": sequence, "position": stats.position,
                                    "cycle": cycle, **row})
        pending.clear()


def _first_missing(path: Path | None) -> Path | None:
    """The highest folder of ``path`` that does not exist yet (what a run creating it makes), or None."""
    if path is None:
        return None
    path = Path(path).absolute()
    if path.exists():
        return None
    while not path.parent.exists():
        path = path.parent
    return path


def _load(plan: DecodePlan, say) -> _Inputs:
    """What a decode runs on, each input checked before the weights are read."""
    from ..experts.cache import ExpertCache
    from .config import ModelConfig
    from .devices import resolve_device
    from .loader import drafter_capture_layers, load_drafter, load_model, load_tokenizer
    from .prompts import read_prompts

    device = resolve_device(plan.device)
    dtype = plan.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    config = ModelConfig.from_dir(plan.model_dir)
    slots = ExpertCache.slot_limit(config.n_moe_layers, config.n_experts, plan.cache_mode)
    if plan.cache_experts > slots:
        where = "in all, as --cache-mode global counts them" if plan.cache_mode == "global" else "per MoE layer"
        raise SpecFitError(f"--cache-experts: expected 0..{slots} ({plan.model_dir} has {slots} experts {where}), "
                           f"got {plan.cache_experts}")
    tokenizer = load_tokenizer(plan.model_dir)
    prompts = read_prompts(plan.prompts_path, tokenizer, config.vocab_size, plan.model_dir)
    for prompt in prompts:
        if len(prompt.input_ids) + plan.max_new_tokens > config.max_position_embeddings:
            raise SpecFitError(f"{plan.prompts_path}:{prompt.line}: {len(prompt.input_ids)} prompt tokens + "
                               f"--max-new-tokens {plan.max_new_tokens} exceed the model's max_position_embeddings "
                               f"({config.max_position_embeddings})")
    # the drafter's config is checked against the target's before any weight is read
    capture = drafter_capture_layers(plan.drafter_dir, config) if plan.drafter_dir is not None else None
    # a trace it cannot read or learn from is named before the model loads and a profile is measured
    calibrator, acceptance = _acceptance_calibrator(plan.acceptance_trace, config) if plan.acceptance_trace else (None, None)
    fitted = _fitted_predictor(plan, config) if plan.predictor_trace else None

    say(f"loading {plan.model_dir}")
    model = load_model(plan.model_dir, device=device, dtype=dtype, cache_experts=plan.cache_experts,
                       cache_mode=plan.cache_mode, eviction=plan.cache_policy, capture_layers=capture)
    drafter = load_drafter(plan.drafter_dir, model) if plan.drafter_dir is not None else None
    if drafter is not None and plan.tree_top_k > drafter.config.draft_vocab_size:
        raise SpecFitError(f"--tree-top-k: expected at most the drafter's vocabulary, {drafter.config.draft_vocab_size} "
                           f"tokens ({plan.drafter_dir}), got {plan.tree_top_k}")
    profile, profile_path, notes = _profile(plan, model, say)
    return _Inputs(tokenizer, prompts, model, drafter, profile, profile_path, notes, calibrator, fitted, acceptance)


# --------------------------------------------------------------------------- pieces
SAMPLED_ACCEPTANCE_NOTE = (
    "note: --temperature {t:g}: {names} learn(s) acceptance online from each cycle's outcomes (+online): when "
    "decoding samples, a drafted child is accepted with the target's probability of its token, which a trace's "
    "greedy verdicts (--acceptance) do not measure")


def _learn_sampled_acceptance(policies: list, option: str) -> None:
    """Give every SpecFit policy without an online acceptance one (the ``+online`` lever, named so):
    an acceptance calibrated on greedy verdicts overstates what sampling accepts (its predicted
    tokens per cycle were 40-66 % above the committed ones at temperatures 0.7-1 on the bundled
    model, ``benchmarks/RESULTS.md``)."""
    from ..policies import SpecFitPolicy, apply_levers

    names = [p.name for p in policies]
    for p in policies:
        if isinstance(p, SpecFitPolicy) and p.acceptance is None:
            if f"{p.name}+online" in names:
                raise SpecFitError(f"{option}: when sampling (--temperature > 0) {p.name} learns its acceptance online, "
                                   f"so it is {p.name}+online, which is named too; name it once")
            apply_levers(p, ["online"])


def sampled_acceptance_note(plan: DecodePlan, policies: list) -> list[str]:
    """The note for the policies :func:`_learn_sampled_acceptance` gave an online acceptance."""
    from ..policies import SpecFitPolicy

    named = {spec.strip() for spec in plan.policies}
    changed = [p.name for p in policies
               if isinstance(p, SpecFitPolicy) and p.name.endswith("+online") and p.name not in named]
    if plan.temperature <= 0 or not changed:
        return []
    return [SAMPLED_ACCEPTANCE_NOTE.format(t=plan.temperature, names=", ".join(changed))]


def _keep_partial(plan: DecodePlan, outputs: DecodeOutputs, recorder, why: str, runs: int, decoding=None) -> str:
    """A run stopped before its end (Ctrl-C, or bad input met mid-run; ``why``): write what it
    completed, the run directory's files (its ``run.json`` noting that it stopped, and why, for a
    report to say; ``runs``: the (policy, prompt) runs it was to make; ``decoding``: its
    :class:`_Runs`, whose policies cut short get their summaries) and the recorded cycles as a
    trace; returns what was kept where ("every complete cycle, N of them, in OUT and ..."), empty
    when nothing was asked to be written."""
    if decoding is not None:
        decoding.summarise_stopped()
    outputs.close()
    kept = []
    if plan.out_dir is not None:
        from ..runinfo import note_run

        note_run(plan.out_dir, f"the run stopped before its end ({why}): it holds the {len(outputs.cycles)} cycle(s) "
                               f"completed before it; {len(outputs.records)} of its {runs} (policy, prompt) runs "
                               "finished")
        kept.append(f"every complete cycle, {len(outputs.cycles)} of them, in {plan.out_dir}")
    written = False
    if recorder is not None and len(recorder):
        recorder.end_open_sequence()
        if _write_recording(recorder, plan.record) is not None:
            kept.append(f"the {len(recorder)} recorded cycle(s) as a trace in {plan.record}")
            written = True
    said = " and ".join(kept)
    if plan.record is not None and not written and kept:
        # --record-full records its trees in a pass after the decoding, which never ran
        said += (f"; no trace in {plan.record} (" + ("--record-full records in a pass after the decoding, which "
                 "recorded no cycle before the stop" if plan.record_full else "no cycle was recorded") + ")")
    return said


def _write_recording(recorder, path) -> Path | None:
    """Write the recorded cycles as a trace (atomically: an interrupted write leaves no file); None,
    and no file, when no cycle was recorded."""
    from ..traces.format import write_trace

    trace = recorder.trace()
    return None if trace is None else write_trace(trace, path)


def _until_refit(online_refit: bool, seen: str) -> str:
    """How long a profile's figure stays another machine's or drafter's in this run: until the
    online refit has seen ``seen``, or, with ``--frozen-profile``, the whole run."""
    return f"until the online refit has seen {seen}" if online_refit else \
        "for the whole run, as --frozen-profile keeps the profile unchanged"


def _other_device_note(spec: str, profile, device, online_refit: bool) -> list[str]:
    """A note when a measured profile comes from another kind of device than the one this run
    decodes on (an H200's profile on a CPU run): its times are another machine's (a preset is a
    what-if by design, and says so in its name)."""
    measured_on = profile.machine.get("device") if isinstance(profile.machine, dict) else None
    if profile.kind != "measured" or not isinstance(measured_on, str) or measured_on == device.type:
        return []
    name, until = profile.machine.get("device_name"), _until_refit(online_refit, "this one's")
    return [f"note: {spec} was measured on {measured_on}{f' ({name})' if name else ''}, this run decodes on "
            f"{device.type}: its cycle times are another machine's {until} "
            f"(specfit calibrate measures this machine)"]


def _other_threads_note(spec: str, profile, device, online_refit: bool) -> list[str]:
    """A note when a profile measured on a CPU had another number of torch threads than this CPU
    run (a profile is found by machine and model, not by threads): a CPU pass's time depends on
    them, so its cycle times are another setting's. Older profiles do not say."""
    import torch

    machine = profile.machine if isinstance(profile.machine, dict) else {}
    measured_with, ours = machine.get("torch_threads"), torch.get_num_threads()
    if (profile.kind != "measured" or device.type != "cpu" or machine.get("device") != "cpu"
            or not isinstance(measured_with, int) or measured_with == ours):
        return []
    until = _until_refit(online_refit, "this run's")
    return [f"note: {spec} was measured with {measured_with} torch thread(s), this run decodes with {ours} "
            f"(--threads): its cycle times are another setting's {until} (specfit calibrate --threads "
            f"{ours} measures this setting)"]


def _profile(plan: DecodePlan, model, say):
    """(profile, path, notes): ``--profile`` when given; else this machine's profile for the model
    from ``calibrate/`` in the current directory or the user's cache; else one calibrated quickly on
    the loaded model and saved in the cache (and said where). A found profile of another shape
    (the same model in another dtype) is passed over, and the notes say so.

    The cache entry is locked while it is looked up and calibrated: a second run without a profile
    started at once waits for the first one's calibration and decides with its profile, instead of
    measuring the machine while the other calibrates. A quick calibration the machine disturbed
    (:func:`~specfit.calibrate.repeat.machine_busy`) decides this run but is not kept: every later
    run would decide with it."""
    from ..calibrate.presets import resolve_profile
    from ..calibrate.profile import ModelShape, machine_info
    from ..calibrate.calibrate_job import cached_profile_path

    shape = ModelShape.from_config(model.config, model.dtype, Path(plan.model_dir).name)
    if plan.profile is not None:
        path = Path(plan.profile) if Path(plan.profile).suffix == ".json" else None
        profile = resolve_profile(plan.profile, shape, rescale=plan.rescale)
        return profile, path, (_other_device_note(plan.profile, profile, model.device, plan.online_refit)
                               + _other_threads_note(plan.profile, profile, model.device, plan.online_refit))
    machine = machine_info(model.device)
    dtype = str(model.dtype).removeprefix("torch.")
    path = cached_profile_path(machine, shape, dtype)
    with contextlib.ExitStack() as stack:
        waited = _hold_cache_lock(stack, path, say)
        return _found_or_calibrated(plan, model, shape, machine, dtype, path, say, waited)


def _hold_cache_lock(stack: contextlib.ExitStack, path: Path, say) -> bool:
    """Hold the lock beside cached profile ``path`` (``<name>.lock``) in ``stack``, waiting while
    another run holds it; whether it waited. A cache that cannot hold it (not writable) is used
    unlocked: no run can save into it either."""
    from ..io import file_lock

    def wait() -> None:
        say(f"waiting for another specfit run's calibration of this machine and model ({path})")

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return stack.enter_context(file_lock(path.with_name(path.name + ".lock"), "the profile cache's lock", wait))
    except (OSError, SpecFitError):
        return False


def _found_or_calibrated(plan: DecodePlan, model, shape, machine: dict, dtype: str, cached: Path, say, waited: bool):
    """:func:`_profile`'s search and quick calibration, with the cache entry ``cached`` locked (after
    ``waited`` for another run that held it)."""
    from ..calibrate.profile import load_profile
    from ..calibrate.repeat import machine_busy
    from ..calibrate.calibrate_job import (CalibrationPlan, cached_profile_path, calibrate, default_profile_path,
                                           drafter_identity)

    notes = []
    for path in (default_profile_path(machine, shape), cached, cached_profile_path(machine, shape)):
        if path.is_file():
            try:
                found = load_profile(path)
            except SpecFitError as exc:           # damaged: calibrated again below, and replaced
                notes.append(f"note: {exc}: not used")
                continue
            if found.shape.same_shape(shape):
                timed = found.probes.get("drafter")           # older profiles do not say
                ours = drafter_identity(plan.drafter_dir) if plan.drafter_dir is not None else None
                if isinstance(timed, str) and ours is not None and timed != ours:
                    notes.append(f"note: {path}: its draft level was timed with {timed}, this run drafts with {ours}: "
                                 "its draft_level_s is another drafter's "
                                 + _until_refit(plan.online_refit, "this run's levels (a few cycles)"))
                notes += _other_threads_note(str(path), found, model.device, plan.online_refit)
                if waited and path == cached:
                    notes.append(f"note: waited for another run's calibration of this machine and model; this run "
                                 f"decides with the profile it saved ({path})")
                return found.for_shape(shape, source=str(path)), path, notes
            notes.append(f"note: {path}: made for {found.shape.n_layers} layers x {found.shape.n_experts} experts "
                         f"of {found.shape.expert_bytes} B, not this model's {shape.n_layers} x {shape.n_experts} of "
                         f"{shape.expert_bytes} B in {dtype}: not used")
    path = cached
    say(f"no profile for this machine and model in {dtype} yet: quick calibration, saved to {path}")
    profile = calibrate(CalibrationPlan(model_dir=Path(plan.model_dir), drafter_dir=plan.drafter_dir,
                                        device=str(model.device), quick=True, seed=plan.seed), model=model)
    # what `specfit calibrate` prints after its table: the probes' own checks
    notes += [f"note: the quick calibration: {warning}" for warning in profile.fit.get("warnings") or ()]
    if machine_busy(profile.fit.get("probe_noise") or {}):
        notes.append(f"note: the machine was busy during the quick calibration: this run decides with it, but it is "
                     f"not saved to {path}; the next run without --profile calibrates again (or run `specfit "
                     f"calibrate` on a quiet machine)")
        return profile, None, notes
    try:
        profile.save(path)
    except (OSError, SpecFitError) as exc:        # a cache that cannot be written: this run uses it anyway
        from ..io import os_error_text

        reason = os_error_text(exc) if isinstance(exc, OSError) else str(exc)
        notes.append(f"note: the calibrated profile could not be saved to the cache ({reason}); this run decides "
                     "with it, and the next run without --profile calibrates again")
        return profile, None, notes
    notes.append(f"note: no profile of this machine and model in {dtype} was found: one was calibrated now (quick) "
                 f"and saved to {path}, where the next run finds it")
    return profile, path, notes


def _check_trace_model(option: str, path, trace, config) -> None:
    """A trace of another model (MoE shape or vocabulary) is refused: what is learned from it, its
    experts or how often its target accepted its drafter's tokens, is that model's."""
    have = (config.n_moe_layers, config.n_experts, config.top_k)
    vocab = trace.model.get("vocab_size")        # older and imported traces may not record it
    if (trace.n_layers, trace.n_experts, trace.top_k) != have or vocab not in (None, config.vocab_size):
        theirs, ours = ("", "") if vocab is None else (f", {vocab} tokens", f", {config.vocab_size} tokens")
        raise SpecFitError(f"{option} {path}: {trace.n_layers} MoE layers x {trace.n_experts} experts, top-"
                           f"{trace.top_k}{theirs}; the model has {have[0]} x {have[1]}, top-{have[2]}{ours}: a "
                           f"trace of another model")


def _acceptance_calibrator(trace_path: Path, config):
    """(calibrator, trace): the calibrator fitted on ``trace_path``'s verdicts (how often this model
    accepted its drafter's tokens, so a trace of another model is refused), and the trace read."""
    from ..experts.calibration import AcceptanceCalibrator
    from ..traces.format import read_trace

    trace = read_trace(trace_path, weights=False)
    _check_trace_model("--acceptance", trace_path, trace, config)
    calibrator = AcceptanceCalibrator().fit(trace)
    if calibrator.n_edges_ == 0:
        raise SpecFitError(f"--acceptance {trace_path}: the trace has no draft node whose parent's verdict is known")
    return calibrator, trace


def _fit_sequoia(plan, policies: list, rates, notes: list[str]) -> None:
    """Give every ``sequoia:N`` its positional acceptance rates (fitted on ``--acceptance``), and
    say which tree they give it."""
    from ..policies import SequoiaPolicy

    for p in policies:
        if isinstance(p, SequoiaPolicy) and p.rates is None:
            p.fit(rates)
            shown = ", ".join(f"{r:.3f}" for r in rates)
            notes.append(f"note: {p.name}: positional acceptance rates {shown} (sibling rank 0, 1, ...; fitted on "
                         f"--acceptance {plan.acceptance_trace}): a tree of {p.verified_nodes} nodes, {p.max_levels} "
                         f"levels" + ("; greedy verdicts, which overstate what sampling (--temperature "
                                      f"{plan.temperature:g}) accepts" if plan.temperature > 0 else ""))


def _fitted_predictor(plan, config):
    """``plan.predictor`` fitted on ``plan.predictor_trace``, a trace of the model of ``config``
    (before the model loads: the fit needs the trace alone)."""
    from ..experts.predictors import make_predictor
    from ..traces.format import read_trace

    path = plan.predictor_trace
    trace = read_trace(path, weights=False)
    _check_trace_model("--predictor-trace", path, trace, config)
    recording = trace.meta.get("recording", {})
    if plan.predictor in recording.get("unfittable_predictors", []):
        raise SpecFitError(f"--predictor-trace {path}: its token ids are {recording.get('token_ids', 'unknown')}; "
                           f"--predictor {plan.predictor} learns from token ids")
    if not trace.true_known.any():
        raise SpecFitError(f"--predictor-trace {path}: no node's true experts are known; record it with --record-full")
    return make_predictor(plan.predictor).fit(trace)


def _predictor(plan, model, fitted=None):
    """A fresh expert predictor of ``plan``'s kind for one decoder (a copy of the fitted one): the
    fitted ones go on learning from the run's own verified nodes."""
    from ..experts.predictors import make_predictor

    if fitted is not None:
        return copy.deepcopy(fitted)
    if plan.predictor == "router":
        return make_predictor("router", model=model, adapt=plan.router_adapt)
    return make_predictor(plan.predictor)


def _decoder(plan, model, drafter, policy, cost, calibrator, recorder, fitted=None):
    from .decoder import Decoder
    from .drafting import Proposer

    proposer = Proposer(drafter, plan.tree_top_k) if policy.max_levels > 0 else None
    return Decoder(model, proposer, policy, cost, predictor=_predictor(plan, model, fitted),
                   eos_token_ids=model.config.eos_token_ids, temperature=plan.temperature, seed=plan.seed,
                   calibrator=calibrator, recorder=recorder, online_refit=plan.online_refit,
                   prefill_chunk=plan.prefill_chunk)


def recorded_levels(plan, policies: list) -> int:
    """The draft levels a recording holds: ``--max-levels``, or the deepest policy's where it
    drafts more (``eagle3:N:D`` and ``chain:K`` keep their own depth), so that a replay of a full-tree
    recording sees every level a policy of the run drafted."""
    return max([plan.max_levels] + [p.max_levels for p in policies])


def _full_decoder(plan, model, drafter, cost, recorder, levels: int, fitted=None):
    from ..policies import RerankPolicy
    from .decoder import Decoder
    from .drafting import Proposer, tree_capacity

    # "verify everything": the rerank keeping as many nodes as the tree can have, one token
    # committed; the run's expert predictor (its kind, its fitted state), whose predictions the trace
    # records, learning from the full trees it verifies
    policy = RerankPolicy(tree_capacity(plan.tree_top_k, levels), levels, name="full")
    return Decoder(model, Proposer(drafter, plan.tree_top_k), policy, cost, predictor=_predictor(plan, model, fitted),
                   eos_token_ids=model.config.eos_token_ids, recorder=recorder, commit_root_only=True,
                   online_refit=False, prefill_chunk=plan.prefill_chunk)


def _recorder(plan: DecodePlan, model, drafter, profile, levels: int):
    from .record import TraceRecorder

    c = model.config
    model_meta = {"name": Path(plan.model_dir).name, "n_layers": c.n_moe_layers, "n_experts": c.n_experts, "top_k": c.top_k,
                  "expert_bytes": model.offload.host.expert_bytes, "vocab_size": c.vocab_size}
    drafter_meta = {"name": Path(plan.drafter_dir).name if plan.drafter_dir else "none",
                    "kind": getattr(getattr(drafter, "config", None), "kind", "eagle3"),
                    "tree_top_k": plan.tree_top_k, "max_levels": levels}
    if drafter is not None:
        drafter_meta.update(hidden_size=drafter.config.hidden_size, draft_vocab_size=drafter.config.draft_vocab_size)
    recording = {"policy": None if plan.record_full else plan.policies[0], "predictor": plan.predictor,
                 "profile": profile.label, "cache_experts": plan.cache_experts, "device": str(model.device),
                 "max_new_tokens": plan.max_new_tokens, "prefill_chunk": plan.prefill_chunk}
    return TraceRecorder(model_meta, drafter_meta, workload=Path(plan.prompts_path).name, full=plan.record_full,
                         recording=recording)


def _outputs_identical(records: list[dict]) -> bool | None:
    by_prompt: dict[int, set] = {}
    for r in records:
        by_prompt.setdefault(r["index"], set()).add(tuple(r["output_ids"]))
    if len({r["policy"] for r in records}) < 2:
        return None
    return all(len(outputs) == 1 for outputs in by_prompt.values())


def rounding_ties(model, prompts: list, records: list[dict], prefill_chunk: int = PREFILL_CHUNK) -> tuple[list[int], list[int]]:
    """(lines of the prompts whose greedy outputs differ between policies, the lines among them
    where every difference is a rounding tie).

    A verification pass over a tree sums each row's attention over another layout of keys than a
    one-token pass does, so its logits round apart from autoregressive decoding's (in a 16-bit
    dtype by up to about one unit of :data:`ROUNDING_TIE_UNITS`'s scale, in float32 by about 1e-6 of
    the logits' scale); where the target's two best tokens are that close, the policies can commit
    different ones and continue apart. Two outputs part at a rounding tie when the target, run once
    over the prompt and the tokens they share (its prompt pass, as autoregressive decoding runs
    it), gives each of the tokens they chose there a logit within :data:`ROUNDING_TIE_UNITS` units
    of the best (an output that ends where another goes on is no tie). Every two outputs of a
    prompt are checked where they part: a policy that leaves the others at a fault is not hidden
    behind another's earlier tie."""
    import torch

    by_prompt: dict[int, list[tuple[int, ...]]] = {}
    for r in records:
        by_prompt.setdefault(r["index"], []).append(tuple(r["output_ids"]))
    unit = max(torch.finfo(model.dtype).eps, ROUNDING_UNIT_FLOOR)
    differing, ties = [], []
    for index, outputs in sorted(by_prompt.items()):
        distinct = list(dict.fromkeys(outputs))
        if len(distinct) == 1:
            continue
        prompt = prompts[index]
        differing.append(prompt.line)
        parts: dict[tuple, set[int]] | None = {}     # where outputs part (the tokens they share) -> the tokens chosen
        for a, b in itertools.combinations(distinct, 2):
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if at is None:              # one ends where the other goes on: no tie
                parts = None
                break
            parts.setdefault(a[:at], set()).update((a[at], b[at]))
        if parts is not None and all(_tied(model, list(prompt.input_ids) + list(shared), chosen, unit, prefill_chunk)
                                     for shared, chosen in sorted(parts.items())):
            ties.append(prompt.line)
    return differing, ties


def _tied(model, ids: list[int], chosen: set[int], unit: float, prefill_chunk: int) -> bool:
    """Whether the target, run over ``ids`` as a prompt pass, gives every token of ``chosen`` a
    logit within :data:`ROUNDING_TIE_UNITS` units of its best."""
    from .decoder import Decoder

    if model.max_seq_len < len(ids):
        model.setup_kv_cache(len(ids))
    logits = Decoder(model, prefill_chunk=prefill_chunk).prefill(ids)[1].logits[-1].float()
    best = logits.max()
    return bool((best - logits[sorted(chosen)] <= ROUNDING_TIE_UNITS * unit * logits.abs().max()).all())


# --------------------------------------------------------------------------- the comparison
def summarise_policy(policy: str, records: list[dict], cycles: list[dict]) -> dict:
    """:func:`specfit.accounting.summarise` of ``policy``'s cycles, with its prompt count."""
    import pandas as pd

    rows = pd.DataFrame([c for c in cycles if c["policy"] == policy])
    return {"policy": policy, "prompts": sum(r["policy"] == policy for r in records), **summarise(rows)}
