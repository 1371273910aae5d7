"""What ``specfit decode`` and ``specfit demo`` print: tables whose figures and names stay whole on a
narrow terminal, user paths printed as they are, notes on stdout after the tables."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
from rich.console import Console
from rich.table import Table

import specfit.console
from specfit.console import print_table
from specfit.runtime import commands
from specfit.runtime.decode_job import DecodeRun

POLICIES = ("ar", "eagle3:16:4", "specfit+online")


def fake_run(n_prompts=2, **fields) -> DecodeRun:
    records = [dict(policy=p, index=i, prompt_tokens=47, n_new_tokens=32, tokens_per_s=494.123 + i,
                    decode_bytes_h2d=32.24e6, decode_hit_rate=0.669, stop_reason="length")
               for p in POLICIES for i in range(n_prompts)]
    summaries = [dict(policy=p, tokens_per_s=1289.2, tokens_per_cycle=2.92, predicted_tokens_per_cycle=3.05,
                      time_per_cycle_s=0.00556, predicted_time_per_cycle_s=0.00561, time_mape=0.1,
                      prior_time_mape=0.27, union_mape=0.09, bytes_per_cycle=3179e3, predicted_bytes_per_cycle=3651e3,
                      nodes_per_cycle=11.8, hit_rate=0.62, overhead_share=0.12) for p in POLICIES]
    return DecodeRun(records=records, cycles=[], summaries=summaries,
                     **{"profile_label": "pcie4", "profile_path": None, "outputs_identical": True, **fields})


def printed_summary(monkeypatch, run, out=None, width=60) -> str:
    """``_print_summary`` on a terminal ``width`` columns wide."""
    text = io.StringIO()
    monkeypatch.setattr(specfit.console, "table_console", lambda: Console(file=text, width=width))
    commands._print_summary(run, out)
    return text.getvalue()


def test_decode_tables_keep_their_figures_and_policy_names_whole_on_a_narrow_terminal(monkeypatch):
    text = printed_summary(monkeypatch, fake_run(), width=60)
    assert "…" not in text
    for policy in POLICIES:
        assert f"│ {policy} " in text, text
    for figure in ("494.1", "495.1", "1289.2", "2.92 (3.05)", "5.56 (5.61)", "3179 (3651)", "11.8"):
        assert figure in text, (figure, text)


def test_a_table_that_fits_prints_at_the_consoles_width():
    table = Table(title="t")
    for name in ("policy", "tokens/s"):
        table.add_column(name)
    table.add_row("specfit+cache+prefetch", "1289.2")
    text = io.StringIO()
    console = Console(file=text, width=80)
    print_table(console, table)
    assert console.width == 80 and max(map(len, text.getvalue().splitlines())) <= 80
    narrow = Console(file=io.StringIO(), width=20)
    print_table(narrow, table)
    assert narrow.width == 20                       # widened for the one table only
    assert "specfit+cache+prefetch" in narrow.file.getvalue() and "1289.2" in narrow.file.getvalue()


def test_decode_prints_user_paths_as_they_are(monkeypatch, tmp_path):
    out = tmp_path / "run[/]3"
    out.mkdir(parents=True)
    (out / "decode.jsonl").write_text("")
    run = fake_run(profile_path=tmp_path / "profiles[x]" / "p.json", trace_path=tmp_path / "chat[v2].parquet",
                   trace_cycles=7)
    run.profile_label = "calibrated [bold] here"
    text = printed_summary(monkeypatch, run, out, width=200)
    assert f"profile: {tmp_path / 'profiles[x]' / 'p.json'}" in text
    assert f"wrote {out / 'decode.jsonl'}" in text
    assert f"wrote {tmp_path / 'chat[v2].parquet'} (7 cycles)" in text
    assert "profile calibrated [bold] here;" in text


def test_decode_tells_outputs_differing_within_rounding_from_a_failure(monkeypatch):
    """Greedy outputs that first differ at a rounding tie of the compute dtype (a tree verification
    pass rounds apart from a one-token pass) are not reported as a failure; others are."""
    run = fake_run(outputs_identical=False, differing_lines=[3, 7], tie_lines=[3, 7], dtype="bfloat16")
    text = " ".join(printed_summary(monkeypatch, run, width=200).split())
    assert "greedy outputs identical across policies: no, within bfloat16 rounding: the outputs of the prompt(s) on " \
           "line(s) 3, 7 first differ where the target's best logits are tied to rounding" in text
    run = fake_run(outputs_identical=False, differing_lines=[3, 7], tie_lines=[3])
    text = " ".join(printed_summary(monkeypatch, run, width=200).split())
    assert "greedy outputs identical across policies: NO (prompt(s) on line(s) 3, 7)" in text


def fake_demo_result(report: Path) -> dict:
    import pandas as pd

    rows = [dict(profile=profile, cache_experts=cache, policy=p, tokens_per_s=tokens_per_s, speedup_vs_ar=speedup)
            for profile in ("pcie4-qwen3", "gh200-qwen3") for cache in (0, 8)
            for p, tokens_per_s, speedup in (("ar", 13.29, 1.0), ("specfit+cache+prefetch", 13.24, 0.996))]
    return {"report": report, "decode": fake_run(notes=["note: a [bold] note about the decode"]),
            "summary": pd.DataFrame(rows), "whatif_notes": ["a [red] note about the what-if"],
            "outputs_identical": True}


def run_demo_command(monkeypatch, out: Path, *args):
    """``specfit demo`` in process, its steps replaced by :func:`fake_demo_result`."""
    from typer.testing import CliRunner

    import specfit.demo
    from specfit.cli import app

    monkeypatch.setattr(specfit.demo, "run_demo", lambda plan, say, progress: fake_demo_result(out / "index.html"))
    return CliRunner().invoke(app, ["demo", "--out", str(out), *map(str, args)])


def test_the_demo_stops_on_a_fault_but_not_on_a_rounding_tie(monkeypatch, tmp_path):
    """A bfloat16 demo (the Python API on a GPU) whose outputs part only at rounding ties goes on and
    says so, as decode does; any other difference stops it (it stopped on both)."""
    from specfit.demo import check_lossless
    from specfit.errors import SpecFitError

    tie = fake_run(outputs_identical=False, differing_lines=[2], tie_lines=[2], dtype="bfloat16")
    check_lossless(tie)
    check_lossless(fake_run())
    with pytest.raises(SpecFitError, match=r"line\(s\) 2, 5, not only at rounding ties; the decoder is not lossless"):
        check_lossless(fake_run(outputs_identical=False, differing_lines=[2, 5], tie_lines=[2], dtype="bfloat16"))
    result = fake_demo_result(tmp_path / "index.html")
    monkeypatch.setattr("specfit.demo.run_demo", lambda plan, say, progress: {**result, "decode": tie,
                                                                              "outputs_identical": False})
    from typer.testing import CliRunner

    from specfit.cli import app

    printed = CliRunner().invoke(app, ["demo", "--out", str(tmp_path)])
    assert printed.exit_code == 0, printed.output
    assert "greedy outputs identical across policies: no, within bfloat16 rounding" in " ".join(printed.stdout.split())


def test_the_demo_prints_its_paths_and_notes_as_they_are(monkeypatch, tmp_path):
    out = tmp_path / "demo[/]x"
    result = run_demo_command(monkeypatch, out)
    assert result.exit_code == 0, result.output
    assert f"report: {out / 'index.html'}" in result.stdout
    assert "note: a [red] note about the what-if" in result.stdout
    assert "note: a [bold] note about the decode" in result.stdout      # after its table, as the what-if's


@pytest.mark.parametrize("with_out", [False, True])
def test_the_per_prompt_table_shows_every_policy_and_says_how_many_rows_it_left_out(monkeypatch, tmp_path, with_out):
    out = tmp_path / "run" if with_out else None
    text = printed_summary(monkeypatch, fake_run(n_prompts=8), out, width=200)    # 24 runs, more than 20 rows
    shown = commands._MAX_TABLE_ROWS // len(POLICIES)
    for policy in POLICIES:
        assert re.search(rf"│ {re.escape(policy)} +│ {8 - shown} more ", text), text
    assert f"{len(POLICIES) * (8 - shown)} more rows not shown" in text
    if with_out:
        assert f"{out / 'decode.jsonl'} has every row" in text
    else:
        assert "decode.jsonl has" not in text and "--out DIR writes every row" in text


def run_decode_command(monkeypatch, tmp_path, run: DecodeRun, *args):
    """``specfit decode ARGS`` in process, the decode itself replaced by ``run``."""
    from typer.testing import CliRunner

    from specfit.cli import app
    from specfit.runtime import decode_job

    def fake_decode(plan, on_record=None, status=None, progress=None, ctx=None):
        for record in run.records:
            on_record(record)
        return run

    monkeypatch.setattr(decode_job.DecodePlan, "validate", lambda plan: None)
    monkeypatch.setattr(decode_job, "run_decode", fake_decode)
    return CliRunner().invoke(app, ["decode", "--model", str(tmp_path / "model"), "--prompts",
                                    str(tmp_path / "prompts.jsonl"), "--cache-experts", "2", *map(str, args)])


def test_decode_notes_follow_its_tables_on_stdout_and_stay_off_a_json_stdout(monkeypatch, tmp_path):
    run = fake_run(notes=["note: the machine was busy"])
    run.summaries[2].update(policy="specfit", tokens_per_s=100.0, predicted_tokens_per_cycle=1.5)   # below ar
    result = run_decode_command(monkeypatch, tmp_path, run, "--policies", "ar,eagle3,specfit")
    assert result.exit_code == 0, result.output
    assert "note:" not in result.stderr
    tables_end = result.stdout.index("greedy outputs identical")
    busy, below = result.stdout.index("note: the machine was busy"), result.stdout.index("note: specfit: 100.0 tokens/s")
    assert tables_end < busy < below
    result = run_decode_command(monkeypatch, tmp_path, run, "--policies", "ar,eagle3,specfit", "--json")
    assert result.exit_code == 0 and "note: the machine was busy" in result.stderr
    assert [json.loads(line)["policy"] for line in result.stdout.splitlines()] == [r["policy"] for r in run.records]


def test_no_progress_line_leaves_a_blank_line_on_a_stderr_that_is_not_a_terminal(monkeypatch, tmp_path):
    result = run_decode_command(monkeypatch, tmp_path, fake_run(), "--policies", "ar,eagle3,specfit")
    assert result.exit_code == 0 and result.stderr == "", repr(result.stderr)
    result = run_demo_command(monkeypatch, tmp_path / "demo")
    assert result.exit_code == 0 and result.stderr == "", repr(result.stderr)


def test_a_run_that_recorded_a_full_trace_names_it_as_the_acceptance_to_pass(monkeypatch, tmp_path):
    run = fake_run()
    run.summaries[1].update(tokens_per_cycle=3.5, predicted_tokens_per_cycle=1.5)     # eagle3: raw probabilities off
    trace = tmp_path / "chat[v2].parquet"
    result = run_decode_command(monkeypatch, tmp_path, run, "--policies", "ar,eagle3,specfit", "--record", trace,
                                "--record-full")
    text = " ".join(result.stdout.split())
    assert result.exit_code == 0 and f"as --acceptance {trace} next time" in text, result.output
    assert "--acceptance TRACE" not in text
    result = run_decode_command(monkeypatch, tmp_path, run, "--policies", "ar,eagle3,specfit")
    assert "(--record TRACE --record-full) and pass it as --acceptance TRACE" in " ".join(result.stdout.split())


def test_demo_quick_keeps_the_max_new_tokens_given_on_the_command_line(monkeypatch, tmp_path):
    import specfit.demo

    plans = []
    monkeypatch.setattr(specfit.demo.DemoPlan, "validate", lambda plan: plans.append(plan))
    run_demo_command(monkeypatch, tmp_path / "demo", "--quick", "--max-new-tokens", "40")
    run_demo_command(monkeypatch, tmp_path / "demo", "--quick")
    assert [plan.max_new_tokens for plan in plans] == [40, 16]


def test_decode_and_demo_name_the_same_quantities_alike(monkeypatch, tmp_path):
    import pandas as pd

    from specfit.demo import _leader_notes

    decode_text = printed_summary(monkeypatch, fake_run(), width=400)
    monkeypatch.undo()
    demo_text = run_demo_command(monkeypatch, tmp_path / "demo").stdout
    for text in (decode_text, demo_text):
        for name in ("time MAPE", "profile's", "union MAPE", "nodes verified", "hit rate", "mean absolute % error"):
            assert name in text, (name, text)
        assert "time error" not in text and "union error" not in text
    summary = pd.DataFrame([dict(profile="pcie4-qwen3", cache_experts=0, policy=p, tokens_per_s=t, speedup_vs_ar=t / 10,
                                 static_n=16) for p, t in (("ar", 10.0), ("static:auto", 14.0), ("specfit", 12.0))])
    assert "static:auto (N=16) 1.40x" in " ".join(_leader_notes(summary, None))      # as simulate's table writes it


def test_the_demo_writes_its_speed_ups_as_the_other_tables_do(monkeypatch, tmp_path):
    import pandas as pd

    from specfit.demo import _leader_notes

    text = run_demo_command(monkeypatch, tmp_path / "demo").stdout
    assert "13.2 (0.996x)" in text and "13.2 (1.00x)" not in text, text      # a 0.4 % loss is not 1.00x
    summary = pd.DataFrame([dict(profile="pcie4-qwen3", cache_experts=0, policy=p, tokens_per_s=t, speedup_vs_ar=t / 10,
                                 static_n=2) for p, t in (("ar", 10.0), ("chain:2", 10.04), ("specfit", 9.96))])
    assert "chain:2 1.004x, specfit 0.996x" in " ".join(_leader_notes(summary, None))
