#!/usr/bin/env bash
# The dependency bounds in pyproject.toml, checked: installs SpecFit with uv's
# `--resolution lowest-direct` (every direct dependency at the lowest version its bound allows,
# the packages they need at their newest) into fresh virtual environments and runs the CLI, the
# quick demo and a subset of the tests there, twice:
#   1. the library alone (no test-only extra): its own bounds, `specfit --help`, `specfit demo --quick`
#      and the tests that need neither transformers nor Ray;
#   2. with the dev extra (transformers, Ray, the test tools): the tests of the CLI, search,
#      simulator, traces, reports, calibration, sweeps and the model loader.
# `--highest` does the same at the newest releases. Needs uv (`pip install uv`) and PyPI; about
# 15 minutes on 2 cores. Not run by CI (its time budget is tight).
#
#   bash scripts/check_min_versions.sh [--highest]
#
# PYTHON: the interpreter (default python3). TORCH: how pip installs torch first (default
# `torch==2.13.0`, which is the CPU build on this project's machines; elsewhere on Linux x86-64 add
# `--index-url https://download.pytorch.org/whl/cpu`; `TORCH=torch==2.4.0` tries the library's floor, which the
# dev extra's `torch>=2.6` then raises for transformers 5). MINVER_DIR: where the environments go.
set -euo pipefail
cd "$(dirname "$0")/.."
resolution=lowest-direct
[ "${1:-}" = --highest ] && resolution=highest
PYTHON=${PYTHON:-python3}
TORCH=${TORCH:-torch==2.13.0}
dir=${MINVER_DIR:-${TMPDIR:-/tmp}/specfit-minver}
command -v uv >/dev/null || { echo "error: uv not found: pip install uv" >&2; exit 2; }
rm -rf "$dir" && mkdir -p "$dir"
# the kernels compiled by another numba stay out of the work tree's cache
export NUMBA_CACHE_DIR="$dir/numba" OMP_NUM_THREADS=1
direct='^(numpy|numba|scipy|pandas|pyarrow|scikit-learn|threadpoolctl|matplotlib|typer|click|rich|safetensors|tokenizers|torch|ray|pyyaml|transformers|jinja2|pytest|pytest-timeout|hypothesis)=='

venv() {   # venv NAME REQUIREMENT...: a fresh environment, torch first, then the requirements at $resolution
  local env="$dir/$1"; shift
  "$PYTHON" -m venv "$env"
  # shellcheck disable=SC2086  # TORCH may carry pip options
  "$env/bin/python" -m pip install -q $TORCH
  uv pip install -q --python "$env/bin/python" --resolution "$resolution" "$@"
  echo "== $(basename "$env") ($resolution): $(uv pip freeze --python "$env/bin/python" | grep -iE "$direct" | tr '\n' ' ')"
}

venv lib -e . "pytest>=7" "pytest-timeout>=2.1" "hypothesis>=6.80"
py="$dir/lib/bin/python"
"$py" -m specfit --help >/dev/null
"$py" -m specfit demo --quick --out "$dir/demo" >/dev/null
# the NNLS reference fit of this one test needs the dev extra's scipy
"$py" -m pytest -q -p no:cacheprovider tests/test_cli_help.py tests/test_command_output.py tests/test_simulate.py \
  tests/test_traces.py tests/test_report.py tests/test_report_parts.py tests/test_search.py tests/test_eagle3.py \
  tests/test_learned_predictor.py tests/test_calibrate_fit.py \
  --deselect tests/test_calibrate_fit.py::test_a_miss_is_never_fitted_cheaper_than_a_hit

venv dev -e '.[dev]'
"$dir/dev/bin/python" -m pytest -q -p no:cacheprovider tests/test_cli_help.py tests/test_search.py tests/test_simulate.py \
  tests/test_traces.py tests/test_report.py tests/test_report_parts.py tests/test_calibrate_fit.py tests/test_sweep.py \
  tests/test_sweep_grid.py tests/test_runtime_loader.py tests/test_runtime_decode.py tests/test_learned_predictor.py \
  tests/test_formats_families.py tests/test_bad_input_traces.py tests/test_io_and_run_dirs.py tests/test_command_output.py
echo "the bounds hold ($resolution)"
