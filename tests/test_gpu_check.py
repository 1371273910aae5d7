"""benchmarks/gpu_check.py keeps working without a GPU: it runs on the CPU with tiny shapes."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

from runtime_fixtures import torch_single_thread  # noqa: F401  (autouse: one intra-op thread)


def test_gpu_check_runs_on_the_cpu_with_tiny_shapes(capsys):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    summaries = gpu_check.main(["--device", "cpu", "--shape", "tiny", "--layers", "2", "--prompts", "1",
                                "--prompt-tokens", "8", "--new-tokens", "6", "--draft-vocab", "256"])
    assert [s["policy"] for s in summaries] == ["ar", "eagle3", "specfit"]
    for s in summaries:
        assert s["cycles"] > 0 and s["time_per_cycle_s"] > 0 and math.isfinite(s["predicted_time_per_cycle_s"])
    assert summaries[1]["nodes_per_cycle"] > summaries[0]["nodes_per_cycle"] == 1.0
    out = capsys.readouterr().out
    assert "H2D" in out and "measured vs predicted" in out
