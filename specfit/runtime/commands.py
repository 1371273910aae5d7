"""``specfit decode``: decode a prompts file on the offloaded target, autoregressively or
speculatively with any policy, and compare every cycle's measurement with its prediction."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..experts.cache import cache_mode_name
from ..errors import INTERRUPTS, Interrupted, comma_list, fail, stopped, stopped_by
from ..io import strict_dumps
from ..policies import LIVE_POLICY_HELP
from ..threads import THREADS_HELP, set_cpu_threads
from .prefill import PREFILL_CHUNK, PREFILL_CHUNK_HELP
from .run_dir import CYCLES_FILE, OUTPUT_FILE, SUMMARY_FILE

__all__ = ["register", "decode", "identical_text"]

_MAX_TABLE_ROWS = 20   # the per-prompt table stays on one screen; the JSONL has every prompt


def identical_text(run) -> str:
    """The answer to "greedy outputs identical across policies?" for a greedy run of several
    policies (rich markup): a difference the compute dtype's rounding explains is not a failure."""
    if run.outputs_identical:
        return "yes"
    lines = ", ".join(map(str, run.differing_lines))
    if run.outputs_within_rounding:
        return (f"no, within {run.dtype} rounding: the outputs of the prompt(s) on line(s) {lines} first differ "
                f"where the target's best logits are tied to rounding (a tree verification pass rounds apart from "
                f"a one-token pass)")
    return f"[red]NO[/red] (prompt(s) on line(s) {lines})"


def register(app: typer.Typer, traces_app: typer.Typer) -> None:
    app.command("decode")(decode)


def decode(
    ctx: typer.Context,
    model: Path = typer.Option(..., "--model", help="Hugging Face model directory (config.json + safetensors)."),
    prompts: Path = typer.Option(..., "--prompts", help='JSONL file, one prompt per line: {"prompt": "..."}, {"input_ids": '
                                 '[...]} or a chat, {"messages": [{"role": "user", "content": "..."}]} (rendered with '
                                 'the model\'s chat template, as a server does; optional "chat_template_kwargs": '
                                 '{"enable_thinking": false}; needs the chat extra: transformers and jinja2).'),
    cache_experts: int = typer.Option(..., "--cache-experts", help="Expert slots per layer on the device, or in all with "
                                      "--cache-mode global (0 streams every expert)."),
    cache_mode: str = typer.Option("per_layer", "--cache-mode", callback=cache_mode_name,
                                    help="per_layer (or per-layer) or global (as in simulate)."),
    cache_policy: str = typer.Option("lru", "--cache-policy",
                                     help="Eviction: lru, lfu, fifo or moe-infinity (as in simulate)."),
    predictor: str = typer.Option("router", "--predictor", help="Expert predictor the policies decide with: router (the "
                                  "target's routers on the drafter's state), or affinity, learned or parent (learned "
                                  "from the run's verified tokens)."),
    router_fixed: bool = typer.Option(False, "--router-fixed", help="--predictor router with its configured context "
                                      "weight at every layer (no per-layer weights learned from the verified nodes)."),
    predictor_trace: Optional[Path] = typer.Option(None, "--predictor-trace", help="A recorded trace of this model "
                                                   "(--record-full) to fit --predictor affinity or learned on before "
                                                   "decoding; it goes on learning from the run."),
    drafter: Optional[Path] = typer.Option(None, "--drafter", help="EAGLE-3 drafter directory (published format); "
                                           "every policy but ar needs one."),
    policy: str = typer.Option("ar", "--policy", help=f"Decoding policy: {LIVE_POLICY_HELP}."),
    policies: Optional[str] = typer.Option(None, "--policies", help="Several policies, comma-separated, each decoding "
                                           "every prompt (replaces --policy), e.g. ar,eagle3,specfit."),
    profile: Optional[str] = typer.Option(None, "--profile", help="Hardware profile the policies predict with: a preset "
                                          "(pcie4, pcie5, gh200) or a JSON file; default: this machine's profile for "
                                          "the model, calibrated quickly on first use."),
    rescale: bool = typer.Option(False, "--rescale", help="Allow a profile made for another model shape."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", help="Tokens to generate per prompt at most."),
    temperature: float = typer.Option(0.0, "--temperature", help="0: greedy; above 0: sampling, lossless tree "
                                      "speculative sampling for the drafting policies (specfit then learns its "
                                      "acceptance online from what sampling accepts: specfit+online)."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed: each policy's random stream starts from it and runs on "
                             "from prompt to prompt (a prompt's sample depends on the prompts before it). Policies "
                             "with fixed trees (ar, chain, static, eagle3) sample the same each time; specfit's trees "
                             "depend on the cycle times it measures, so its samples, each drawn from the target's "
                             "distribution, can differ from run to run."),
    tree_top_k: int = typer.Option(4, "--tree-top-k", help="EAGLE tree expansion: children per node and nodes expanded per level."),
    max_levels: int = typer.Option(8, "--max-levels", help="Draft levels at most for specfit, static:N, sequoia:N (specfit:D and sequoia:N:D set their own D) and --record-full."),
    acceptance: Optional[Path] = typer.Option(None, "--acceptance", help="Trace to fit an acceptance calibrator on "
                                              "(draft probability -> acceptance probability; sequoia:N fits its positional acceptance rates on it "
                                              "too); default: the drafter's."),
    device: str = typer.Option(None, "--device", help="cpu, cuda or cuda:N (default: cuda when available)."),
    dtype: str = typer.Option(None, "--dtype", help="float32, bfloat16 or float16 (default: bfloat16 on cuda, float32 on cpu). In "
                              "bfloat16 or float16 a policy's greedy output can leave ar's where the target's best "
                              "logits tie to that dtype's rounding (a tree pass rounds apart from a one-token pass)."),
    out: Path = typer.Option(None, "--out", help=f"Directory for {OUTPUT_FILE} (per prompt), {CYCLES_FILE} (per cycle) "
                             f"and {SUMMARY_FILE} (per policy)."),
    record: Optional[Path] = typer.Option(None, "--record", help="Write the decoded cycles as a trace (Parquet)."),
    record_full: bool = typer.Option(False, "--record-full", help="With --record: verify the whole drafted tree at every "
                                     "position of the greedy output (a trace `specfit simulate` replays exactly)."),
    json_lines: bool = typer.Option(False, "--json", help="Print one JSON object per prompt and policy on stdout and nothing else."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Always generate --max-new-tokens tokens."),
    threads: Optional[int] = typer.Option(None, "--threads", help=THREADS_HELP + "."),
    online_refit: bool = typer.Option(True, "--online-refit/--frozen-profile", help="Refit the cost model on the "
                                      "run's recent cycles as it goes, the profile as the prior (default), or keep "
                                      "the profile frozen (experiments that need a fixed model; specfit still prices its own decisions at their "
                                      "measured time)."),
    interleave: bool = typer.Option(False, "--interleave", help="Decode each prompt with every policy in turn (the "
                                    "order rotating) instead of policy after policy, with one expert cache for all: "
                                    "a machine whose speed drifts then slows every policy alike. A replay gives each "
                                    "policy its own cache: add --cache-per-policy to compare with one."),
    cache_per_policy: bool = typer.Option(False, "--cache-per-policy", help="With --interleave: each policy keeps its "
                                          "own expert cache across the prompts, as policy after policy would (the "
                                          "caches take turns on the device between prompts, off the clock)."),
    prefill_chunk: int = typer.Option(PREFILL_CHUNK, "--prefill-chunk", help=PREFILL_CHUNK_HELP),
) -> None:
    """Decode with the experts in host memory and an expert cache on the device.

    Reports, per prompt and policy, tokens/s, bytes copied host-to-device and the cache's hit rate, and per policy the measured cycle time, tokens per cycle and bytes next to the profile's predictions."""  # one line: typer keeps a paragraph's line breaks
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .decode_job import DecodePlan, run_decode

    if policies is None and "," in policy:
        fail(f"--policy: expected one policy, got {policy!r}; several are passed as --policies {policy}")
    names = [policy] if policies is None else comma_list(policies, "--policies", "policy", "ar,eagle3,specfit")
    plan = DecodePlan(model_dir=model, prompts_path=prompts, cache_experts=cache_experts, policies=names,
                      drafter_dir=drafter, profile=profile, rescale=rescale, max_new_tokens=max_new_tokens,
                      device=device, dtype=dtype, out_dir=out, record=record, record_full=record_full,
                      temperature=temperature, seed=seed, tree_top_k=tree_top_k, max_levels=max_levels,
                      acceptance_trace=acceptance, ignore_eos=ignore_eos, cache_mode=cache_mode,
                      cache_policy=cache_policy, predictor=predictor, predictor_trace=predictor_trace,
                      router_adapt=not router_fixed,
                      online_refit=online_refit, interleave=interleave,
                      cache_per_policy=cache_per_policy, prefill_chunk=prefill_chunk)
    stderr = Console(stderr=True)
    set_cpu_threads(threads)
    plan.validate()

    def emit(record_: dict) -> None:
        if json_lines:
            print(strict_dumps(record_), flush=True)

    # loading and calibration messages live in the transient progress line: on error, stderr
    # holds the one error line only (a pipe or a file gets no progress line: rich would leave a
    # blank line there when it goes)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    try:
        with Progress(*columns, console=stderr, transient=True, disable=not stderr.is_terminal) as bar:
            task = bar.add_task("decode", total=None)

            def status(message: str) -> None:
                bar.update(task, description=escape(message))   # it names the model's directory

            def tick() -> None:
                bar.advance(task)

            result = run_decode(plan, on_record=emit, status=status, progress=tick, ctx=ctx)
    except Interrupted as exc:
        stopped(str(exc))
    except INTERRUPTS as exc:
        # before the run began (its checks, the --out lock), or a second Ctrl-C while the first one's
        # cycles were being saved: the command cannot tell which, so it claims neither
        stopped_by(exc, "interrupted before the run could say what it kept (with --out, every cycle completed before "
                        "it is in that directory)")
    if json_lines:
        for line in result.notes:                  # stdout holds the JSON alone
            stderr.print(line, markup=False)
        return
    notes = result.notes
    if acceptance is None and temperature == 0:
        notes = notes + raw_acceptance_notes(result.summaries, recorded=record if record_full else None)
    _print_summary(result, out, notes)


# predicted tokens per cycle this far from the committed ones say the drafter's probabilities are
# not what the target accepts
RAW_ACCEPTANCE_OFF = 0.15


def raw_acceptance_notes(summaries: list[dict], recorded: Path | None = None) -> list[str]:
    """Notes for a run decided with the drafter's raw probabilities (no ``--acceptance``): one per
    drafting policy whose predicted tokens per cycle were more than :data:`RAW_ACCEPTANCE_OFF` off
    the committed ones. SpecFit prices every subtree with those probabilities; the bundled drafter's
    raw ones predicted well under half the tokens an EAGLE-3 tree committed, and SpecFit, taking
    them at their word, drafted levels that did not pay (slower than ``ar``: ``benchmarks/RESULTS.md``,
    "Stop 33: `specfit decode` without an acceptance calibration"). A SpecFit policy that ran
    slower than ``ar`` in the same run gets the note at any error: what it chose is where those
    probabilities were most optimistic, so a small average error can still cost it the run.
    ``recorded``: the full trace this run wrote (``--record --record-full``), the one to pass."""
    advice = (f"Pass the trace this run recorded as --acceptance {recorded} next time" if recorded is not None
              else "Record a trace of this model and drafter (--record TRACE --record-full) and pass it as "
                   "--acceptance TRACE, as specfit demo does")
    notes = []
    ar_rate = next((s.get("tokens_per_s", float("nan")) for s in summaries if s["policy"] == "ar"), float("nan"))
    for s in summaries:
        real, predicted = s.get("tokens_per_cycle", float("nan")), s.get("predicted_tokens_per_cycle", float("nan"))
        if s["policy"] == "ar" or "+online" in s["policy"] or not real > 1.0 or not predicted == predicted:
            continue
        off = (predicted - real) / real
        deciding, rate = s["policy"].startswith("specfit"), s.get("tokens_per_s", float("nan"))
        behind = deciding and rate < ar_rate
        if abs(off) > RAW_ACCEPTANCE_OFF or behind:
            notes.append(f"note: {s['policy']}: "
                         + (f"{rate:.1f} tokens/s, below ar's {ar_rate:.1f}; " if behind else "")
                         + f"the drafter's raw probabilities predicted {predicted:.2f} tokens per "
                         f"cycle where {real:.2f} were committed ({off:+.0%}); "
                         + ("SpecFit decides with them" if deciding else
                            "the predicted tokens and times use them, as specfit would decide with them")
                         + f". {advice}")
    return notes


def policy_table(summaries: list[dict], title: str, traffic: bool = True):
    """The per-policy table of a decode's summaries, measured (predicted): rates, cycle times, the
    errors of their predictions, trees and the cache; with ``traffic`` the bytes per cycle and the
    search and bookkeeping's share (``specfit decode``; the demo shows it without them)."""
    from rich.table import Table

    from ..console import figure_text

    table = Table(title=title)
    names = ("policy", "tokens/s", "tokens/cycle", "ms/cycle", "time MAPE", "profile's", "union MAPE",
             *(("KB H2D/cycle",) if traffic else ()), "nodes verified", "hit rate", *(("search+book.",) if traffic else ()))
    for name in names:
        table.add_column(name, justify="left" if name == "policy" else "right")
    for s in summaries:
        bytes_cell = (f"{figure_text(s['bytes_per_cycle'] / 1e3, '.0f')} "
                      f"({figure_text(s['predicted_bytes_per_cycle'] / 1e3, '.0f')})",)
        table.add_row(s["policy"], figure_text(s["tokens_per_s"], ".1f"),
                      f"{figure_text(s['tokens_per_cycle'], '.2f')} ({figure_text(s['predicted_tokens_per_cycle'], '.2f')})",
                      f"{figure_text(s['time_per_cycle_s'] * 1e3, '.2f')} "
                      f"({figure_text(s['predicted_time_per_cycle_s'] * 1e3, '.2f')})",
                      *(figure_text(s[k], ".0%") for k in ("time_mape", "prior_time_mape", "union_mape")),
                      *(bytes_cell if traffic else ()), figure_text(s["nodes_per_cycle"], ".1f"),
                      figure_text(s["hit_rate"], ".2f"),
                      *((figure_text(s.get("overhead_share"), ".0%"),) if traffic else ()))
    return table


def _print_summary(run, out: Path | None, notes: list[str] = ()) -> None:
    """The tables and what the run wrote on stdout, then ``notes`` about the results (after the tables,
    on stdout as the demo's: a log of the run keeps them)."""
    from rich.markup import escape
    from rich.table import Table

    from ..console import figure_text, print_table, table_console

    console = table_console()
    records = run.records
    by_policy = {}
    for r in records:
        by_policy.setdefault(r["policy"], []).append(r)
    shown = max(1, _MAX_TABLE_ROWS // max(1, len(by_policy)))     # rows per policy: every policy shows
    hidden = sum(max(0, len(rows) - shown) for rows in by_policy.values())
    where = (f"{out / OUTPUT_FILE} has every row" if out is not None
             else f"--out DIR writes every row to DIR/{OUTPUT_FILE}, --json prints them")
    table = Table(title=f"specfit decode: per prompt ({len(records)} runs); tokens/s, MB H2D and hit rate over the "
                        f"decode cycles (the prompt's pass is in the rows' bytes_h2d, hits and misses: --out, --json)",
                  caption=escape(f"{hidden} more rows not shown ({shown} per policy here); {where}") if hidden else None)
    for name in ("policy", "prompt", "prompt tokens", "new tokens", "tokens/s", "MB H2D", "hit rate", "stop"):
        table.add_column(name, justify="left" if name in ("policy", "prompt", "stop") else "right")
    for policy, rows in by_policy.items():
        for r in rows[:shown]:
            table.add_row(r["policy"], str(r["index"]), str(r["prompt_tokens"]), str(r["n_new_tokens"]),
                          figure_text(r["tokens_per_s"], ".1f"), f"{r['decode_bytes_h2d'] / 1e6:.2f}",
                          figure_text(r["decode_hit_rate"], ".3f"), r["stop_reason"])
        if len(rows) > shown:
            table.add_row(policy, f"{len(rows) - shown} more", "", "", "", "", "", "")
    print_table(console, table)

    print_table(console, policy_table(
        run.summaries, f"measured (predicted) per policy, profile {escape(run.profile_label)}; tokens/s over the "
        f"measured cycles; time MAPE (mean absolute % error) of each cycle's predicted time, by the model the policy "
        f"decided with (online-refitted unless --frozen-profile) and by the profile; union MAPE: of its predicted "
        f"number of distinct experts; KB H2D/cycle: 10^3 bytes copied host-to-device per cycle; hit rate: share of "
        f"the verified nodes' experts found in the cache; search+book.: share of the measured time outside the "
        f"drafter's and the target's passes (decisions, expert predictions, bookkeeping)"))
    if run.memory:
        m = run.memory
        pinned = f", pinned {m['pinned_bytes'] / 1e9:.3f} GB" if m["pinned_bytes"] else " (pageable: no GPU)"
        console.print(f"host experts {m['host_expert_bytes'] / 1e9:.3f} GB{pinned}; device expert slots "
                      f"{m['device_expert_bytes'] / 1e9:.3f} GB")
    if run.drafter_features:
        console.print(f"drafter features: {run.drafter_features}")
    if run.outputs_identical is not None:
        console.print("greedy outputs identical across policies: " + identical_text(run))
    if run.profile_path is not None:
        console.print(f"profile: {run.profile_path}", markup=False)    # paths print as they are
    if out is not None:
        # (no cycles.parquet when no cycle ran: an output that ended at the prefill's token)
        console.print("wrote " + ", ".join(str(out / f) for f in (OUTPUT_FILE, CYCLES_FILE, SUMMARY_FILE)
                                           if (out / f).exists()), markup=False)
    if run.trace_path is not None:
        console.print(f"wrote {run.trace_path} ({run.trace_cycles} cycles)", markup=False)
    for line in notes:
        console.print(line, markup=False)
