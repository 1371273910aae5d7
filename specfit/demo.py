"""``specfit demo``: SpecFit end to end on the bundled tiny MoE, on this machine, in one command.

1. calibrate this machine for the bundled model: probes, then a short warm-up decode whose cycles
   the profile is refitted on and whose full trace calibrates the drafter's probabilities;
2. decode the bundled prompts with ``ar``, ``eagle3`` and ``specfit`` through the offloaded
   runtime (greedy outputs must be identical), recording a position-indexed trace;
3. replay that trace under hardware presets at Qwen3-30B-A3B scale (what-ifs: this workload's
   routing and acceptance, Qwen3-30B-A3B's per-expert and per-layer costs over each link);
4. write one HTML report (``reports/demo/index.html`` by default).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer

from .errors import INTERRUPTS, Interrupted, SpecFitError, stopped, stopped_by
from .threads import THREADS_HELP, set_cpu_threads

__all__ = ["DemoPlan", "run_demo", "register", "whatif_scenarios"]

DECODE_POLICIES = ("ar", "eagle3", "specfit")
WARMUP_POLICIES = ("ar", "chain:2", "eagle3:16:4")
# the what-if: the fixed settings, SpecFit alone and with every replay lever (the look-ahead eviction,
# the prefetch into drafted levels), and the oracle that knows the verdicts
SIM_POLICIES = ("ar", "chain:2", "eagle3", "static:auto", "specfit", "specfit+cache+prefetch", "oracle")


@dataclass
class DemoPlan:
    out_dir: Path = Path("reports/demo")
    quick: bool = False
    cache_experts: int = 8
    max_new_tokens: int | None = None    # None: 48, or 16 with quick; a value given is kept
    n_prompts: int | None = None
    device: str = "cpu"

    def validate(self) -> None:
        """Every option checked before any probe runs or any file is written."""
        from .assets import demo_prompts_path, tiny_moe_dir
        from .runinfo import check_run_dir
        from .runtime.config import ModelConfig
        from .runtime.loader import load_tokenizer
        from .runtime.prompts import read_prompts

        config = ModelConfig.from_dir(tiny_moe_dir())
        n_experts = config.n_experts
        if not 0 <= self.cache_experts <= n_experts:
            raise SpecFitError(f"--cache-experts: expected 0..{n_experts} (the bundled model has {n_experts} experts per "
                               f"layer), got {self.cache_experts}")
        if self.max_new_tokens < 2:
            # one token is the prompt pass's: no decode cycle would run, and the demo records them
            raise SpecFitError(f"--max-new-tokens: expected at least 2 (the first token is the prompt pass's; the "
                               f"demo decodes and records the cycles after it), got {self.max_new_tokens}")
        # the decode would refuse it only after the calibration and the warm-up
        prompts = read_prompts(demo_prompts_path(), load_tokenizer(tiny_moe_dir()), config.vocab_size)
        longest = max(len(prompt.input_ids) for prompt in prompts)
        if longest + self.max_new_tokens > config.max_position_embeddings:
            raise SpecFitError(f"--max-new-tokens: expected at most {config.max_position_embeddings - longest} (the "
                               f"bundled model has {config.max_position_embeddings} positions and its longest bundled "
                               f"prompt {longest} tokens), got {self.max_new_tokens}")
        if self.n_prompts is not None and self.n_prompts < 1:
            raise SpecFitError(f"n_prompts: expected at least 1, got {self.n_prompts}")
        check_run_dir(self.out_dir, "demo")

    def __post_init__(self):
        if self.max_new_tokens is None:
            self.max_new_tokens = 16 if self.quick else 48
        if self.quick:
            self.n_prompts = self.n_prompts or 2


def whatif_scenarios(trace, presets=("pcie4", "pcie5", "gh200")):
    """Cost models for replaying a small model's trace as if it ran at Qwen3-30B-A3B scale: the
    preset's per-expert costs as they are (a miss moves one 9.44 MB expert) and every per-pass
    term, the draft level's too, times the trace's layers / 48. A cycle then costs 1/12 (for 4
    layers) of a 48-layer Qwen3 cycle whose every layer routes like the trace's: the policies
    compare as on that model. Left at a whole EAGLE-3 level, drafting would be priced as for a
    4-layer Qwen3, a model with the drafter of one 12 times its depth."""
    from .calibrate.presets import QWEN3_30B_A3B, preset_profile
    from .simulate.sweep import Scenario

    layer_share = trace.n_layers / QWEN3_30B_A3B.n_layers
    scenarios = []
    for name in presets:
        cost = preset_profile(name, QWEN3_30B_A3B).cost
        cost = cost.replace(base_s=cost.base_s * layer_share, per_node_s=cost.per_node_s * layer_share,
                            draft_level_s=cost.draft_level_s * layer_share)
        scenarios.append(Scenario(f"{name}-qwen3", cost))
    return scenarios


def _prompts_file(plan: DemoPlan, out: Path) -> Path:
    """The bundled prompts, or (``n_prompts``) the first few of each workload."""
    from .assets import demo_prompts_path
    from .io import write_jsonl_atomic

    path = demo_prompts_path()
    if plan.n_prompts is None:
        return path
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    kinds = list(dict.fromkeys(r.get("workload") for r in records))
    per_kind = -(-plan.n_prompts // len(kinds))
    chosen = [r for kind in kinds for r in [r for r in records if r.get("workload") == kind][:per_kind]]
    return write_jsonl_atomic(out / "prompts.jsonl", chosen)


def _clear_previous(out: Path) -> None:
    """A rerun into a demo's directory: the last run's report and what it was built from go first,
    so a run stopped part-way never leaves a report of the last run beside this one's decodes (the
    decode and calibration steps replace their own files)."""
    import shutil

    for name in ("index.html", "inputs.json", "trace.parquet", "profile.json"):
        (out / name).unlink(missing_ok=True)
    shutil.rmtree(out / "simulate", ignore_errors=True)


class ReportCompleted(Interrupted):
    """A Ctrl-C during the demo's last step, its report: held until the report was complete."""


def _write_report(out: Path) -> Path:
    from .report.build import build_report

    try:
        return build_report([out], out, title="SpecFit demo: the bundled tiny MoE")
    except Interrupted as exc:        # held until the report's files were complete: every step is done
        raise ReportCompleted(f"{exc}; every step of the demo is done") from None


def run_demo(plan: DemoPlan, say=print, progress=None) -> dict:
    """Run every step; returns what the final table shows and the report's path."""
    from .io import run_dir_lock

    plan.validate()
    out = Path(plan.out_dir)
    with run_dir_lock(out, "demo"):          # a second demo into it at once would mix the two runs' files
        return _run_demo(plan, out, say, progress)


def _run_demo(plan: DemoPlan, out: Path, say, progress) -> dict:
    from .assets import tiny_moe_dir, tiny_moe_eagle3_dir
    from .calibrate.calibrate_job import CalibrationPlan, calibrate, refit
    from .runtime.decode_job import DecodePlan, run_decode
    from .io import write_json_atomic
    from .runinfo import RUN_INFO_FILE, read_run_info, run_info, write_run_info
    from .simulate.replay import prepare_trace
    from .simulate.sweep import run_sweep
    from .traces.format import read_trace

    _clear_previous(out)
    write_run_info(out, "demo", quick=plan.quick)
    step = progress or (lambda *a: None)
    timings = {}

    started = time.perf_counter()
    say("1/4 calibrating this machine for the bundled model: probes, then a warm-up decode to refit on")
    cal = CalibrationPlan(model_dir=tiny_moe_dir(), drafter_dir=tiny_moe_eagle3_dir(), device=plan.device,
                          quick=plan.quick)
    probed = calibrate(cal, progress=step)
    probed_path = probed.save(out / "warmup" / "probed-profile.json")
    # The probes time the target's passes and a stand-in draft level; a short warm-up decode
    # measures what they cannot (the drafter's real passes, the decoder's bookkeeping), and its
    # full trace calibrates the drafter's probabilities into acceptance probabilities. Its policies
    # take the prompts in turn: the refit separates their terms by comparing them, and a slow phase
    # of the machine during one policy's run alone would be read as that policy's cost.
    prompts = _prompts_file(plan, out)
    warmup = DecodePlan(model_dir=tiny_moe_dir(), drafter_dir=tiny_moe_eagle3_dir(), prompts_path=prompts,
                        cache_experts=plan.cache_experts, policies=list(WARMUP_POLICIES), profile=str(probed_path),
                        max_new_tokens=min(plan.max_new_tokens, 24), device=plan.device, out_dir=out / "warmup",
                        record=out / "warmup" / "trace.parquet", record_full=True, interleave=True)
    run_decode(warmup, progress=lambda: step())
    profile, _ = refit(probed, [out / "warmup"], seed=0)
    profile_path = profile.save(out / "profile.json")
    timings["calibrate_s"] = time.perf_counter() - started

    started = time.perf_counter()
    say(f"2/4 decoding the bundled prompts with {', '.join(DECODE_POLICIES)} in turn, prompt by prompt, each policy "
        f"with its own cache of {plan.cache_experts} experts per layer of {profile.shape.n_experts}")
    trace_path = out / "trace.parquet"
    decode = DecodePlan(model_dir=tiny_moe_dir(), drafter_dir=tiny_moe_eagle3_dir(), prompts_path=prompts,
                        cache_experts=plan.cache_experts, policies=list(DECODE_POLICIES), profile=str(profile_path),
                        max_new_tokens=plan.max_new_tokens, device=plan.device, out_dir=out / "decode",
                        record=trace_path, record_full=True, acceptance_trace=out / "warmup" / "trace.parquet",
                        # a slow phase of the machine then slows every policy alike, not the one running
                        interleave=True, cache_per_policy=True)
    decoded = run_decode(decode, progress=lambda: step())
    # the decode's run.json keeps its shape and profile (a refit of it checks them) under the demo's label
    info = read_run_info(out / "decode") or run_info("decode")
    write_json_atomic(out / "decode" / RUN_INFO_FILE, {**info, "kind": "decode (specfit demo)"})
    check_lossless(decoded)
    timings["decode_s"] = time.perf_counter() - started

    started = time.perf_counter()
    say("3/4 replaying the recorded trace under PCIe Gen4 / Gen5 / GH200 presets at Qwen3-30B-A3B scale")
    trace = read_trace(trace_path, weights=False)
    # the live decoder's own expert predictions, as the policies saw them, when it recorded them
    predictor = "recorded" if trace.predicted_experts is not None else "oracle"
    # acceptance probabilities calibrated on the other prompts' cycles (never on the cycle itself)
    prepared = prepare_trace("demo trace", trace, predictor=predictor, acceptance="calibrated")
    caches = (0, trace.n_experts // 2) if plan.quick else (0, trace.n_experts // 4, trace.n_experts // 2)
    cycles, summary = run_sweep([prepared], list(SIM_POLICIES), list(caches), whatif_scenarios(trace),
                                per_layer=True, progress=lambda what: step())
    sim_dir = out / "simulate"
    from .io import atomic_write

    sim_dir.mkdir(parents=True, exist_ok=True)
    for name, frame in (("cycles", cycles), ("summary", summary)):
        atomic_write(sim_dir / f"{name}.parquet", lambda tmp, f=frame: f.to_parquet(tmp, index=False))
    truth = None
    behind = _settings_behind(summary)
    if behind and predictor == "recorded":
        # where a fixed setting leads, the same SpecFit policies deciding with the experts the target
        # really routed to: how much of the gap is the expert predictor's
        truth_prepared = prepare_trace("demo trace", trace, predictor="oracle", acceptance="calibrated")
        profiles = {profile for profile, _ in behind}
        _, truth = run_sweep([truth_prepared], ["ar", *_specfit_columns(summary)], sorted({c for _, c in behind}),
                             [s for s in whatif_scenarios(trace) if s.label in profiles], progress=lambda what: step())
    notes = _whatif_notes(plan, trace) + _leader_notes(summary, truth)
    write_run_info(sim_dir, "simulate (specfit demo)", notes=notes)
    timings["simulate_s"] = time.perf_counter() - started

    say("4/4 writing the report")
    index = _write_report(out)
    return {"report": index, "decode": decoded, "summary": summary, "profile": profile, "timings": timings,
            "outputs_identical": decoded.outputs_identical, "whatif_notes": notes}


def check_lossless(decoded) -> None:
    """The demo stops where the policies' greedy outputs differ, unless every difference is a tie
    of the compute dtype's rounding (``DecodeRun.outputs_within_rounding``: a bfloat16 run on a GPU
    through the Python API; the command decodes float32 on the CPU)."""
    if decoded.outputs_identical is False and not decoded.outputs_within_rounding:
        raise SpecFitError(f"demo: greedy outputs differ between policies on the prompt(s) on line(s) "
                           f"{', '.join(map(str, decoded.differing_lines))}, not only at rounding ties; the decoder is "
                           f"not lossless here")


def _whatif_notes(plan: DemoPlan, trace) -> list[str]:
    """What a reader of the what-if should know: a ``--quick`` trace is too short to rank policies
    on (each prompt's acceptance calibration is fitted on the other prompts' few cycles, and a
    policy's rules see a handful of first levels)."""
    if not plan.quick:
        return []
    n_sequences = len(set(trace.sequence.tolist()))
    return [f"--quick: the what-if replays {trace.n_cycles} cycles of {n_sequences} prompts, each with the acceptance "
            f"calibration fitted on the other prompts' cycles: too few for its ranking of policies to be a result (a "
            f"smoke test); run the demo without --quick to compare them"]


# the what-if's columns a user could run without SpecFit (``static:auto`` tuned on the trace, after the fact)
FIXED_POLICIES = ("ar", "chain:2", "eagle3", "static:auto")


def _specfit_columns(summary) -> list[str]:
    return [p for p in dict.fromkeys(summary["policy"]) if p.split("+")[0] == "specfit"]


def _leaders(summary) -> list[tuple]:
    """``(profile, cache size, the setting's rows by policy, the fastest fixed policy, the fastest
    SpecFit column)`` of each setting of the what-if where a fixed policy runs faster than every
    SpecFit column."""
    ours_names = _specfit_columns(summary)
    out = []
    for (profile, cache), g in summary.groupby(["profile", "cache_experts"], sort=False):
        g = g.set_index("policy")
        fixed = g["tokens_per_s"][g.index.isin(FIXED_POLICIES)]
        ours = g["tokens_per_s"][g.index.isin(ours_names)]
        if len(fixed) and len(ours) and fixed.max() > ours.max():
            out.append((profile, int(cache), g, fixed.idxmax(), ours.idxmax()))
    return out


def _settings_behind(summary) -> list[tuple[str, int]]:
    """The (profile, cache size) settings of the what-if where a fixed policy runs faster than
    every SpecFit column."""
    return [(profile, cache) for profile, cache, *_ in _leaders(summary)]


def _leader_notes(summary, truth) -> list[str]:
    """What a reader of the what-if should know to read it: which columns no live run can be, and,
    where a fixed policy leads SpecFit, what SpecFit reaches deciding with the true experts
    (``truth``: the same replay with them; None when the policies decided with them already)."""
    from .console import speedup_text

    policies = set(summary["policy"])
    notes = []
    if "static:auto" in policies or "oracle" in policies:
        notes.append("static:auto is static:N with the N that ran fastest on this very trace, picked per setting after "
                     "the fact, and oracle knows the target's verdicts: neither can run live")
    rows, leads = [], 0
    for profile, cache, g, lead, best in _leaders(summary):
        n = f" (N={g.loc[lead, 'static_n']})" if lead == "static:auto" else ""     # as simulate's table writes it
        text = (f"{profile}, {cache} cached: {lead}{n} {speedup_text(g.loc[lead, 'speedup_vs_ar'])}, "
                f"{best} {speedup_text(g.loc[best, 'speedup_vs_ar'])}")
        if truth is not None:
            t = truth[(truth["profile"] == profile) & (truth["cache_experts"] == cache)].set_index("policy")
            text += f", {speedup_text(t.loc[best, 'speedup_vs_ar'])} with the true experts"
            leads += bool(t.loc[best, "tokens_per_s"] > g.loc[lead, "tokens_per_s"])
        rows.append(text)
    if rows and truth is not None:
        verdict = ("With the true experts SpecFit leads all of them: the gap is its expert predictor's (README: \"The "
                   "expert predictor decides the rest\")" if leads == len(rows)
                   else f"With the true experts SpecFit leads {leads} of these {len(rows)}")
        notes.append("where a fixed policy leads, SpecFit decided with the live router's expert predictions, each cycle "
                     "charged with the experts the target really routed to; deciding with those instead: "
                     + "; ".join(rows) + f". {verdict}")
    elif rows:
        notes.append("a fixed policy leads SpecFit (which decided with the true experts: the trace holds no "
                     "predictions) at: " + "; ".join(rows))
    return notes


def register(app: typer.Typer, traces_app: typer.Typer) -> None:
    app.command(name="demo")(demo_command)


def demo_command(
    out: Path = typer.Option(Path("reports/demo"), "--out", help="Directory for the report and everything it shows."),
    quick: bool = typer.Option(False, "--quick", help="Fewer prompts and tokens, smaller probe grids (CI)."),
    cache_experts: int = typer.Option(8, "--cache-experts", help="Device expert slots per layer (the model has 16)."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", show_default=False,
                                                 help="Tokens to generate per prompt at most (default 48; 16 with "
                                                      "--quick)."),
    threads: Optional[int] = typer.Option(None, "--threads", help=THREADS_HELP + "; the tiny model's matrices are "
                                          "too small for intra-op threads to pay anyway."),
) -> None:
    """Calibrate, decode with ar / eagle3 / specfit, simulate what-ifs and write one HTML report."""
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from .console import print_table, speedup_text, table_console
    from .runtime.commands import policy_table

    console = Console(stderr=True)
    plan = DemoPlan(out_dir=out, quick=quick, cache_experts=cache_experts, max_new_tokens=max_new_tokens)
    try:
        set_cpu_threads(threads)
        plan.validate()
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                      console=console, transient=True, disable=not console.is_terminal) as bar:
            task = bar.add_task("demo", total=None)
            result = run_demo(plan, say=lambda m: (console.print(m, markup=False), bar.update(task, description=escape(m))),
                              progress=lambda *a: bar.advance(task))
    except ReportCompleted as exc:
        stopped(str(exc))
    except INTERRUPTS as exc:
        kept = (f"what finished is kept under {out} (decode runs keep every complete cycle)" if out.exists()
                else f"nothing was written ({out} was not made)")
        stopped_by(exc, f"interrupted: {kept}; run specfit demo again for the report")

    # decode's per-policy table, without its traffic columns
    table = policy_table(result["decode"].summaries, "Live decoding of the bundled tiny MoE on this machine (measured, "
                         "predicted in brackets; time MAPE (mean absolute % error) of each cycle's time predicted before "
                         "it ran, by the model refitted online and by the profile; union MAPE: of its predicted number of "
                         "distinct experts; hit rate: share of the verified nodes' experts found in the cache)",
                         traffic=False)
    out_console = table_console()
    print_table(out_console, table)
    for line in result["decode"].notes:            # on stdout after the table, as the what-if's
        out_console.print(line, markup=False)
    summary = result["summary"]
    table = Table(title="What-if: the same workload at Qwen3-30B-A3B expert scale (presets, not measurements), "
                        "tokens/s and speed-up vs ar")
    caches = sorted(summary["cache_experts"].unique())
    table.add_column("profile")
    table.add_column("cache")
    policies = list(dict.fromkeys(summary["policy"]))
    for p in policies:
        table.add_column(p, justify="right")
    for (profile, cache), g in summary.groupby(["profile", "cache_experts"], sort=False):
        row = g.set_index("policy")
        table.add_row(str(profile), str(cache), *[f"{row.loc[p, 'tokens_per_s']:.1f} ({speedup_text(row.loc[p, 'speedup_vs_ar'])})"
                                                  for p in policies])
    print_table(out_console, table)
    for line in result["whatif_notes"]:
        out_console.print(f"note: {line}", markup=False)
    from .runtime.commands import identical_text

    same = "n/a" if result["outputs_identical"] is None else identical_text(result["decode"])
    out_console.print(f"greedy outputs identical across policies: {same}; "
                      f"cache sizes simulated: {', '.join(map(str, caches))} experts per layer")
    out_console.print(f"report: {result['report']}", markup=False)     # --out prints as it is
