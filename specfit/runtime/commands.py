"""``specfit decode``: run the target on a prompts file with its experts offloaded to host memory."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import typer

from ..errors import SpecFitError

__all__ = ["register", "decode"]

OUTPUT_FILE = "decode.jsonl"
_MAX_TABLE_ROWS = 20   # the summary stays on one screen; the JSONL has every prompt


def register(app: typer.Typer, traces_app: typer.Typer) -> None:
    app.command("decode")(decode)


def decode(
    model: Path = typer.Option(..., "--model", help="Hugging Face model directory (config.json + safetensors)."),
    prompts: Path = typer.Option(..., "--prompts", help='JSONL file: one {"prompt": "..."} or {"input_ids": [...]} per line.'),
    cache_experts: int = typer.Option(..., "--cache-experts", help="Expert slots per layer on the device (0 streams every expert)."),
    policy: str = typer.Option("ar", "--policy", help="Decoding policy; this version runs 'ar' (autoregressive)."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", help="Tokens to generate per prompt at most."),
    device: str = typer.Option(None, "--device", help="cpu or cuda (default: cuda when available)."),
    dtype: str = typer.Option(None, "--dtype", help="float32 or bfloat16 (default: bfloat16 on cuda, float32 on cpu)."),
    out: Path = typer.Option(None, "--out", help=f"Directory for {OUTPUT_FILE} (one JSON object per prompt)."),
    json_lines: bool = typer.Option(False, "--json", help="Print one JSON object per prompt on stdout and nothing else."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Always generate --max-new-tokens tokens."),
) -> None:
    """Greedy decoding with the experts in host memory and an expert cache on the device.

    Reports, per prompt, tokens/s, bytes copied host-to-device and the expert cache's hit rate."""
    from ..cli import fail

    try:
        records = _run(model, prompts, cache_experts, policy, max_new_tokens, device, dtype, json_lines, ignore_eos)
    except SpecFitError as exc:
        fail(str(exc))
    if out is not None:
        _write_jsonl_atomic(out / OUTPUT_FILE, records)
    if not json_lines:
        _print_summary(records, out)


def _run(model_dir, prompts_path, cache_experts, policy, max_new_tokens, device, dtype, json_lines, ignore_eos):
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..policies import make_policy
    from .config import ModelConfig
    from .decoder import Decoder
    from .loader import load_model, load_tokenizer
    from .prompts import read_prompts

    try:
        chosen = make_policy(policy)
    except ValueError as exc:
        raise SpecFitError(f"--policy: {exc}") from None
    if chosen.name != "ar":
        raise SpecFitError(f"--policy {policy}: needs a drafter (--drafter), and speculative decoding is not "
                           f"available yet in this version; use --policy ar")
    if max_new_tokens < 1:
        raise SpecFitError(f"--max-new-tokens: expected at least 1, got {max_new_tokens}")
    if cache_experts < 0:
        raise SpecFitError(f"--cache-experts: expected a non-negative number of experts, got {cache_experts}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise SpecFitError(f"--device: expected cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise SpecFitError("--device cuda: no CUDA device is available (use --device cpu)")
    dtype = dtype or ("bfloat16" if device == "cuda" else "float32")
    if dtype not in ("float32", "bfloat16"):
        raise SpecFitError(f"--dtype: expected float32 or bfloat16, got {dtype!r}")
    if not model_dir.is_dir():
        raise SpecFitError(f"--model {model_dir}: not a directory")

    config = ModelConfig.from_dir(model_dir)
    tokenizer = load_tokenizer(model_dir)
    prompts = read_prompts(prompts_path, tokenizer, config.vocab_size)
    for prompt in prompts:
        if len(prompt.input_ids) + max_new_tokens > config.max_position_embeddings:
            raise SpecFitError(f"{prompts_path}:{prompt.line}: {len(prompt.input_ids)} prompt tokens + "
                               f"--max-new-tokens {max_new_tokens} exceed the model's max_position_embeddings "
                               f"({config.max_position_embeddings})")

    stderr = Console(stderr=True)
    with stderr.status(f"loading {model_dir}"):
        target = load_model(model_dir, device=device, dtype=dtype, cache_experts=cache_experts)
    decoder = Decoder(target, eos_token_ids=config.eos_token_ids)
    records = []
    columns = (TextColumn("decode"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=stderr, transient=True) as progress:
        task = progress.add_task("decode", total=len(prompts))
        for index, prompt in enumerate(prompts):
            result = decoder.generate(prompt.input_ids, max_new_tokens, ignore_eos=ignore_eos)
            record = {"index": index, "line": prompt.line, "policy": "ar", "cache_experts": cache_experts,
                      **result.to_dict()}
            if tokenizer is not None:
                record["text"] = tokenizer.decode(result.output_ids, skip_special_tokens=True)
            records.append(record)
            if json_lines:
                print(json.dumps(record), flush=True)
            progress.advance(task)
    return records


def _write_jsonl_atomic(path: Path, records: list[dict]) -> None:
    """Write to a temporary file next to ``path`` and rename it over ``path``: a reader never
    sees a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _print_summary(records: list[dict], out: Path | None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="specfit decode (policy ar)")
    for name in ("prompt", "prompt tokens", "new tokens", "tokens/s", "MB H2D", "hit rate", "stop"):
        table.add_column(name, justify="left" if name in ("prompt", "stop") else "right")
    for r in records[:_MAX_TABLE_ROWS]:
        table.add_row(str(r["index"]), str(r["prompt_tokens"]), str(r["n_new_tokens"]), f"{r['tokens_per_s']:.1f}",
                      f"{r['bytes_h2d'] / 1e6:.2f}", f"{r['hit_rate']:.3f}", r["stop_reason"])
    if len(records) > _MAX_TABLE_ROWS:
        table.add_row("...", "", "", "", "", "", "")
    hits = sum(r["hits"] for r in records)
    misses = sum(r["misses"] for r in records)
    decode_tokens = sum(r["decode_tokens"] for r in records)
    decode_time_s = sum(r["decode_time_s"] for r in records)
    table.add_section()
    table.add_row("all", str(sum(r["prompt_tokens"] for r in records)), str(sum(r["n_new_tokens"] for r in records)),
                  f"{decode_tokens / decode_time_s if decode_time_s else 0.0:.1f}",
                  f"{sum(r['bytes_h2d'] for r in records) / 1e6:.2f}",
                  f"{hits / (hits + misses) if hits + misses else 0.0:.3f}", "")
    console = Console()
    console.print(table)
    if out is not None:
        console.print(f"wrote {out / OUTPUT_FILE}")
